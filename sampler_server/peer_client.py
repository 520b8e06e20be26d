"""Server-to-server requests over the wire: the :class:`Peers` implementation.

Each sampling thread owns one :class:`WirePeers` (zmq sockets are not thread-safe). A request
to several parts is sent to all of them first, then the replies are collected, each under the
``peer_timeout_s`` deadline. If a peer's connection drops or it misses the deadline, the
request is re-sent to the part's next replica (the cluster file's order), once per replica.
"""

from __future__ import annotations

import itertools

import zmq
from torch import Tensor

from common.cluster import ClusterSpec
from common.errors import PeerDisconnectedError, PeerTimeoutError
from common.messages import NeighborsReply, NeighborsRequest, NodeDataReply, NodeDataRequest
from common.rpc import RpcChannel, expect
from common.sockets import CurveKeys


class WirePeers:
    def __init__(self, ctx: zmq.Context, cluster: ClusterSpec, own_part: int, timeout_s: float,
                 max_message_bytes: int, curve: CurveKeys | None = None,
                 heartbeat: tuple[float, float] = (0.0, 0.0)):
        self.curve = curve
        self.heartbeat = heartbeat
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
                            max_message_bytes=self.max_message_bytes, curve=self.curve,
                            heartbeat_s=self.heartbeat[0], heartbeat_timeout_s=self.heartbeat[1])
            self.channels[part] = ch
        return ch

    @property
    def bytes_received(self) -> int:
        """Reply bytes received from peers so far (channels closed on failover excluded)."""
        return sum(ch.bytes_received for ch in self.channels.values())

    def _switch(self, part: int) -> RpcChannel:
        """Drop the channel to ``part``'s current server and connect to its next replica."""
        old = self.channels.pop(part, None)
        if old is not None:
            old.close()
        return self._channel(part)

    def _scatter_gather(self, requests: dict[int, object], reply_cls: type) -> dict[int, object]:
        sent = {p: (self._channel(p), self._channel(p).send(msg)) for p, msg in requests.items()}
        out = {}
        for p, (ch, rid) in sent.items():
            tries = len(self.cluster.partitions[p])
            while True:
                try:
                    reply, got = ch.recv(waiting_for=f"part {p}'s {reply_cls.__name__}")
                except (PeerDisconnectedError, PeerTimeoutError):
                    tries -= 1
                    ch = self._switch(p)  # the next request starts on a fresh connection
                    if tries <= 0:
                        raise
                    rid = ch.send(requests[p])
                    continue
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
