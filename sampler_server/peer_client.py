"""Server-to-server requests over the wire: the :class:`Peers` implementation.

Each sampling thread owns one :class:`WirePeers` (zmq sockets are not thread-safe). A request
to several parts is sent to all of them first, then the replies are collected, each under the
``peer_timeout_s`` deadline.
"""

from __future__ import annotations

import itertools

import zmq
from torch import Tensor

from common.cluster import ClusterSpec
from common.messages import NeighborsReply, NeighborsRequest, NodeDataReply, NodeDataRequest
from common.rpc import RpcChannel, expect


class WirePeers:
    def __init__(self, ctx: zmq.Context, cluster: ClusterSpec, own_part: int, timeout_s: float,
                 max_message_bytes: int):
        self.ctx = ctx
        self.cluster = cluster
        self.own_part = own_part
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.channels: dict[int, RpcChannel] = {}
        self._rr = {p: itertools.cycle(eps) for p, eps in cluster.partitions.items()}

    def _channel(self, part: int) -> RpcChannel:
        ch = self.channels.get(part)
        if ch is None:
            if part not in self.cluster.partitions:
                raise RuntimeError(f"cluster file lists no server for part {part}")
            ch = RpcChannel(self.ctx, next(self._rr[part]), timeout_s=self.timeout_s,
                            setting="the servers' --peer-timeout-s",
                            max_message_bytes=self.max_message_bytes)
            self.channels[part] = ch
        return ch

    def _scatter_gather(self, requests: dict[int, object], reply_cls: type) -> dict[int, object]:
        sent = {p: (self._channel(p), self._channel(p).send(msg)) for p, msg in requests.items()}
        out = {}
        for p, (ch, rid) in sent.items():
            while True:
                reply, got = ch.recv(waiting_for=f"part {p}'s {reply_cls.__name__}")
                if got == rid:
                    out[p] = expect(reply, reply_cls, ch.endpoint)
                    break
        return out

    def sample_neighbors(self, requests: dict[int, Tensor], fanout: int
                         ) -> dict[int, tuple[Tensor, Tensor]]:
        replies = self._scatter_gather(
            {p: NeighborsRequest(nodes=n, fanout=fanout) for p, n in requests.items()},
            NeighborsReply)
        return {p: (r.counts, r.src) for p, r in replies.items()}

    def gather(self, requests: dict[int, Tensor], with_feat: bool, with_label: bool
               ) -> dict[int, tuple[Tensor, Tensor]]:
        replies = self._scatter_gather(
            {p: NodeDataRequest(nodes=n, with_feat=with_feat, with_label=with_label)
             for p, n in requests.items()}, NodeDataReply)
        return {p: (r.feat, r.label) for p, r in replies.items()}

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
