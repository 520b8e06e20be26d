"""The trainer's client facing a misbehaving server (issue 10): a scripted in-process fake
(tests/fake_server.py) answers garbage, late, twice, never, or closes its socket; with a
replica listed the client fails over, without one it stops with an error naming the endpoint
and the setting to change. Each case ends within a few seconds."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from fake_server import (
    CLOSE,
    GARBAGE_KINDS,
    NEVER,
    REPLY,
    TWICE,
    FakeServer,
    Script,
    canned_pong,
    garbage,
    late,
)
from rpc_helpers import call, channel

from common.cluster import ClusterSpec
from common.errors import MfgServeError, PeerTimeoutError, ProtocolError
from common.messages import NodeDataReply, NodeDataRequest, Ping, Pong
from trainer_client.server_pool import ServerPool

pytestmark = pytest.mark.timeout(30)

SETTING = "--request-timeout-s"  # what ServerPool's errors tell the user to raise
DEADLINE_S = 0.5  # the client's request deadline in these tests
SLACK_S = 1.5  # error paths may take this much longer than the deadline (diagnosis, CI noise)


@pytest.fixture
def fakes():
    """Start FakeServers; each is stopped (thread joined, socket closed) after the test."""
    started: list[FakeServer] = []

    def start(script: Script | None = None, **kw) -> FakeServer:
        started.append(FakeServer(script, **kw))
        return started[-1]

    yield start
    for fake in started:
        fake.stop()


@contextmanager
def pool_of(*servers: FakeServer, timeout_s: float = DEADLINE_S) -> Iterator[ServerPool]:
    """A ServerPool over one part whose replicas are ``servers``."""
    pool = ServerPool(ClusterSpec({0: [s.endpoint for s in servers]}), timeout_s=timeout_s,
                      max_message_bytes=1 << 20)
    try:
        yield pool
    finally:
        pool.close()


def request(*nodes: int) -> NodeDataRequest:
    """A request the fake answers by echoing ``nodes``: each reply says whose it is."""
    return NodeDataRequest(nodes=torch.tensor(nodes, dtype=torch.int64))


def check_echo(reply, *nodes: int) -> None:
    assert isinstance(reply, NodeDataReply), reply
    assert reply.label.tolist() == list(nodes), (reply.label.tolist(), nodes)


# --------------------------------------------------------------------------- garbage


CODES = {"bad_msgpack": "bad_header", "bad_version": "bad_version",
         "size_mismatch": "size_mismatch"}


@pytest.mark.parametrize("kind", GARBAGE_KINDS)
def test_garbage_reply_is_a_protocol_error_naming_the_endpoint(kind, fakes):
    fake = fakes(Script(garbage(kind), REPLY, garbage(kind)))
    with pool_of(fake, timeout_s=10.0) as pool:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as err:
            pool.wait(pool.submit(0, request(1, 2)))
        assert time.monotonic() - t0 < SLACK_S, "a garbage reply must fail at once"
        assert err.value.code == CODES[kind] and fake.endpoint in str(err.value), str(err.value)
        check_echo(pool.wait(pool.submit(0, request(3))), 3)  # the next reply is good again
    with pytest.raises(ProtocolError) as err:  # a bare channel: the same
        call(fake.endpoint, Ping(), Pong)
    assert err.value.code == CODES[kind] and fake.endpoint in str(err.value), str(err.value)


# --------------------------------------------------------------------------- late


def test_late_reply_times_out_naming_endpoint_and_setting(fakes):
    fake = fakes(Script(late(DEADLINE_S + 0.7)))
    with channel(fake.endpoint, timeout_s=DEADLINE_S, setting=SETTING) as ch:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError) as err:
            ch.call(request(1))
        elapsed = time.monotonic() - t0
        assert DEADLINE_S - 0.05 <= elapsed < DEADLINE_S + SLACK_S, elapsed
        text = str(err.value)
        assert fake.endpoint in text and SETTING in text, text
        fake.wait_sent(1)  # the late reply is out: the next call still gets its own
        check_echo(ch.call(request(2)), 2)


def test_late_reply_without_replica_stops_the_pool_at_its_deadline(fakes):
    fake = fakes(Script(late(DEADLINE_S + 2.0)))
    with pool_of(fake) as pool:
        t0 = time.monotonic()
        with pytest.raises(MfgServeError) as err:
            pool.wait(pool.submit(0, request(1)))
        assert time.monotonic() - t0 < DEADLINE_S + SLACK_S
        text = str(err.value)
        assert fake.endpoint in text and SETTING in text, text


def test_late_reply_after_failover_is_dropped(fakes):
    """The first request (whichever replica gets it) is answered after the deadline: it is
    re-sent to the other replica, answered once, and the late reply is dropped."""
    script = Script(late(DEADLINE_S + 0.5))
    a, b = fakes(script), fakes(script)
    with pool_of(a, b) as pool:
        t0 = time.monotonic()
        check_echo(pool.wait(pool.submit(0, request(5, 6))), 5, 6)
        assert time.monotonic() - t0 < DEADLINE_S + SLACK_S
        assert pool.failovers == 1
        deadline = time.monotonic() + 5
        while a.replies_sent + b.replies_sent < 2:  # the late reply has gone out
            assert time.monotonic() < deadline, "the late reply never went out"
            time.sleep(0.01)
        assert pool.info().set_id == canned_pong().set_id  # both channels read again
        handles = [(i, pool.submit(0, request(i))) for i in range(10, 14)]
        for i, handle in handles:
            check_echo(pool.wait(handle), i)
        assert pool.failovers == 1
    assert len(a.requests) + len(b.requests) == 2 + 2 + 4  # first try, retry, pings, batch


# --------------------------------------------------------------------------- twice


def test_duplicate_reply_is_dropped(fakes):
    fake = fakes(Script(TWICE, TWICE, TWICE))
    with pool_of(fake, timeout_s=5.0) as pool:
        handles = [(i, pool.submit(0, request(i, i + 1))) for i in (1, 3, 5)]
        for i, handle in handles:
            check_echo(pool.wait(handle), i, i + 1)
        fake.wait_sent(6)  # every duplicate is out, then plain replies follow
        for i in (7, 9):
            check_echo(pool.wait(pool.submit(0, request(i))), i)
        assert pool.failovers == 0
    assert fake.replies_sent == 8


def test_duplicate_reply_is_dropped_by_the_channel(fakes):
    fake = fakes(Script(TWICE))
    with channel(fake.endpoint, timeout_s=5.0) as ch:
        first = ch.send(request(1))
        reply, rid = ch.recv()
        assert rid == first
        check_echo(reply, 1)
        fake.wait_sent(2)  # the duplicate is on its way: the next recv must skip it
        second = ch.send(request(2))
        reply, rid = ch.recv()
        assert rid == second, "the duplicate of an answered request was delivered"
        check_echo(reply, 2)


# --------------------------------------------------------------------------- never


def test_silent_server_fails_over_to_replica(fakes):
    script = Script(NEVER)
    a, b = fakes(script), fakes(script)
    with pool_of(a, b) as pool:
        t0 = time.monotonic()
        check_echo(pool.wait(pool.submit(0, request(8))), 8)
        elapsed = time.monotonic() - t0
        assert DEADLINE_S - 0.05 <= elapsed < DEADLINE_S + SLACK_S, elapsed
        assert pool.failovers == 1
    assert len(a.requests) == len(b.requests) == 1


def test_silent_server_without_replica_fails_at_deadline(fakes):
    fake = fakes(Script(then=NEVER))
    with pool_of(fake) as pool:
        t0 = time.monotonic()
        with pytest.raises(MfgServeError) as err:
            pool.wait(pool.submit(0, request(1)))
        assert time.monotonic() - t0 < DEADLINE_S + SLACK_S
        text = str(err.value)
        assert fake.endpoint in text and SETTING in text and "part 0" in text, text


# --------------------------------------------------------------------------- close


def test_closed_connection_fails_over_before_the_deadline(fakes):
    script = Script(CLOSE)
    a, b = fakes(script), fakes(script)
    with pool_of(a, b, timeout_s=20.0) as pool:
        t0 = time.monotonic()
        check_echo(pool.wait(pool.submit(0, request(4))), 4)
        assert time.monotonic() - t0 < 3.0, "a dropped connection must not cost the deadline"
        assert pool.failovers == 1
    assert not (a.alive and b.alive), "the closing fake should have stopped serving"


# --------------------------------------------------------------------------- partition sets


def test_replicas_of_different_partition_sets_refused(fakes):
    ids = ("aaaa0000aaaa0000", "bbbb1111bbbb1111")
    a = fakes(pong=canned_pong(set_id=ids[0]))
    b = fakes(pong=canned_pong(set_id=ids[1]))
    with pool_of(a, b, timeout_s=5.0) as pool:
        with pytest.raises(MfgServeError) as err:
            pool.info()
    assert all(i in str(err.value) for i in ids), str(err.value)


# --------------------------------------------------------------------------- the fake itself


def test_fake_server_stops_cleanly():
    """Start/stop leaves no thread and no file descriptor behind, also mid late reply."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    FakeServer().stop()  # warm-up: libzmq's first context allocates process-wide state
    before = fds()
    for _ in range(10):
        with FakeServer(Script(late(10.0))) as fake:
            with pytest.raises(PeerTimeoutError):
                call(fake.endpoint, Ping(), Pong, timeout_s=0.05)
        assert not fake.alive
    assert fds() <= before, (before, fds())
