"""RpcChannel.recv keeps its promises while the connection's monitor chatters: a request sent
to an endpoint where nothing listens any more (a server that died before the request went out)
is queued by libzmq, which retries the connection every 100 ms, and each retry is a monitor
event. The wait must still call ``meanwhile`` every MEANWHILE_S (a server's sampler checks its
stop flag there: SIGTERM must stop it at once, not after --peer-timeout-s) and must still end
at its deadline. A real socket to a real closed port, no mocks."""

from __future__ import annotations

import time

import pytest
import zmq
from procs import free_ports
from rpc_helpers import channel

from common.errors import PeerTimeoutError
from common.messages import Ping
from common.rpc import MEANWHILE_S

pytestmark = pytest.mark.timeout(60)


class _Stop(Exception):
    pass


def _refused_endpoint() -> str:
    (port,) = free_ports(1)  # nothing listens there
    return f"tcp://127.0.0.1:{port}"


def test_meanwhile_runs_while_reconnect_attempts_chatter():
    calls: list[float] = []

    def meanwhile() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise _Stop

    with channel(_refused_endpoint(), timeout_s=30.0) as ch:
        ch.send(Ping())
        time.sleep(0.3)  # some reconnect attempts are already queued as monitor events
        t0 = time.monotonic()
        with pytest.raises(_Stop):
            ch.recv(meanwhile=meanwhile)
        elapsed = time.monotonic() - t0
    # three periods, with room for a loaded machine; before the fix it waited the 30 s out
    assert elapsed < 3 * MEANWHILE_S + 5.0, elapsed
    assert all(b - a >= MEANWHILE_S * 0.9 for a, b in zip(calls, calls[1:])), calls


@pytest.mark.parametrize("with_meanwhile", [False, True])
def test_deadline_ends_the_wait_while_reconnect_attempts_chatter(with_meanwhile):
    with channel(_refused_endpoint(), timeout_s=1.0) as ch:
        ch.send(Ping())
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="within 1.0s"):
            ch.recv(meanwhile=(lambda: None) if with_meanwhile else None)
        elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 6.0, elapsed


def test_a_reply_still_arrives_with_meanwhile():
    """Replies still arrive: a live peer (a bare ROUTER) answers after two periods by sending
    the request's own frames back, which the channel takes as the reply to it."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with channel(f"tcp://127.0.0.1:{port}", ctx=ctx, timeout_s=20.0) as ch:
            rid = ch.send(Ping())
            assert router.poll(10_000), "the request did not arrive within 10 s"
            frames = router.recv_multipart()
            calls: list[int] = []

            def meanwhile() -> None:
                calls.append(1)
                if len(calls) == 2:  # answer after two periods, with the request's own frames
                    router.send_multipart(frames)

            msg, got = ch.recv(meanwhile=meanwhile)  # the echo is taken as the reply
            assert got == rid and isinstance(msg, Ping)
            assert len(calls) >= 2
    finally:
        router.close(linger=0)
        ctx.term()
