"""``mfgserve-status``: what every server of a cluster is doing, one row per server.

    mfgserve-status --cluster cluster.yaml [--json] [--timeout-s 5] [--curve-secret-key F]

Every endpoint of the cluster file is asked at once (a STATUS request, answered on each
server's IO thread even while its samplers are busy), and all of them together get at most
--timeout-s seconds. A server that has not answered by then is reported down with what its
connection's events say (common/rpc.py): connection refused (the process died or was
stopped), connected but silent (frozen or overloaded), no answer at all (host unreachable),
or a refused CurveZMQ handshake.

Columns: state (up; error: it answered, but with an error instead of a status, e.g. an older
server; wrong-part: it serves another part than the cluster file says; down: see the note
under the table); trainers (trainer connections that sent a request within the last minute);
req/s and seeds/s (over the last minute); queue now/peak/max (SAMPLE requests queued now, the
most since start, the server's --max-queue); errors (error replies since start, by code);
rss/pss (the server and its sampler processes; pss n/a where the platform cannot read it);
samplers alive (alive/started, threads or processes); ring/wire (sample replies whose features
went into a trainer's shared-memory ring / travelled on the wire). --json prints all of it
and more (node tensor bytes, set id, host, pid, totals since start) as one document.

Exit code: 0 when every part has at least one live server, 1 when some part has none (named
on stderr), 2 for bad input (a missing or malformed cluster file, a bad option).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

import zmq

from common.cli import run_main
from common.cluster import ClusterSpec
from common.config import StatusConfig, add_config_args, load_config
from common.errors import MfgServeError, ProtocolError, RemoteError
from common.jsonout import dumps_strict
from common.messages import Message, StatusReply, StatusRequest
from common.rpc import RpcChannel
from common.sockets import CurveKeys, Deadline

PROG = "mfgserve-status"
SETTING = "--timeout-s"


@dataclass
class ServerState:
    """One endpoint of the cluster file and what came of asking it."""

    part: int
    replica: int  # position among the part's endpoints in the cluster file
    endpoint: str
    state: str  # up | error (answered, but no status) | wrong-part | down
    reason: str = ""
    status: StatusReply | None = None

    @property
    def live(self) -> bool:
        return self.state in ("up", "error")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, StatusConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mfgserve-status`` (errors mapped by :func:`common.cli.run_main`)."""
    return run_main(PROG, lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    cfg = load_config(StatusConfig, None, build_parser().parse_args(argv))
    cluster = ClusterSpec.load(cfg.cluster)
    curve = cluster.client_keys(cfg.curve_secret_key, cfg.cluster)
    states = ask_all(cluster, cfg.timeout_s, curve)
    missing = [p for p in sorted(cluster.partitions)
               if not any(s.live for s in states if s.part == p)]
    print(dumps_strict(to_json(cfg.cluster, states, missing), indent=1) if cfg.json
          else render_table(states), flush=True)
    for part in missing:
        why = "; ".join(f"{s.endpoint}: {s.state}: {s.reason}" for s in states if s.part == part)
        print(f"{PROG}: part {part} has no live server ({why})", file=sys.stderr, flush=True)
    return 1 if missing else 0


# --------------------------------------------------------------------------- asking


def ask_all(cluster: ClusterSpec, timeout_s: float, curve: CurveKeys | None
            ) -> list[ServerState]:
    """Every endpoint's state: all asked at once, all answered (or given up) within
    ``timeout_s`` seconds together."""
    ctx = zmq.Context()
    deadline = Deadline(timeout_s)
    servers = [(part, replica, ep) for part in sorted(cluster.partitions)
               for replica, ep in enumerate(cluster.partitions[part])]
    channels: list[RpcChannel] = []
    try:
        for _, _, ep in servers:
            channels.append(RpcChannel(ctx, ep, timeout_s=timeout_s, setting=SETTING,
                                       curve=curve))
            channels[-1].send(StatusRequest())
        answers = wait_all(channels, deadline)
        return [outcome(part, replica, ep, answers.get(i) or _silent(channels[i], timeout_s))
                for i, (part, replica, ep) in enumerate(servers)]
    finally:
        for ch in channels:
            ch.close()
        ctx.term()


def wait_all(channels: list[RpcChannel], deadline: Deadline
             ) -> dict[int, Message | MfgServeError]:
    """The reply (or the error) of each channel that answered or dropped before
    ``deadline``, by index; one poll over every socket and connection monitor."""
    done: dict[int, Message | MfgServeError] = {}
    poller = zmq.Poller()
    for ch in channels:
        poller.register(ch.sock, zmq.POLLIN)
        poller.register(ch.monitor, zmq.POLLIN)
    while len(done) < len(channels) and deadline.left() > 0:
        poller.poll(int(deadline.left() * 1000) + 1)
        for i, ch in enumerate(channels):
            if i not in done and _settled(ch):
                done[i] = _receive(ch)
                poller.unregister(ch.sock)
                poller.unregister(ch.monitor)
    return done


def _settled(ch: RpcChannel) -> bool:
    """A reply is waiting, or the connection dropped with the request unanswered."""
    ch.poll_events()
    return bool(ch.lost) or bool(ch.sock.poll(0))


def _receive(ch: RpcChannel) -> Message | MfgServeError:
    try:
        return ch.recv(0.0, waiting_for="its STATUS reply")[0]
    except MfgServeError as e:  # a dropped connection, an error reply, a bad reply
        return e


def _silent(ch: RpcChannel, timeout_s: float) -> MfgServeError:
    return MfgServeError(f"no reply within {timeout_s:g}s: {ch.diagnose(0.0, dropped=False)}; "
                         f"raise {SETTING} if it is only slow")


def outcome(part: int, replica: int, endpoint: str, answer: Message | MfgServeError
            ) -> ServerState:
    state = ServerState(part, replica, endpoint, "down")
    if isinstance(answer, StatusReply):
        state.status = answer
        state.state = "up" if answer.part_id == part else "wrong-part"
        if answer.part_id != part:
            state.reason = (f"it serves part {answer.part_id} of partition set "
                            f"{answer.set_id}, not part {part}: fix the cluster file")
    elif isinstance(answer, (RemoteError, ProtocolError)):  # alive, but gave no status
        state.state, state.reason = "error", f"{answer} (an older server version?)"
    elif isinstance(answer, Message):
        state.state, state.reason = "error", f"answered {type(answer).__name__}, not a status"
    else:
        state.reason = str(answer)
    return state


# --------------------------------------------------------------------------- output


def derived(st: StatusReply) -> dict[str, float]:
    """The numbers the table shows that are not fields of the reply."""
    win, tot = st.window, st.stats
    span = st.window_s if st.window_s > 0 else float("nan")
    sampled = tot.get("sample_requests", 0.0)
    return {"requests_per_s": win.get("requests", 0.0) / span,
            "seeds_per_s": win.get("seeds_served", 0.0) / span,
            "errors_per_s": win.get("errors", 0.0) / span,
            "error_replies": sum(st.error_codes.values()),
            "ring_replies": tot.get("ring_replies", 0.0),
            "wire_replies": sampled - tot.get("ring_replies", 0.0)}


def to_json(cluster_file: str, states: list[ServerState], missing: list[int]) -> dict:
    parts = sorted({s.part for s in states})
    return {
        "cluster": cluster_file, "ok": not missing, "missing_parts": missing,
        "parts": {str(p): {"servers": sum(s.part == p for s in states),
                           "live": sum(s.part == p and s.live for s in states)}
                  for p in parts},
        "servers": [{"part": s.part, "replica": s.replica, "endpoint": s.endpoint,
                     "state": s.state, "reason": s.reason,
                     "status": dataclasses.asdict(s.status) if s.status else None,
                     "derived": derived(s.status) if s.status else None} for s in states]}


COLUMNS = ("server", "part", "replica", "state", "uptime", "trainers", "req/s", "seeds/s",
           "queue now/peak/max", "errors", "rss/pss", "samplers alive", "ring/wire")


def _bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return ""


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _errors(codes: dict[str, float]) -> str:
    if not codes:
        return "0"
    return ",".join(f"{k}={v:.0f}" for k, v in sorted(codes.items()))


def row(s: ServerState) -> list[str]:
    head = [s.endpoint, str(s.part), str(s.replica), s.state]
    st = s.status
    if st is None:
        return head + ["-"] * (len(COLUMNS) - len(head))
    d, tot = derived(st), st.stats
    pss = _bytes(tot.get("mem_pss_bytes", 0.0)) if st.pss_available else "n/a"
    return head + [
        _duration(st.uptime_s), str(st.trainers), f"{d['requests_per_s']:.1f}",
        f"{d['seeds_per_s']:.0f}",
        f"{tot.get('queue_len', 0):.0f}/{st.queue_peak}/{st.queue_limit}",
        _errors(st.error_codes), f"{_bytes(tot.get('mem_rss_bytes', 0.0))}/{pss}",
        f"{st.samplers_alive}/{st.samplers} {st.sampler_kind}",
        f"{d['ring_replies']:.0f}/{d['wire_replies']:.0f}"]


def render_table(states: list[ServerState]) -> str:
    rows = [list(COLUMNS)] + [row(s) for s in states]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    notes = [f"{s.endpoint} (part {s.part}): {s.state}: {s.reason}"
             for s in states if s.reason]
    return "\n".join(lines + ([""] + notes if notes else []))


if __name__ == "__main__":
    sys.exit(main())
