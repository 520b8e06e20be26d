"""Server-to-server requests over the wire: the :class:`Peers` implementation.

Each sampling thread owns one :class:`WirePeers` (zmq sockets are not thread-safe): a
:class:`common.replicas.ReplicaSet` over the other parts' servers, so a request to several
parts is sent to all of them first, then the replies are collected, each under the
``--peer-timeout-s`` deadline; a peer that dies or misses the deadline is replaced by another
replica of its part, once per replica (the policy and ``--replica-suspect-s``:
common/replicas.py). Every request names this server's partition set.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import TYPE_CHECKING

from torch import Tensor

from common.cluster import ClusterSpec
from common.config import ServerConfig
from common.messages import NeighborsReply, NeighborsRequest, NodeDataReply, NodeDataRequest
from common.replicas import ReplicaSet
from common.rpc import RpcChannel
from common.sockets import CurveKeys

if TYPE_CHECKING:  # the runtime owns the context; this module only passes it on
    import zmq


class WirePeers:
    def __init__(self, ctx: zmq.Context, cluster: ClusterSpec, cfg: ServerConfig,
                 curve: CurveKeys | None = None, set_id: str = "",
                 stop: threading.Event | None = None):
        self.replicas = ReplicaSet(cluster.partitions, partial(
            RpcChannel, ctx, timeout_s=cfg.peer_timeout_s,
            setting="the servers' --peer-timeout-s", max_message_bytes=cfg.max_message_mb << 20,
            curve=curve, heartbeat_s=cfg.heartbeat_s,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s),
            suspect_s=cfg.replica_suspect_s, set_id=set_id, stop=stop)

    @property
    def bytes_received(self) -> int:
        """Reply bytes received from peers so far."""
        return self.replicas.bytes_received

    def sample_neighbors(self, requests: dict[int, Tensor], fanout: int,
                         seeds: dict[int, int] | None = None, etype: int = -1
                         ) -> dict[int, tuple[Tensor, Tensor]]:
        """Each part's sample of its nodes (through relation ``etype`` only when >= 0);
        ``seeds[p]`` (>= 0) makes part p's reproducible (a resend to another replica carries
        the same seed)."""
        seeds = seeds or {}
        replies = self.replicas.scatter_gather(
            {p: NeighborsRequest(nodes=n, fanout=fanout, seed=seeds.get(p, -1), etype=etype)
             for p, n in requests.items()}, NeighborsReply)
        return {p: (r.counts, r.src) for p, r in replies.items()}

    def gather(self, requests: dict[int, Tensor], with_feat: bool, with_label: bool
               ) -> dict[int, tuple[Tensor, Tensor]]:
        replies = self.replicas.scatter_gather(
            {p: NodeDataRequest(nodes=n, with_feat=with_feat, with_label=with_label)
             for p, n in requests.items()}, NodeDataReply)
        return {p: (r.feat, r.label) for p, r in replies.items()}

    def close(self) -> None:
        self.replicas.close()
