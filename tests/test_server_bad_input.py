"""A real ``sampler-server`` process on a real socket, fed garbage.

Every malformed request gets an ``ErrorReply`` with a meaningful code (and the request id
echoed where it can be read), is counted in the server's stats, and the server goes on serving:
after each bad input the same client still gets a Pong and a full MFG. A hypothesis fuzz sends
hundreds of mutated multipart messages and checks the server's answer code against the codec's
own verdict, that it stays alive and that its memory does not grow. Bad start-up arguments make
the server exit with code 2 and say what to change.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest
import torch
import zmq
from hypothesis import HealthCheck, assume, given, settings

from common import codec
from common.errors import ProtocolError
from common.messages import (
    MAX_ID,
    Ack,
    ErrorReply,
    MFGReply,
    NeighborsReply,
    NeighborsRequest,
    NodeDataRequest,
    Ping,
    Pong,
    SampleRequest,
    SeedsRequest,
    Shutdown,
    StatsReply,
    StatsRequest,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import REPO, ServerProcess, tail  # noqa: E402
from test_codec import chain_mfg, fuzzed_frames, wire  # noqa: E402

REPLY_TIMEOUT_S = 15.0
MAX_MESSAGE_MB = 1  # the shared server's cap, so oversize inputs are cheap to build


class RawClient:
    """A DEALER that sends arbitrary frames and decodes whatever comes back."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.next_id = 1000

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames, copy=False)

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S) -> tuple[Any, int]:
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise AssertionError(f"no reply from the server within {timeout_s}s")
        return codec.decode(self.sock.recv_multipart(copy=False))

    def call(self, msg: Any) -> Any:
        self.next_id += 1
        self.send(codec.encode(msg, self.next_id))
        reply, rid = self.recv()
        assert rid == self.next_id, f"reply to request {rid}, expected {self.next_id}"
        return reply

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # closes any socket a failed test left open, so teardown never hangs


@pytest.fixture(scope="module")
def shared_server(synth_parts1, tmp_path_factory):
    """One server for the per-input tests (a start costs seconds); its exit code is checked.
    Started with ``--max-message-mb 1``."""
    work = tmp_path_factory.mktemp("bad-input-server")
    proc = ServerProcess(synth_parts1, 0, f"ipc://{work}/s0.sock", None, work,
                         ["--max-message-mb", str(MAX_MESSAGE_MB)])
    proc.wait_ready()
    yield proc
    proc.stop_and_check()


@pytest.fixture
def client(ctx, shared_server):
    c = RawClient(ctx, shared_server.endpoint)
    yield c
    c.close()


def errors_counted(c: RawClient) -> float:
    stats = c.call(StatsRequest())
    assert isinstance(stats, StatsReply)
    return stats.values["errors"]


def assert_serving(c: RawClient, seeds: tuple[int, ...] = (0, 17, 1234)) -> MFGReply:
    """A Ping gets a Pong and a valid SampleRequest gets a consistent MFG."""
    pong = c.call(Ping())
    assert isinstance(pong, Pong), pong
    assert pong.part_id == 0 and pong.num_parts == 1
    s = torch.tensor(seeds, dtype=torch.int64)
    reply = c.call(SampleRequest(seeds=s, fanouts=[5, 5]))
    assert isinstance(reply, MFGReply), reply
    mfg = reply.mfg
    assert torch.equal(mfg.input_nodes[: len(seeds)], s)  # destination nodes come first
    assert torch.equal(mfg.output_nodes, s) and mfg.only.label.shape == (len(seeds),)
    assert mfg.only.feat.rows.shape == (mfg.input_nodes.numel(), pong.feat_dim)
    return reply


def _num_nodes(c: RawClient) -> int:
    pong = c.call(Ping())
    assert isinstance(pong, Pong)
    return pong.num_nodes


def seeds_frames(seeds: list[int], rid: int) -> list[bytes]:
    return wire(SampleRequest(seeds=torch.tensor(seeds, dtype=torch.int64), fanouts=[5, 5]), rid)


def _header(frames: list[bytes], **changes: Any) -> list[bytes]:
    head = msgpack.unpackb(frames[0], raw=False)
    head.update(changes)
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


# (frames builder taking num_nodes, expected code, request id the reply must echo)
BAD_INPUTS: dict[str, tuple[Callable[[int], list[bytes]], str, int]] = {
    "garbage-frame": (lambda n: [b"\xc1\xffgarbage"], "bad_header", 0),
    "garbage-frames": (lambda n: [b"\x00" * 3, b"\xff" * 100, b"x"], "bad_header", 0),
    "empty-frame": (lambda n: [b""], "bad_header", 0),
    "header-not-a-map": (lambda n: [msgpack.packb([1, 3, 5])], "bad_header", 0),
    "truncated-header": (lambda n: [seeds_frames([1, 2], 31)[0][:9]], "bad_header", 0),
    "wrong-version": (lambda n: _header(wire(Ping(), 41), v=99), "bad_version", 41),
    "unknown-type": (lambda n: _header(wire(Ping(), 42), t=99), "unknown_type", 42),
    "bad-request-id": (lambda n: _header(wire(Ping(), 1), id=-5), "bad_request_id", 0),
    "pong-as-request": (lambda n: wire(Pong(0, 1, n, 16, 5, [0, n], "float32", "x", 1, "y", ""), 43),
                        "unexpected_type", 43),
    "mfg-as-request": (lambda n: wire(chain_mfg(2), 44), "unexpected_type", 44),
    "ack-as-request": (lambda n: wire(Ack(), 45), "unexpected_type", 45),
    "error-as-request": (lambda n: wire(ErrorReply("x", "y"), 46), "unexpected_type", 46),
    "neighbors-reply-as-request": (
        lambda n: wire(NeighborsReply(counts=torch.tensor([1]), src=torch.tensor([2])), 47),
        "unexpected_type", 47),
    "seed-beyond-num-nodes": (lambda n: seeds_frames([0, n], 51), "id_out_of_range", 51),
    "seed-far-beyond": (lambda n: seeds_frames([10**12], 52), "id_out_of_range", 52),
    "seed-max-id": (lambda n: seeds_frames([MAX_ID], 53), "id_out_of_range", 53),
    "seed-negative": (lambda n: seeds_frames([3, -1], 54), "id_out_of_range", 54),
    "duplicate-seeds": (lambda n: seeds_frames([5, 7, 5], 55), "bad_tensor", 55),
    "bad-fanouts": (lambda n: wire(SampleRequest(seeds=torch.tensor([1]), fanouts=[0, 5]), 56),
                    "bad_fanouts", 56),
    "truncated-tensor-frame": (lambda n: [(f := seeds_frames([1, 2, 3], 57))[0], f[1][:-3]],
                               "size_mismatch", 57),
    "tensor-frame-missing": (lambda n: seeds_frames([1, 2, 3], 58)[:1], "frame_count", 58),
    "tensor-frame-duplicated": (lambda n: seeds_frames([1, 2], 59) + seeds_frames([1, 2], 59)[1:],
                                "frame_count", 59),
    "unknown-dtype": (lambda n: _header(seeds_frames([1], 60), d=[["seeds", "complex64", [1]]]),
                      "bad_dtype", 60),
    "unknown-field": (lambda n: _header(wire(Ping(), 61), s={"evil": 1}), "bad_field", 61),
    "over-size-cap-in-parts": (  # each frame under libzmq's cap, the total over the codec's
        lambda n: [seeds_frames([1], 62)[0], bytes(700 << 10), bytes(700 << 10)],
        "too_large", 62),
    "neighbors-of-unowned-node": (
        lambda n: wire(NeighborsRequest(nodes=torch.tensor([n + 5]), fanout=3), 63),
        "bad_request", 63),
    "node-data-of-unowned-node": (
        lambda n: wire(NodeDataRequest(nodes=torch.tensor([1, n])), 64), "bad_request", 64),
    "bad-split": (lambda n: wire(SeedsRequest(split="everything"), 65), "bad_split", 65),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_error_reply_and_server_keeps_serving(client, shared_server, case):
    build, code, rid = BAD_INPUTS[case]
    n = _num_nodes(client)
    before = errors_counted(client)
    client.send(build(n))
    reply, got_rid = client.recv()
    assert isinstance(reply, ErrorReply), f"{case}: expected an error reply, got {reply!r}"
    assert reply.code == code, f"{case}: [{reply.code}] {reply.message}"
    assert reply.message, "an error reply must say what was wrong"
    assert got_rid == rid
    assert errors_counted(client) == before + 1
    assert_serving(client)
    assert shared_server.proc.poll() is None, tail(shared_server.log)


@pytest.mark.timeout(120)
def test_out_of_range_seed_error_names_the_bound(client):
    n = _num_nodes(client)
    client.send(seeds_frames([1, n + 10], 77))
    reply, rid = client.recv()
    assert isinstance(reply, ErrorReply) and rid == 77
    assert reply.code == "id_out_of_range" and str(n) in reply.message, reply.message


@pytest.mark.timeout(120)
def test_oversized_message_drops_only_that_connection(ctx, shared_server):
    """A 2 MiB frame exceeds libzmq's MAXMSGSIZE: the connection is dropped, no reply is
    possible. The server itself must go on serving new (and concurrent) clients."""
    bystander = RawClient(ctx, shared_server.endpoint)
    offender = RawClient(ctx, shared_server.endpoint)
    try:
        assert_serving(bystander)
        offender.send(seeds_frames([1], 90)[:1] + [bytes(2 << 20)])
        assert not offender.sock.poll(1500, zmq.POLLIN), "no reply was expected"
        assert shared_server.proc.poll() is None, tail(shared_server.log)
        assert_serving(bystander)
        fresh = RawClient(ctx, shared_server.endpoint)
        try:
            assert_serving(fresh)
        finally:
            fresh.close()
    finally:
        bystander.close()
        offender.close()


@pytest.mark.timeout(120)
def test_many_bad_inputs_in_a_burst_then_stats(client):
    """Bad and good requests interleaved without waiting: every one is answered, in order of
    the IO thread, and the error count rises by exactly the number of bad ones."""
    n = _num_nodes(client)
    before = errors_counted(client)
    sent = {}
    for i, (build, code, rid) in enumerate(BAD_INPUTS.values()):
        if rid == 0:
            continue  # no request id to match the reply with
        client.send(build(n))
        sent[rid] = code
        client.send(codec.encode(Ping(), 5000 + i))
        sent[5000 + i] = "pong"
    seen = {}
    for _ in range(len(sent)):
        reply, rid = client.recv()
        seen[rid] = reply.code if isinstance(reply, ErrorReply) else "pong"
    assert seen == sent
    bad = sum(1 for c in sent.values() if c != "pong")
    assert bad >= 15
    assert errors_counted(client) == before + bad
    assert_serving(client)


# ---------------------------------------------------------------- live fuzz

LIVE_FUZZ_EXAMPLES = 800


@pytest.mark.timeout(240)
def test_live_fuzz_server_stays_up_and_small(server_factory, synth_parts1, ctx, record_property):
    server = server_factory(synth_parts1)
    c = RawClient(ctx, server.endpoint)
    ps = psutil.Process(server.proc.pid)
    tried = {"messages": 0, "frames": 0, "replies": 0, "errors": 0}
    codes: dict[str, int] = {}
    try:
        for i in range(30):  # warm up allocators and caches before the baseline
            assert_serving(c, seeds=(i, 100 + i, 2000 + i))
        rss_before = ps.memory_info().rss

        @settings(max_examples=LIVE_FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.filter_too_much])
        @given(frames=fuzzed_frames())
        def run(frames):
            assume(frames)  # a DEALER cannot send a message of no frames
            try:
                local, rid = codec.decode(frames)
                expected = None
            except ProtocolError as e:
                local, rid, expected = None, codec.peek_request_id(frames[0]), e.code
            assume(not isinstance(local, Shutdown))  # a valid Shutdown would stop the server
            tried["messages"] += 1
            tried["frames"] += len(frames)
            c.send(frames)
            reply, got = c.recv()
            tried["replies"] += 1
            assert got == rid, f"reply echoes request id {got}, expected {rid}"
            if expected is not None:
                assert isinstance(reply, ErrorReply) and reply.code == expected, \
                    f"server answered {reply!r}, the codec says [{expected}]"
            if isinstance(reply, ErrorReply):
                tried["errors"] += 1
                codes[reply.code] = codes.get(reply.code, 0) + 1
                assert reply.code != "internal", f"server bug on {frames!r}: {reply.message}"

        run()
        assert server.proc.poll() is None, tail(server.log)
        for i in range(30):
            assert_serving(c, seeds=(i, 100 + i, 2000 + i))
        growth = ps.memory_info().rss - rss_before
        stats = c.call(StatsRequest())
        assert isinstance(stats, StatsReply)
        assert stats.values["errors"] >= tried["errors"]
    finally:
        c.close()
    fresh = RawClient(ctx, server.endpoint)
    try:
        assert_serving(fresh)
    finally:
        fresh.close()
    record_property("live_fuzz_messages", tried["messages"])
    record_property("live_fuzz_frames", tried["frames"])
    record_property("live_fuzz_rss_growth_bytes", growth)
    print(f"\nlive fuzz: {tried['messages']} messages ({tried['frames']} frames), "
          f"{tried['errors']} error replies {dict(sorted(codes.items()))}; "
          f"server RSS grew {growth / 2**20:.1f} MiB")
    assert tried["messages"] >= LIVE_FUZZ_EXAMPLES * 0.8
    assert tried["replies"] == tried["messages"]
    assert growth < 50 * 2**20, f"server RSS grew by {growth / 2**20:.1f} MiB"


# ---------------------------------------------------------------- bad start-up arguments


@pytest.mark.timeout(120)
def test_bad_partition_arguments_exit_2_with_advice(synth_parts1, tmp_path):
    """Both runs at once (each imports torch and DGL); each exit code checked."""
    runs = {
        "unknown-part": (["--parts", str(synth_parts1), "--part-id", "7"],
                         ["part 7", "0..0", "--part-id"]),
        "no-parts-dir": (["--parts", "/nonexistent/parts"], ["/nonexistent/parts",
                                                              "partition-ogbn"]),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "sampler_server.main", *argv,
             "--bind", f"ipc://{tmp_path}/{name}.sock", "--ready-file", str(tmp_path / name)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        for name, (argv, _) in runs.items()
    }
    try:
        results = {name: (*p.communicate(timeout=100), p.returncode) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for name, (_, needles) in runs.items():
        _, err, code = results[name]
        assert code == 2, f"{name}: exit code {code}:\n{err[-3000:]}"
        assert "sampler-server: error:" in err and "Traceback" not in err, err[-3000:]
        for needle in needles:
            assert needle in err, f"{name}: {needle!r} not in:\n{err[-3000:]}"
        assert not (tmp_path / name).exists(), "a failed server must not report ready"
