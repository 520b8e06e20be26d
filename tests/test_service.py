"""The service runtime (common/service.py, common/executors.py) and typed stats
(common/stats.py), in process with real sockets: a bug in a handler or a sampler worker is an
``internal`` error reply (logged with its traceback), a documented request error keeps its
code, and the service goes on serving; counters change only through their one locked path."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading

import pytest
import torch
import zmq

from common.errors import BadRequestError, ProtocolError, RemoteError
from common.executors import InlineExecutor, ProcessExecutor, ThreadExecutor
from common.messages import (
    Ack,
    NeighborsRequest,
    Ping,
    SampleRequest,
    SeedsRequest,
    Shutdown,
    StatsReply,
    StatsRequest,
)
from common.rpc import RpcChannel
from common.service import Service, Transport
from common.stats import RequestTimings, SampleCounts, ServerCounters, ServerStats, Tally
from tests.buggy_worker import BuggyWorker

pytestmark = pytest.mark.timeout(60)


def _handlers(service: Service) -> None:
    def bug(msg, call):
        return {}["no such key"]  # KeyError: a bug in domain code

    def unowned(msg, call):
        raise BadRequestError("part 0 does not hold nodes [7]")

    def refused(msg, call):
        raise ProtocolError("forbidden", "no token")

    def stats(msg, call):
        out = ServerStats()
        out.add(service.stats.snapshot())
        return StatsReply(values=out.to_wire())

    def sample(msg, call):
        assert service.offload(msg, call)

    def stop(msg, call):
        service.stop()
        return Ack()

    for cls, fn in ((Ping, bug), (NeighborsRequest, unowned), (SeedsRequest, refused),
                    (StatsRequest, stats), (SampleRequest, sample), (Shutdown, stop)):
        service.handle(cls, fn)


def _executor(kind: str):
    if kind == "inline":
        return InlineExecutor(lambda ctx: BuggyWorker())
    if kind == "threads":
        return ThreadExecutor(lambda ctx: BuggyWorker(), 2, 8, join_s=5)
    return ProcessExecutor(lambda backend, i: [sys.executable, "-m", "tests.buggy_worker",
                                               backend, str(i)], 2, 8, stop_s=5)


@pytest.fixture(params=["inline", "threads", "processes"])
def service(request, tmp_path):
    svc = Service(Transport(f"ipc://{tmp_path}/svc.sock", 1 << 20, 1 << 20), where="test")
    _handlers(svc)
    svc.use(_executor(request.param))
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    yield svc
    svc.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    for proc in getattr(svc.executor, "procs", []):  # told to stop: each exits with 0
        assert proc.returncode == 0


def _code(ch: RpcChannel, msg) -> str:
    with pytest.raises(RemoteError) as err:
        ch.call(msg)
    return err.value.code


def test_a_bug_is_internal_and_the_service_keeps_serving(service, caplog):
    ctx = zmq.Context()
    ch = RpcChannel(ctx, service.endpoint, timeout_s=10, setting="the test's timeout")
    try:
        with caplog.at_level(logging.ERROR, logger="mfgserve.server"):
            assert _code(ch, Ping()) == "internal"
        assert "KeyError" in caplog.text and "Traceback" in caplog.text  # logged as a bug
        assert _code(ch, NeighborsRequest(nodes=torch.tensor([7]), fanout=2)) == "bad_request"
        assert _code(ch, SeedsRequest(split="train")) == "forbidden"
        assert _code(ch, StatsReply(values={})) == "unexpected_type"  # no handler
        # the executor's path: one mapping there too
        assert _code(ch, SampleRequest(seeds=torch.tensor([3]), fanouts=[2])) == "internal"
        assert isinstance(ch.call(SampleRequest(seeds=torch.tensor([4]), fanouts=[2])), Ack)
        values = ch.call(StatsRequest()).values
        assert values["errors"] == 5 and values["sample_requests"] == 1
        assert values["requests"] == 7 and values["bytes_out"] > 0
        assert isinstance(ch.call(Shutdown()), Ack)
    finally:
        ch.close()
        ctx.term()


def test_tally_adds_under_one_lock():
    tally: Tally[ServerCounters] = Tally(ServerCounters())

    def work():
        for _ in range(5000):
            tally.add(SampleCounts(sample_requests=1, sample_s=0.5))
            tally.add(bytes_out=3)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = tally.snapshot()
    assert (snap.sample_requests, snap.sample_s, snap.bytes_out) == (20000, 10000.0, 60000)
    with pytest.raises(AttributeError):
        tally.add(no_such_counter=1)


@pytest.mark.parametrize("cls", [ServerStats, RequestTimings, SampleCounts])
def test_stats_wire_form_is_by_name(cls):
    value = cls(**{f.name: i + 1 for i, f in enumerate(dataclasses.fields(cls))})
    wire = value.to_wire()
    assert list(wire) == [f.name for f in dataclasses.fields(cls)]
    assert cls.from_wire({**wire, "from_a_newer_peer": 1.0}) == value
    assert cls.from_wire({}) == cls()
