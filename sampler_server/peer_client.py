"""Server-to-server requests over the wire: the :class:`Peers` implementation.

Each sampling thread owns one :class:`WirePeers` (zmq sockets are not thread-safe). A request
to several parts is sent to all of them first, then the replies are collected, each under the
``peer_timeout_s`` deadline. If a peer's connection drops or it misses the deadline, the
request is re-sent to the part's next replica (the cluster file's order), once per replica.
"""

from __future__ import annotations

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
                 heartbeat: tuple[float, float] = (0.0, 0.0), set_id: str = ""):
        self.curve = curve
        self.set_id = set_id  # every request names this server's partition set
        self.heartbeat = heartbeat
        self.ctx = ctx
        self.cluster = cluster
        self.own_part = own_part
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.channels: dict[str, RpcChannel] = {}  # per endpoint, created on first use
        self.current: dict[int, str] = {}  # part -> the replica in use

    @property
    def bytes_received(self) -> int:
        """Reply bytes received from peers so far."""
        return sum(ch.bytes_received for ch in self.channels.values())

    def _get(self, endpoint: str) -> RpcChannel:
        ch = self.channels.get(endpoint)
        if ch is None:
            ch = RpcChannel(self.ctx, endpoint, timeout_s=self.timeout_s,
                            setting="the servers' --peer-timeout-s",
                            max_message_bytes=self.max_message_bytes, curve=self.curve,
                            heartbeat_s=self.heartbeat[0], heartbeat_timeout_s=self.heartbeat[1])
            self.channels[endpoint] = ch
        return ch

    def _choose(self, part: int, avoid: str | None = None) -> str:
        """A replica of ``part`` that is up and not ``avoid``, in cluster-file order starting
        after ``avoid``; if none is, the one that failed longest ago."""
        eps = self.cluster.partitions.get(part)
        if not eps:
            raise RuntimeError(f"cluster file lists no server for part {part}")
        start = (eps.index(avoid) + 1) if avoid in eps else 0
        for ep in eps[start:] + eps[:start]:
            ch = self.channels.get(ep)
            if ep != avoid and (ch is None or ch.healthy):
                return ep
        return min(eps, key=lambda e: max(self.channels[e].last_disconnect,
                                          self.channels[e].suspect_until)
                   if e in self.channels else 0.0)

    def _channel(self, part: int) -> RpcChannel:
        ep = self.current.get(part)
        if ep is None or not self._get(ep).healthy:
            ep = self.current[part] = self._choose(part)
        return self._get(ep)

    def _switch(self, part: int, error: Exception) -> RpcChannel:
        """Give up on ``part``'s current server for now and move to another replica."""
        old = self._get(self.current[part])
        if isinstance(error, PeerTimeoutError):
            old.mark_suspect(30.0)
        old.forget(set(old.pending) | set(old.lost))
        self.current[part] = self._choose(part, avoid=old.endpoint)
        return self._get(self.current[part])

    def _scatter_gather(self, requests: dict[int, object], reply_cls: type) -> dict[int, object]:
        sent = {p: (self._channel(p), self._channel(p).send(msg)) for p, msg in requests.items()}
        out = {}
        for p, (ch, rid) in sent.items():
            tries = len(self.cluster.partitions[p])
            while True:
                try:
                    reply, got = ch.recv(waiting_for=f"part {p}'s {reply_cls.__name__}")
                except (PeerDisconnectedError, PeerTimeoutError) as e:
                    tries -= 1
                    ch = self._switch(p, e)
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
            {p: NeighborsRequest(nodes=n, fanout=fanout, set_id=self.set_id)
             for p, n in requests.items()},
            NeighborsReply)
        return {p: (r.counts, r.src) for p, r in replies.items()}

    def gather(self, requests: dict[int, Tensor], with_feat: bool, with_label: bool
               ) -> dict[int, tuple[Tensor, Tensor]]:
        replies = self._scatter_gather(
            {p: NodeDataRequest(nodes=n, with_feat=with_feat, with_label=with_label,
                                set_id=self.set_id)
             for p, n in requests.items()}, NodeDataReply)
        return {p: (r.feat, r.label) for p, r in replies.items()}

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
