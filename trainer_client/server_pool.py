"""The trainer's connections to the sampler servers (transport layer).

One :class:`common.rpc.RpcChannel` per server endpoint; requests for a part go round-robin
over its replicas that are up. Replies can arrive in any order; :meth:`ServerPool.wait`
returns the one asked for and buffers the others.

Failover: when a server's connection drops (or it misses the ``--request-timeout-s``
deadline) with a request in flight, :meth:`wait` re-sends that request to another replica of
the same part. The old request id is forgotten, so a late reply to it is dropped: each
request is answered, and each batch yielded, exactly once. With no replica left the error
names the part, the endpoint and what to change.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import torch
import zmq

from common.cluster import ClusterSpec
from common.errors import MfgServeError, PeerDisconnectedError, PeerTimeoutError, RemoteError
from common.messages import (
    Message,
    Ping,
    Pong,
    SampleRequest,
    SeedsReply,
    SeedsRequest,
    StatsReply,
    StatsRequest,
)
from common.rpc import RpcChannel, expect
from common.sockets import CurveKeys, Deadline

log = logging.getLogger("mfgserve.trainer")
SUSPECT_S = 30.0  # a server that missed a deadline is avoided this long while others are up


@dataclass
class Handle:
    """One request in flight: where it went, and what to re-send on failover."""

    part: int
    msg: Message
    channel: RpcChannel
    rid: int
    sent_at: float
    attempts: int = 1
    error: Exception | None = None  # why it will never be answered (wait() raises it)


class NoServerError(MfgServeError):
    """Every server of a part is down or unresponsive."""


class ServerPool:
    def __init__(self, cluster: ClusterSpec, *, timeout_s: float, max_message_bytes: int,
                 curve: CurveKeys | None = None, heartbeat_s: float = 0.0,
                 heartbeat_timeout_s: float = 0.0):
        self.ctx = zmq.Context()
        self.cluster = cluster
        self.timeout_s = timeout_s
        setting = "--request-timeout-s"
        self.channels = {ep: RpcChannel(self.ctx, ep, timeout_s=timeout_s, setting=setting,
                                        max_message_bytes=max_message_bytes, curve=curve,
                                        heartbeat_s=heartbeat_s,
                                        heartbeat_timeout_s=heartbeat_timeout_s)
                         for _, ep in cluster.all_endpoints()}
        self._rr = {p: itertools.cycle(eps) for p, eps in cluster.partitions.items()}
        self._buffered: dict[tuple[str, int], Message] = {}
        self._inflight: dict[tuple[str, int], Handle] = {}
        self.bytes_received = 0
        self.failovers = 0
        self.set_id = ""  # the servers' partition set, once info() checked they agree

    # ------------------------------------------------------------------ setup calls
    def info(self) -> Pong:
        """Ping every server; all must serve the same partition set, each the part listed."""
        pongs = {}
        for part, ep in self.cluster.all_endpoints():
            pong = expect(self.channels[ep].call(Ping(), waiting_for="a ping reply"), Pong, ep)
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

    def stats(self) -> dict[str, dict[str, float]]:
        return {ep: expect(ch.call(StatsRequest()), StatsReply, ep).values
                for ep, ch in self.channels.items()}

    # ------------------------------------------------------------------ requests
    def _pick(self, part: int, avoid: RpcChannel | None = None) -> RpcChannel | None:
        """Next replica of ``part`` that is up (not ``avoid``); None if there is none."""
        eps = self.cluster.partitions[part]
        for _ in range(len(eps)):
            ch = self.channels[next(self._rr[part])]
            if ch is not avoid and ch.healthy:
                return ch
        return None

    def submit(self, part: int, msg: Message, before_send=None) -> Handle:
        """Send ``msg`` to a replica of ``part``; ``before_send(endpoint, msg)`` returns it adapted
        to the replica chosen (e.g. offer a shared-memory slot only to servers that can use
        it)."""
        ch = self._pick(part) or self.channels[next(self._rr[part])]  # all down: try anyway
        if self.set_id and hasattr(msg, "set_id"):
            msg = dataclasses.replace(msg, set_id=self.set_id)  # type: ignore[type-var]
        if before_send is not None:
            msg = before_send(ch.endpoint, msg)
        handle = Handle(part, msg, ch, ch.send(msg), time.perf_counter())
        self._inflight[(ch.endpoint, handle.rid)] = handle
        return handle

    def _failover_channel(self, ch: RpcChannel, error: Exception) -> None:
        """Re-send every request in flight on ``ch`` to another replica of its part; a request
        that cannot be re-sent fails (its handle keeps the error, :meth:`wait` raises it)."""
        victims = [h for (ep, _), h in list(self._inflight.items()) if ep == ch.endpoint]
        for handle in victims:
            self._failover(handle, error)
        ch.forget(set(ch.lost) | set(ch.pending))

    def _fail(self, handle: Handle, error: Exception) -> None:
        """``handle`` will never be answered: stop tracking it and keep the reason."""
        handle.channel.forget({handle.rid})
        self._inflight.pop((handle.channel.endpoint, handle.rid), None)
        self._buffered.pop((handle.channel.endpoint, handle.rid), None)
        handle.error = error

    def _failover(self, handle: Handle, error: Exception) -> None:
        old = handle.channel
        self._fail(handle, error)
        replicas = len(self.cluster.partitions[handle.part])
        target = self._pick(handle.part, avoid=old)
        if target is None or handle.attempts > replicas:
            handle.error = NoServerError(
                f"part {handle.part} has no server left to answer: {error}. "
                f"{'No other replica is up' if replicas > 1 else 'It has no replica'} "
                f"(cluster file lists {replicas} for it); restart the server(s) of part "
                f"{handle.part} or add replicas to the cluster file")
            handle.error.__cause__ = error
            return
        log.warning("re-sending %s for part %d from %s to %s: %s", handle.msg.TYPE.name,
                    handle.part, old.endpoint, target.endpoint, error)
        self.failovers += 1
        handle.error = None
        if isinstance(handle.msg, SampleRequest) and handle.msg.slot is not None:
            # The old server may still write into the offered ring slot: the new one gets none.
            handle.msg = dataclasses.replace(handle.msg, slot=None)
        handle.channel, handle.rid = target, target.send(handle.msg)
        handle.attempts += 1
        self._inflight[(target.endpoint, handle.rid)] = handle

    def _receive(self, ch: RpcChannel, waiting_for: str, timeout_s: float | None = None) -> None:
        """Receive one reply on ``ch`` into the buffer; an error reply fails its own handle
        (which may not be the one awaited)."""
        try:
            reply, rid = ch.recv(timeout_s, waiting_for=waiting_for)
        except RemoteError as e:
            victim = self._inflight.get((ch.endpoint, e.rid))
            if victim is not None:
                self._fail(victim, e)
            return
        if (ch.endpoint, rid) in self._inflight:
            self._buffered[(ch.endpoint, rid)] = reply

    def _take(self, handle: Handle) -> Message | None:
        """The reply to ``handle`` if it arrived; raises its error if it failed."""
        if handle.error is not None:
            raise handle.error
        key = (handle.channel.endpoint, handle.rid)
        if key in self._buffered:
            self._inflight.pop(key, None)
            return self._buffered.pop(key)
        if key not in self._inflight:
            raise MfgServeError(f"request {handle.rid} to {handle.channel.endpoint} is no "
                                "longer in flight (it was cancelled)")
        return None

    def wait(self, handle: Handle) -> Message:
        """The reply to ``handle``, failing over to replicas as needed (see module doc).
        Every call ends: with the reply, or with the error that ended the request."""
        while True:
            reply = self._take(handle)
            if reply is not None:
                return reply
            ch = handle.channel
            try:
                self._receive(ch, f"the reply to {handle.msg.TYPE.name} for part {handle.part}")
            except (PeerDisconnectedError, PeerTimeoutError) as e:
                if isinstance(e, PeerTimeoutError):
                    ch.mark_suspect(SUSPECT_S)
                self._failover_channel(ch, e)

    def settle(self, handle: Handle, deadline: Deadline) -> bool:
        """Wait (until ``deadline``, never failing over) for the server ``handle`` was last
        sent to to finish with it. True when it answered (a reply or an error reply); False
        when it did not, or will not: the request is then cancelled."""
        while True:
            try:
                if self._take(handle) is not None:
                    return True
            except RemoteError:
                return True
            except MfgServeError:
                return False
            ch = handle.channel
            try:
                self._receive(ch, "a reply to an abandoned request", deadline.left())
            except PeerTimeoutError:
                self.cancel(handle)
                return False
            except PeerDisconnectedError as e:
                for h in [h for (ep, rid), h in list(self._inflight.items())
                          if ep == ch.endpoint and rid in ch.lost]:
                    self._fail(h, e)
                ch.forget(set(ch.lost))
                return False

    def cancel(self, handle: Handle) -> None:
        """Forget ``handle``: a late reply to it is dropped."""
        if handle.error is None:
            self._fail(handle, MfgServeError("cancelled"))

    def close(self) -> None:
        if self.ctx.closed:
            return
        for ch in self.channels.values():
            self.bytes_received += ch.bytes_received
            ch.close()
        self.ctx.term()
