"""A client that never reads its replies cannot grow a server's memory without bound (issue
9, defect 7): replies queued for it stop at --max-peer-backlog-mb (the rest are dropped and
counted), the server keeps serving others, and the queue is freed when the client goes."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
import zmq
from rpc_helpers import call

from common import codec
from common.messages import MFGReply, SampleRequest, StatsReply, StatsRequest

pytestmark = pytest.mark.timeout(240)

LIMIT_MB = 24
REQUESTS = 60


@pytest.fixture(scope="module")
def wide_parts(tmp_path_factory):
    """One part, 12k nodes with 256-dim features: a 2-layer batch reply is several MB."""
    from partition.partitioner import partition_graph
    from partition.synthetic import generate

    graph = generate(12000, avg_degree=20, feat_dim=256, num_classes=4, seed=2, progress=False)
    out = tmp_path_factory.mktemp("wide")
    partition_graph(graph, 1, str(out), method="random", seed=0, progress=False)
    return out


def _stats(ctx, endpoint) -> dict[str, float]:
    return call(endpoint, StatsRequest(), StatsReply, ctx=ctx, timeout_s=20).values


def _request(i: int) -> SampleRequest:
    g = torch.Generator().manual_seed(i)
    return SampleRequest(seeds=torch.randperm(12000, generator=g)[:600], fanouts=[15, 15])


def test_non_reading_client_is_bounded_and_freed(server_factory, wide_parts):
    server = server_factory(wide_parts, 0, extra=["--max-peer-backlog-mb", str(LIMIT_MB),
                                                  "--max-queue", str(REQUESTS)])
    proc = psutil.Process(server.proc.pid)
    ctx = zmq.Context()
    try:
        first = call(server.endpoint, _request(0), MFGReply, ctx=ctx, timeout_s=30)
        reply_bytes = len(b"".join(bytes(memoryview(f)) for f in codec.encode(first, 1)))
        rss0 = proc.memory_info().rss
        greedy = ctx.socket(zmq.DEALER)
        greedy.setsockopt(zmq.RCVHWM, 1)  # libzmq stops reading for it: replies stay queued
        greedy.setsockopt(zmq.LINGER, 0)
        greedy.connect(server.endpoint)
        for i in range(REQUESTS):
            greedy.send_multipart(codec.encode(_request(i), i + 1), copy=False)
        deadline = time.monotonic() + 120
        while True:  # every request answered or dropped
            st = _stats(ctx, server.endpoint)
            if st["sample_requests"] >= REQUESTS + 1 and st["queue_len"] == 0:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        peak = proc.memory_info().rss
        bound = (LIMIT_MB << 20) + 2 * reply_bytes + (96 << 20)  # + allocator/kernel slack
        assert st["replies_dropped"] > 0, st
        assert st["backlog_bytes"] <= (LIMIT_MB << 20) + reply_bytes, st
        assert peak - rss0 < bound, (peak - rss0, bound, reply_bytes)
        # others are still served while it hogs its queue
        call(server.endpoint, _request(7), MFGReply, ctx=ctx, timeout_s=30)
        greedy.close(0)
        deadline = time.monotonic() + 30
        while _stats(ctx, server.endpoint)["backlog_bytes"] > 0:
            assert time.monotonic() < deadline, "replies of a gone client were not freed"
            time.sleep(0.2)
        # freed: nothing is held for it (checked above); the allocator may keep some pages,
        # but the server stays within the stated bound
        assert proc.memory_info().rss - rss0 < bound
    finally:
        ctx.term()
