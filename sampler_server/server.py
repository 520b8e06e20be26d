"""The sampler server: handlers over one partition, composed on the service runtime.

Threads, sockets and (with ``--sampler-procs N``) processes::

    trainers / peers --> ROUTER (IO thread) --SAMPLE--> executor: N sampler threads, or
                               ^                        N sampler processes (private ipc)
                               +------------- replies, counts <-------------+

The runtime (:mod:`common.service`) owns the socket loop, decoding, the one exception-to-
ErrorReply mapping, the per-client reply backlog and the counters; :mod:`common.executors`
runs SAMPLE requests in threads or processes. This module is only the handlers and their
composition.

The IO thread answers cheap, local-only requests inline (PING, NEIGHBORS_REQ, NODE_DATA_REQ,
SEEDS_REQ, CACHE_FILL_REQ, STATS_REQ, STATUS_REQ, SHUTDOWN) so that a peer's request is never
stuck behind a full-MFG job that itself waits on that peer: two servers sampling across each
other cannot deadlock. SAMPLE requests go to the samplers through a bounded queue (sampler
processes take a job only when idle); when it is full the client gets a ``busy`` error reply (its credits
should prevent that). Every malformed message gets an ``ERROR`` reply and the server keeps
serving. A sampler thread or process that breaks stops the server (exit 1), so clients fail
over.

Sampler processes map the same partition files, so the page cache holds one copy of the
partition for all of them; ``STATS`` reports the memory of the server and its workers (rss,
pss, uss); ``STATUS`` (sampler_server/status.py) adds identity, the last minute's rates,
clients, errors by code, samplers alive and ring use, for ``mfgserve-status``.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import uuid

import numpy as np
import torch

from common.cluster import ClusterSpec
from common.config import ServerConfig
from common.errors import ConfigError, MfgServeError, ProtocolError
from common.executors import Executor, ProcessExecutor, ThreadExecutor
from common.messages import (
    FEAT_TRANSFER_DTYPES,
    Ack,
    CacheFillReply,
    CacheFillRequest,
    Message,
    NeighborsReply,
    NeighborsRequest,
    NodeDataReply,
    NodeDataRequest,
    NodeTypeInfo,
    Ping,
    Pong,
    RelationInfo,
    SampleRequest,
    SeedsReply,
    SeedsRequest,
    Shutdown,
    StatsReply,
    StatsRequest,
)
from common.service import Call, Service, Transport
from common.shm_ring import ShmWriter
from common.sockets import read_token
from partition.layout import load_hot_rank
from sampler_server.node_tensors import NodeTensorStore
from sampler_server.partition_store import PartitionStore
from sampler_server.sample_worker import SampleWorker, hot_rank_or_error, peer_keys
from sampler_server.sampler_proc import worker_argv
from sampler_server.status import StatusReporter, server_stats

log = logging.getLogger("mfgserve.server")


class PartitionHandlers:
    """What a server answers, over its partition store; registered on a :class:`Service`."""

    def __init__(self, cfg: ServerConfig, store: PartitionStore, hot_rank, service: Service,
                 shutdown_token: str):
        self.cfg, self.store, self.hot_rank, self.service = cfg, store, hot_rank, service
        self.server_id = uuid.uuid4().hex[:8]
        self.shutdown_token = shutdown_token

    def register(self) -> None:
        s = self.service
        s.precheck = self.check_set
        for cls, fn in ((SampleRequest, self.sample), (NeighborsRequest, self.neighbors),
                        (NodeDataRequest, self.node_data), (Ping, self.ping),
                        (SeedsRequest, self.seeds), (CacheFillRequest, self.cache_fill),
                        (StatsRequest, self.stats), (Shutdown, self.shutdown)):
            s.handle(cls, fn)

    def check_set(self, msg: Message) -> None:
        """A request naming another partition set would get answers from the wrong graph."""
        want, own = getattr(msg, "set_id", ""), self.store.meta.set_id
        if want and want != own:
            raise ProtocolError(
                "wrong_partition_set",
                f"part {self.cfg.part_id} at {self.service.endpoint} serves partition set "
                f"{own} ({self.cfg.parts}), but the request is for partition set {want}: "
                "servers of different partitionings are mixed; start every server of the "
                "cluster on the same partition-ogbn output")

    def sample(self, msg: SampleRequest, call: Call) -> None:
        n, top = self.store.meta.num_nodes, int(msg.seeds.max())  # check() ensured non-empty
        if top >= n:
            raise ProtocolError("id_out_of_range", f"seed id {top} is outside [0, {n}): "
                                f"dataset {self.store.meta.dataset} has {n} nodes")
        if not self.service.offload(msg, call):
            raise ProtocolError(
                "busy", f"part {self.cfg.part_id} has {self.cfg.max_queue} sample requests "
                "queued; lower the trainers' --max-inflight or raise --max-queue")

    def neighbors(self, msg: NeighborsRequest, call: Call) -> NeighborsReply:
        counts, src = self.store.sample_neighbors(msg.nodes, msg.fanout, msg.seed,
                                                  msg.etype)
        return NeighborsReply(counts=counts, src=src)

    def node_data(self, msg: NodeDataRequest, call: Call) -> NodeDataReply:
        feat, label = self.store.gather(msg.nodes, msg.with_feat, msg.with_label)
        return NodeDataReply(feat=feat, label=label)

    def ping(self, msg: Ping, call: Call) -> Pong:
        m, st = self.store.meta, self.store
        return Pong(part_id=self.cfg.part_id, num_parts=m.num_parts, num_nodes=m.num_nodes,
                    feat_dim=m.feat_dim, num_classes=m.num_classes, node_offsets=m.node_offsets,
                    feat_dtype=str(st.feat.dtype).replace("torch.", ""), dataset=m.dataset,
                    pid=os.getpid(), server_id=self.server_id, set_id=m.set_id,
                    ntypes=[NodeTypeInfo(t, t in m.feat_ntypes) for t in m.ntypes],
                    etypes=[RelationInfo(*e) for e in m.etypes],
                    predict_ntype=m.predict_ntype, task_type=m.task_type,
                    num_tasks=m.num_tasks, eval_metric=m.eval_metric)

    def seeds(self, msg: SeedsRequest, call: Call) -> SeedsReply:
        return SeedsReply(seeds=self.store.seeds(msg.split))

    def cache_fill(self, msg: CacheFillRequest, call: Call) -> CacheFillReply:
        rank = hot_rank_or_error(self.hot_rank, self.cfg.parts)
        st = self.store
        limit = int(msg.cache_ratio * (st.end - st.start))
        local = np.nonzero(np.asarray(rank[st.start:st.end]) < limit)[0]
        nodes = torch.from_numpy(local.astype(np.int64) + st.start)
        feat, _ = st.gather(nodes, True, False)
        want = FEAT_TRANSFER_DTYPES[msg.feat_dtype]
        return CacheFillReply(nodes=nodes, feat=feat if want is None else feat.to(want))

    def stats(self, msg: StatsRequest, call: Call) -> StatsReply:
        out, _ = server_stats(self.service)
        return StatsReply(values=out.to_wire())

    def shutdown(self, msg: Shutdown, call: Call) -> Ack:
        token = self.shutdown_token
        if not token or not hmac.compare_digest(msg.token.encode(), token.encode()):
            raise ProtocolError(
                "forbidden", "Shutdown refused: it needs the token of this server's "
                "--shutdown-token-file" if token else "Shutdown refused: this server was "
                "started without --shutdown-token-file; stop it with SIGTERM")
        self.service.stop()
        return Ack()


def load_cluster(cfg: ServerConfig, num_parts: int) -> ClusterSpec | None:
    """The cluster file, checked against the partition set (a multi-part set needs one)."""
    cluster = ClusterSpec.load(cfg.cluster) if cfg.cluster else None
    if cluster is None and num_parts > 1:
        raise ConfigError(
            f"partition set {cfg.parts} has {num_parts} parts, so this server must reach the "
            "other parts' servers to sample across part boundaries: pass --cluster FILE.yaml "
            "listing every part's server endpoints")
    if cluster and cluster.num_parts != num_parts:
        raise MfgServeError(
            f"cluster file {cfg.cluster} lists {cluster.num_parts} parts but the partition "
            f"set {cfg.parts} has {num_parts}; fix the cluster file")
    return cluster


def make_executor(cfg: ServerConfig, store: PartitionStore, hot_rank,
                  cluster: ClusterSpec | None, stop: threading.Event | None = None
                  ) -> Executor:
    """Sampler processes (--sampler-procs) or threads (--num-workers); ``stop``: the
    service's stop event, which ends the threads' waits on peers at once."""
    if cfg.sampler_procs > 0:
        return ProcessExecutor(lambda backend, i: worker_argv(cfg, backend, i),
                               cfg.sampler_procs, cfg.max_queue, cfg.peer_timeout_s + 2)
    keys = peer_keys(cfg, cluster)
    shm = ShmWriter()  # one per process: a trainer's ring is mapped (and faulted in) once
    return ThreadExecutor(lambda ctx: SampleWorker(cfg, store, hot_rank, ctx, cluster, keys,
                                                   stop=stop, shm=shm),
                          cfg.num_workers, cfg.max_queue, cfg.peer_timeout_s + 1)


class SamplerServer:
    """The composition: partition store, service, handlers, executor."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.store = PartitionStore(cfg.parts, cfg.part_id, seed=cfg.seed)
        hot_rank = load_hot_rank(cfg.parts)
        cluster = load_cluster(cfg, self.store.meta.num_parts)
        token = read_token(cfg.shutdown_token_file)  # every input checked before binding
        self.service = Service(Transport(
            cfg.bind, cfg.max_message_mb << 20, cfg.max_peer_backlog_mb << 20, cfg.heartbeat_s,
            cfg.heartbeat_timeout_s, cfg.curve_secret_key, cfg.curve_authorized_keys),
            where=f"part {cfg.part_id}")
        self.endpoint = self.service.endpoint
        handlers = PartitionHandlers(cfg, self.store, hot_rank, self.service, token)
        handlers.register()
        tensors = NodeTensorStore(cfg.part_id, self.store.start, self.store.end,
                                  cfg.max_node_tensor_mb << 20)
        tensors.register(self.service)
        self.service.use(make_executor(cfg, self.store, hot_rank, cluster,
                                       stop=self.service.stop_event))
        StatusReporter(self.service, cfg, self.store.meta, handlers.server_id,
                       tensors).install()

    @property
    def fatal(self) -> str | None:
        return self.service.fatal

    def serve_forever(self) -> None:
        self.service.serve_forever(self.cfg.ready_file)

    def stop(self) -> None:
        self.service.stop()
