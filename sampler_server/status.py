"""STATUS: what a running sampler server is doing, for operators (``mfgserve-status``).

Answered inline on the IO thread, never queued behind SAMPLE jobs: a server whose samplers
are all busy (or stuck) still answers. Everything comes from what the server keeps anyway:

* load over the last minute: the service's :class:`~common.stats.WindowedTally` (requests,
  seeds, errors, bytes); the sampler threads' and processes' counts reach it as their
  results arrive (common/executors.py), so rates include them;
* clients: ROUTER identities (one per connection) that sent a request within that minute, as
  trainers (sample, seeds, cache fill, node tensors, ping) or peers (other servers' neighbour
  and feature requests). A connection silent for a minute is not counted: libzmq's heartbeats
  never reach the application;
* the SAMPLE queue now, its peak since start (read each time a request is queued) and limit;
* error replies by code since start (counted as they leave, common/service.py);
* memory of the server and its sampler processes (rss, pss; where psutil cannot read pss,
  rss stands in and ``pss_available`` is False), the samplers and how many are alive, ring
  use (``ring_replies`` / ``ring_rows``: replies whose features went into a trainer's
  shared-memory ring; the other sample replies carried them on the wire), node tensor bytes.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from common.config import ServerConfig
from common.messages import PROTOCOL_VERSION, MsgType, StatusReply, StatusRequest
from common.service import Call, Handler, Service
from common.stats import ServerStats, process_memory

PEER_TYPES = frozenset({MsgType.NEIGHBORS_REQ, MsgType.NODE_DATA_REQ})
PRUNE_EVERY = 1024  # requests between sweeps of connections silent for longer than the window


def server_stats(service: Service) -> tuple[ServerStats, bool]:
    """The STATS reply's numbers (totals and gauges now) and whether pss was readable."""
    out = ServerStats()
    out.add(service.stats.snapshot())
    out.queue_len = service.executor.queue_len() if service.executor else 0
    out.replies_dropped = service.backlog.dropped
    out.backlog_bytes = service.backlog.queued_bytes()
    return out, process_memory(out)


class ClientsSeen:
    """Connections that sent a request within the last ``window_s`` seconds, by kind. Used on
    the IO thread only (no lock)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.last: dict[bytes, tuple[str, float]] = {}
        self._notes = 0

    def note(self, client: Any, kind: str) -> None:
        key = client.bytes if hasattr(client, "bytes") else bytes(client)
        self.last[key] = (kind, self.clock())
        self._notes += 1
        if self._notes % PRUNE_EVERY == 0:
            self.prune()

    def prune(self) -> None:
        since = self.clock() - self.window_s
        self.last = {k: v for k, v in self.last.items() if v[1] >= since}

    def counts(self) -> Counter[str]:
        self.prune()
        return Counter(kind for kind, _ in self.last.values())


class StatusReporter:
    """Answers STATUS for one server; :meth:`install` once every other handler is
    registered (it watches them all for the client counts and the queue peak)."""

    def __init__(self, service: Service, cfg: ServerConfig, meta: Any, server_id: str,
                 node_tensors: Any):
        self.service, self.cfg, self.meta = service, cfg, meta
        self.server_id = server_id
        self.node_tensors = node_tensors  # sampler_server.node_tensors.NodeTensorStore
        self.clients = ClientsSeen(float(service.stats.seconds), service.stats.clock)
        self.queue_peak = 0
        self.host = socket.gethostname()

    def install(self) -> None:
        s = self.service
        s.handlers = {t: self._watched(t, fn) for t, fn in s.handlers.items()}
        s.handle(StatusRequest, self.status)

    def _watched(self, msg_type: MsgType, fn: Handler) -> Handler:
        kind = "peer" if msg_type in PEER_TYPES else "trainer"
        sample = msg_type == MsgType.SAMPLE

        def handler(msg: Any, call: Call) -> Any:
            self.clients.note(call.client, kind)
            reply = fn(msg, call)
            if sample and self.service.executor is not None:
                self.queue_peak = max(self.queue_peak, self.service.executor.queue_len())
            return reply
        return handler

    def status(self, msg: StatusRequest, call: Call) -> StatusReply:
        s, m = self.service, self.meta
        stats, pss_known = server_stats(s)
        window, window_s = s.stats.window()
        clients = self.clients.counts()
        kind, count, alive = s.executor.samplers() if s.executor else ("inline", 0, 0)
        return StatusReply(
            part_id=self.cfg.part_id, num_parts=m.num_parts, dataset=m.dataset,
            set_id=m.set_id, server_id=self.server_id, pid=os.getpid(), host=self.host,
            protocol_version=PROTOCOL_VERSION, uptime_s=s.stats.clock() - s.stats.started,
            stats=stats.to_wire(), window_s=window_s, window=window.to_wire(),
            pss_available=pss_known, trainers=clients["trainer"], peers=clients["peer"],
            queue_peak=self.queue_peak, queue_limit=self.cfg.max_queue,
            error_codes={k: float(v) for k, v in s.error_codes.items()}, sampler_kind=kind,
            samplers=count, samplers_alive=alive,
            node_tensor_bytes=int(self.node_tensors.nbytes))
