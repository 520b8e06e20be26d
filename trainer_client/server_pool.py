"""The trainer's connections to the sampler servers (transport layer).

A :class:`common.replicas.ReplicaSet` over every part's servers (one
:class:`common.rpc.RpcChannel` per endpoint): requests go round-robin over a part's healthy
replicas and fail over to another replica when a server dies or misses the
``--request-timeout-s`` deadline, each request answered exactly once (see common/replicas.py
for the policy and ``--replica-suspect-s``). This adds the trainer's setup calls (every
server must serve the same partition set) and drops a shared-memory slot from a re-sent
SampleRequest.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import zmq

from common.cluster import ClusterSpec
from common.errors import MfgServeError
from common.messages import Message, Ping, Pong, SampleRequest, SeedsReply, SeedsRequest
from common.replicas import SUSPECT_S, Handle, ReplicaSet
from common.rpc import RpcChannel, expect
from common.sockets import CurveKeys

__all__ = ["Handle", "ServerPool"]


class ServerPool(ReplicaSet):
    def __init__(self, cluster: ClusterSpec, *, timeout_s: float, max_message_bytes: int,
                 curve: CurveKeys | None = None, heartbeat_s: float = 0.0,
                 heartbeat_timeout_s: float = 0.0, suspect_s: float = SUSPECT_S):
        self.ctx = zmq.Context()
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        super().__init__(cluster.partitions, partial(
            RpcChannel, self.ctx, timeout_s=timeout_s, setting="--request-timeout-s",
            max_message_bytes=max_message_bytes, curve=curve, heartbeat_s=heartbeat_s,
            heartbeat_timeout_s=heartbeat_timeout_s), suspect_s=suspect_s, fail_fast=True)

    # ------------------------------------------------------------------ setup calls
    def info(self) -> Pong:
        """Ping every server; all must serve the same partition set, each the part listed.
        Every request after this names that partition set."""
        pongs = {}
        for part, ep in self.cluster.all_endpoints():
            pong = expect(self.channel(ep).call(Ping(), waiting_for="a ping reply"), Pong, ep)
            if pong.part_id != part:
                raise MfgServeError(f"{ep} serves part {pong.part_id}, but the cluster file "
                                    f"lists it under part {part}; fix the cluster file")
            pongs[ep] = pong
        first_ep, first = next(iter(pongs.items()))
        for ep, pong in pongs.items():
            if pong.set_id != first.set_id:
                raise MfgServeError(
                    f"servers of different partition sets are mixed: {first_ep} (part "
                    f"{first.part_id}) serves partition set {first.set_id} but {ep} (part "
                    f"{pong.part_id}) serves partition set {pong.set_id}; start every server "
                    "of the cluster on the same partition-ogbn output")
            if (pong.num_parts, pong.num_nodes, pong.dataset) != (
                    first.num_parts, first.num_nodes, first.dataset):
                raise MfgServeError(f"{ep} serves a different partition set ({pong.dataset}, "
                                    f"{pong.num_parts} parts) than the others")
        if first.num_parts != self.cluster.num_parts:
            raise MfgServeError(f"servers hold {first.num_parts} parts but the cluster file "
                                f"lists {self.cluster.num_parts}; fix the cluster file")
        self.set_id = first.set_id
        return first

    def seeds(self, split: str) -> torch.Tensor:
        """All parts' seeds of a split, in global id order."""
        out = []
        for part in sorted(self.cluster.partitions):
            reply = self.wait(self.submit(part, SeedsRequest(split=split)))
            out.append(expect(reply, SeedsReply, f"part {part}").seeds.clone())
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    # ------------------------------------------------------------------ requests
    def for_resend(self, msg: Message) -> Message:
        if isinstance(msg, SampleRequest) and msg.slot is not None:
            # The old server may still write into the offered ring slot: the new one gets none.
            return dataclasses.replace(msg, slot=None)
        return msg

    def close(self) -> None:
        if self.ctx.closed:
            return
        super().close()
        self.ctx.term()
