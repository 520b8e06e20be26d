"""The trainer's connections to the sampler servers (transport layer).

One :class:`common.rpc.RpcChannel` per server endpoint; requests for a part go round-robin
over its replicas. Replies can arrive in any order; :meth:`ServerPool.wait` returns the one
asked for and buffers the others.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
import zmq

from common.cluster import ClusterSpec
from common.errors import MfgServeError
from common.messages import Message, Ping, Pong, SeedsReply, SeedsRequest, StatsReply, StatsRequest
from common.rpc import RpcChannel, expect


@dataclass
class Handle:
    channel: RpcChannel
    rid: int
    sent_at: float


class ServerPool:
    def __init__(self, cluster: ClusterSpec, *, timeout_s: float, max_message_bytes: int):
        self.ctx = zmq.Context()
        self.cluster = cluster
        setting = "--request-timeout-s"
        self.channels = {ep: RpcChannel(self.ctx, ep, timeout_s=timeout_s, setting=setting,
                                        max_message_bytes=max_message_bytes)
                         for _, ep in cluster.all_endpoints()}
        self._rr = {p: itertools.cycle(eps) for p, eps in cluster.partitions.items()}
        self._buffered: dict[tuple[str, int], Message] = {}
        self.bytes_received = 0

    def info(self) -> Pong:
        """Ping every server; all must serve the same partition set, each the part listed."""
        pongs = {}
        for part, ep in self.cluster.all_endpoints():
            pong = expect(self.channels[ep].call(Ping(), waiting_for="a ping reply"), Pong, ep)
            if pong.part_id != part:
                raise MfgServeError(f"{ep} serves part {pong.part_id}, but the cluster file "
                                    f"lists it under part {part}; fix the cluster file")
            pongs[ep] = pong
        first = next(iter(pongs.values()))
        for ep, pong in pongs.items():
            if (pong.num_parts, pong.num_nodes, pong.dataset) != (
                    first.num_parts, first.num_nodes, first.dataset):
                raise MfgServeError(f"{ep} serves a different partition set ({pong.dataset}, "
                                    f"{pong.num_parts} parts) than the others")
        if first.num_parts != self.cluster.num_parts:
            raise MfgServeError(f"servers hold {first.num_parts} parts but the cluster file "
                                f"lists {self.cluster.num_parts}; fix the cluster file")
        return first

    def seeds(self, split: str) -> torch.Tensor:
        """All parts' seeds of a split, in global id order."""
        out = []
        for part in sorted(self.cluster.partitions):
            ep = next(self._rr[part])
            reply = expect(self.channels[ep].call(SeedsRequest(split=split)), SeedsReply, ep)
            out.append(reply.seeds.clone())
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def stats(self) -> dict[str, dict[str, float]]:
        return {ep: expect(ch.call(StatsRequest()), StatsReply, ep).values
                for ep, ch in self.channels.items()}

    def submit(self, part: int, msg: Message) -> Handle:
        ch = self.channels[next(self._rr[part])]
        return Handle(ch, ch.send(msg), time.perf_counter())

    def wait(self, handle: Handle) -> Message:
        key = (handle.channel.endpoint, handle.rid)
        while key not in self._buffered:
            reply, rid = handle.channel.recv(waiting_for="a sampled mini-batch")
            self._buffered[(handle.channel.endpoint, rid)] = reply
        return self._buffered.pop(key)

    def close(self) -> None:
        if self.ctx.closed:
            return
        for ch in self.channels.values():
            self.bytes_received += ch.bytes_received
            ch.close()
        self.ctx.term()
