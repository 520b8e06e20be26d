"""The replica policy alone (common/replicas.py): which replica a request goes to, suspects
avoided for the window, the fallback when every replica is down, failover at most once per
replica with each request answered exactly once, error replies failing only their own
request. The channels are in-process stand-ins scripted per endpoint; tests/test_failover.py
runs the same code against real server processes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from common.errors import MfgServeError, PeerDisconnectedError, PeerTimeoutError, RemoteError
from common.replicas import ReplicaSet

pytestmark = pytest.mark.timeout(30)


@dataclass
class Req:
    TYPE = SimpleNamespace(name="REQ")
    body: int = 0
    set_id: str = ""


@dataclass
class Rep:
    endpoint: str
    body: int


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeChannel:
    """An RpcChannel stand-in whose server does what ``mode`` says when a reply is awaited:
    "answer" (the oldest request), "error" (an error reply to it), "timeout", or "drop" (the
    connection drops: every request in flight is lost)."""

    rids = iter(range(1, 10**9))

    def __init__(self, endpoint: str, clock: Clock, mode: str = "answer"):
        self.endpoint, self.clock, self.mode = endpoint, clock, mode
        self.up = True
        self.last_disconnect = 0.0
        self.bytes_received = 0
        self.pending: dict[int, Req] = {}
        self.lost: set[int] = set()
        self.sent: deque = deque()  # (rid, msg), every request ever sent here
        self.closed = False

    def poll_events(self) -> None:
        pass

    def send(self, msg) -> int:
        rid = next(self.rids)
        self.pending[rid] = msg
        self.sent.append((rid, msg))
        return rid

    def forget(self, rids) -> None:
        for rid in rids:
            self.pending.pop(rid, None)
        self.lost -= set(rids)

    def recv(self, timeout_s=None, waiting_for="", meanwhile=None):
        if self.lost or self.mode == "drop":
            if self.up:
                self.up, self.last_disconnect = False, self.clock()
            self.lost |= set(self.pending)
            self.pending.clear()
            raise PeerDisconnectedError(f"{self.endpoint} dropped while waiting for "
                                        f"{waiting_for}")
        if self.mode == "timeout" or not self.pending:
            raise PeerTimeoutError(f"no reply from {self.endpoint}")
        rid, msg = next(iter(self.pending.items()))
        del self.pending[rid]
        self.bytes_received += 10
        if self.mode == "error":
            raise RemoteError(self.endpoint, "bad_request", "refused", rid)
        return Rep(self.endpoint, msg.body), rid

    def close(self) -> None:
        self.closed = True


def _set(modes: dict[int, list[str]], suspect_s: float = 30.0, **kw):
    """A replica set over parts -> one scripted channel per mode."""
    clock = Clock()
    parts = {p: [f"p{p}r{i}" for i in range(len(m))] for p, m in modes.items()}
    mode_of = {f"p{p}r{i}": mode for p, m in modes.items() for i, mode in enumerate(m)}
    rs = ReplicaSet(parts, lambda ep: FakeChannel(ep, clock, mode_of[ep]),
                    suspect_s=suspect_s, clock=clock, **kw)
    return rs, clock


def _answered_by(rs: ReplicaSet, part: int, n: int) -> list[str]:
    return [rs.wait(rs.submit(part, Req(i))).endpoint for i in range(n)]


def test_round_robin_over_healthy_replicas_only():
    rs, _ = _set({0: ["answer", "answer", "answer"]})
    assert _answered_by(rs, 0, 6) == ["p0r0", "p0r1", "p0r2"] * 2
    rs.channel("p0r1").up = False  # its connection dropped: skipped until it reconnects
    assert _answered_by(rs, 0, 4) == ["p0r0", "p0r2"] * 2
    rs.channel("p0r1").up = True
    assert set(_answered_by(rs, 0, 3)) == {"p0r0", "p0r1", "p0r2"}
    assert rs.failovers == 0 and not rs._inflight and not rs._buffered


def test_a_replica_dropped_idle_is_logged_once_per_drop(caplog):
    """A replica whose connection drops with nothing in flight (a frozen server missing
    heartbeats while the trainer computes) is skipped silently by the policy: one warning
    says so, once per drop; a drop that loses requests is told by their re-sends instead."""
    rs, _ = _set({0: ["answer", "answer"], 1: ["drop", "answer"]})
    caplog.set_level("WARNING", logger="mfgserve.replicas")
    assert _answered_by(rs, 0, 2) == ["p0r0", "p0r1"]
    rs.channel("p0r1").up = False
    assert _answered_by(rs, 0, 3) == ["p0r0"] * 3
    idle = [r.getMessage() for r in caplog.records]
    assert len(idle) == 1 and "p0r1 (part 0) dropped with no request in flight" in idle[0]
    rs.channel("p0r1").up = True  # it connected again: a later drop is a new one
    assert _answered_by(rs, 0, 2) == ["p0r1", "p0r0"]
    rs.channel("p0r1").up = False
    _answered_by(rs, 0, 2)
    assert len(caplog.records) == 2
    caplog.clear()
    assert rs.wait(rs.submit(1, Req(5))).endpoint == "p1r1"  # p1r0 dropped with it in flight
    assert _answered_by(rs, 1, 2) == ["p1r1"] * 2
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "re-sending REQ for part 1 from p1r0 to p1r1"]


def test_suspect_avoided_for_the_window_then_used_again():
    rs, clock = _set({0: ["timeout", "answer"]}, suspect_s=5.0)
    h = rs.submit(0, Req(7))
    assert h.channel.endpoint == "p0r0"
    reply = rs.wait(h)  # missed the deadline: suspect, and the request failed over
    assert (reply.endpoint, reply.body, h.attempts, rs.failovers) == ("p0r1", 7, 2, 1)
    assert not rs.healthy("p0r0") and rs.channel("p0r0").up  # connected, but suspect
    rs.channel("p0r0").mode = "answer"
    clock.now += 4.9
    assert _answered_by(rs, 0, 3) == ["p0r1"] * 3
    clock.now += 0.2  # the window is over
    assert set(_answered_by(rs, 0, 2)) == {"p0r0", "p0r1"}


def test_fallback_when_every_replica_is_down():
    rs, clock = _set({0: ["answer", "answer", "answer"]})
    for i, ep in enumerate(["p0r1", "p0r2", "p0r0"]):
        ch = rs.channel(ep)
        ch.up, ch.last_disconnect = False, clock.now + i
    clock.now += 5
    rs.mark_suspect("p0r1")  # failed again later: p0r2 is now the one that failed longest ago
    assert rs.choose(0) is None
    h = rs.submit(0, Req())  # sent anyway, not refused
    assert h.channel.endpoint == "p0r2"


def test_scatter_gather_fails_over_once_per_replica():
    rs, _ = _set({0: ["drop", "timeout", "answer"], 1: ["answer"]})
    out = rs.scatter_gather({0: Req(1), 1: Req(2)}, Rep)
    assert (out[0].endpoint, out[0].body, out[1].endpoint, out[1].body) == (
        "p0r2", 1, "p1r0", 2)
    assert rs.failovers == 2
    # every replica of part 0 got the request exactly once, and the ones that failed
    # no longer expect an answer (a late reply to the old request id is dropped)
    assert [len(rs.channel(f"p0r{i}").sent) for i in range(3)] == [1, 1, 1]
    assert not rs.channel("p0r0").pending and not rs.channel("p0r1").pending
    assert not rs._inflight and not rs._buffered


@pytest.mark.parametrize("replicas", [1, 3])
def test_no_replica_left_fails_with_a_clear_error(replicas):
    rs, _ = _set({0: ["answer"], 1: ["drop"] * replicas})
    with pytest.raises(PeerDisconnectedError) as err:
        rs.scatter_gather({1: Req(), 0: Req()}, Rep)  # part 1 awaited first
    text = str(err.value)
    assert "part 1 has no server left" in text and "p1r" in text and "restart" in text, text
    assert [len(rs.channel(f"p1r{i}").sent) for i in range(replicas)] == [1] * replicas
    assert rs.failovers == replicas - 1
    # part 0's request, still in flight, was cancelled: a late reply to it is dropped
    assert not rs._inflight and not rs._buffered and not rs.channel("p0r0").pending


def test_timeout_with_no_replica_stays_a_timeout():
    rs, _ = _set({0: ["timeout"]})
    with pytest.raises(PeerTimeoutError, match="part 0 has no server left"):
        rs.wait(rs.submit(0, Req()))


def test_error_reply_fails_only_its_own_request():
    rs, _ = _set({0: ["answer"]})
    first, second = rs.submit(0, Req(1)), rs.submit(0, Req(2))
    ch = rs.channel("p0r0")
    ch.mode = "error"
    with pytest.raises(RemoteError):
        rs.wait(first)
    assert first.error is not None and second.error is None
    ch.mode = "answer"
    assert rs.wait(second).body == 2
    with pytest.raises(RemoteError):  # keeps its error: raised again, no wait
        rs.wait(first)
    assert rs.failovers == 0


def test_cancelled_request_is_not_waited_on():
    rs, _ = _set({0: ["timeout"]})
    h = rs.submit(0, Req())
    rs.cancel(h)
    with pytest.raises(MfgServeError, match="cancelled"):
        rs.wait(h)
    assert not rs.channel("p0r0").pending and not rs._inflight


def test_set_id_stamped_and_resend_hook():
    class Stamping(ReplicaSet):
        def for_resend(self, msg):
            return Req(-msg.body, msg.set_id)

    clock = Clock()
    modes = {"a": "drop", "b": "answer"}
    rs = Stamping({0: ["a", "b"]}, lambda ep: FakeChannel(ep, clock, modes[ep]),
                  set_id="abc123", clock=clock)
    h = rs.submit(0, Req(5))
    assert h.msg.set_id == "abc123"
    assert rs.wait(h).body == -5 and rs.channel("b").sent[0][1].set_id == "abc123"
    assert rs.bytes_received == 10
    rs.close()
    assert all(ch.closed for ch in rs.channels.values())


def test_unknown_part_is_an_error():
    rs, _ = _set({0: ["answer"]})
    with pytest.raises(MfgServeError, match="no server for part 3"):
        rs.submit(3, Req())
