"""A DGL-DataLoader-like iterator over mini-batches sampled by the servers.

Each iteration yields ``(input_nodes, output_nodes, mfg)`` with ``mfg[0].srcdata["feat"]``
(a tensor; :class:`~common.mfg.SourceRows` with ``local_features``) and
``mfg[-1].dstdata["label"]``, like ``dgl.dataloading.DataLoader`` with a ``NeighborSampler``.
Guarantees:

* Every epoch, the seeds are shuffled with a generator seeded by ``(seed, epoch)`` that all
  ranks share, split into ``world_size`` near-equal shards, and each shard into the same
  number of batches on every rank (sizes differ by at most one): every seed is used exactly
  once per epoch and DDP ranks step in lockstep.
* At most ``max_inflight`` requests are outstanding (credit-based prefetch); batches are
  yielded in order. ``prefetch`` says when they are sent (``--prefetch``, common/config.py):
  ``"overlap"`` tops the window up after every batch, so the servers sample while the model
  computes; ``"alternate"`` sends a whole window only when none is outstanding and the
  previous window's last batch has been handed out, and hands out its first batch once every
  reply of the window has arrived, so sampling and compute take turns; ``"auto"`` alternates
  when ``alternate_if_local`` (the caller's threads cover every core) and a server has
  written into this trainer's shared-memory ring (it shares the host), else overlaps.
* ``batch_locality="part"`` (training): batches are made of one part's seeds, in a shuffled
  order (see :func:`shard_batches`); the guarantees above still hold.
* A batch goes to a server of the part owning most of its seeds; that server samples across
  part boundaries, so the MFG does not depend on which part received it.
* ``hetero``: batches are :class:`~common.mfg.HeteroMFG` s (typed MFGs; a homogeneous set
  gives the one-type case), seeds of ``seed_ntype``, requests carrying ``rel_fanouts`` (per
  layer one fanout per relation id) on a typed set. With the shared-memory ring the servers
  write every node type's rows into the one slot, type after type in node-set order; each
  NodeSet's ``num_rows`` says how many are its own (sampler_server/sample_worker.py).
* ``cache`` (``--cache-ratio``): in the cached mode a server leaves out the rows the trainer's
  :class:`FeatureCache` holds and sends a present-mask per NodeSet; each NodeSet with one is
  completed from the cache (one cache over the set's one global id space serves every node
  type; with the ring, the slot holds only the present rows). Homogeneous and typed MFGs go
  through the same code (:meth:`DistNodeDataLoader._features`, one tensor per NodeSet).
* ``deterministic`` (the default): batch i of an epoch carries the sample seed
  ``derive_seed(seed, epoch, rank, i)`` (a resend to another replica keeps it), so its MFG
  is the same in every run with the same seed: a run resumed at epoch k samples exactly what
  the uninterrupted run sampled (sampler_server/seeded_sampler.py). Off: the servers' own
  random streams.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from common.config import PREFETCH_MODES
from common.joined_rows import JoinedRows
from common.messages import MFGReply, RelFanouts, SampleRequest, derive_seed
from common.mfg import MFG, HeteroMFG, SourceRows, mfg_tensors, to_device
from common.rpc import expect
from common.sampled_mfg import FEAT_RING
from common.shm_ring import ShmRing
from common.sockets import Deadline
from common.stats import RequestTimings
from trainer_client.core_turns import CoreTurns
from trainer_client.feature_cache import FeatureCache
from trainer_client.server_pool import Handle, ServerPool

log = logging.getLogger("mfgserve.trainer")


@dataclass
class _InFlight:
    """A request in flight: its handle, its ring slot, and its reply once taken."""

    handle: Handle
    slot: int | None
    reply: MFGReply | None = None
    taken_at: float = 0.0  # perf_counter() when the reply was taken


@dataclass
class LoaderStats:
    """Seconds and bytes accumulated over the batches this loader yielded (by the thread
    iterating it, the only one that changes them)."""

    batches: int = 0
    seeds: int = 0
    wait_s: float = 0.0  # blocked waiting for a reply (not hidden by prefetch)
    wire_s: float = 0.0  # per request: round trip minus the server's time (overlaps compute)
    decode_s: float = 0.0  # reply -> MFG (incl. cache assembly)
    h2d_s: float = 0.0  # issuing host-to-device copies (one from pageable memory holds the host)
    h2d_wait_s: float = 0.0  # waiting for a batch's copies to finish before its compute
    h2d_copy_s: float = 0.0  # the copies' own time on the copy stream (CUDA events; 0 on CPU)
    ring_hits: int = 0  # replies whose features arrived in the shared-memory ring
    ring_misses: int = 0  # requests sent without a slot (none free)
    bursts: int = 0  # windows sent at once and awaited whole (prefetch alternate)
    server: RequestTimings = field(default_factory=RequestTimings)  # summed over replies

    def add_server(self, timings: dict[str, float]) -> None:
        """Add one reply's server timings (an MFG reply's ``timings``, by name)."""
        self.server.add(RequestTimings.from_wire(timings))

    def stage_seconds(self, compute_s: float, loss_read_s: float = 0.0) -> dict[str, float]:
        """The summary's ``stages_s`` (this trainer's share; README documents the names).
        ``loss_read_s`` is the part of ``compute_s`` spent reading the steps' losses (on a
        GPU: the host waiting for the device to finish a step; about 0 on the CPU)."""
        s = self.server
        return {"server_sample_s": s.sample_s, "server_gather_s": s.gather_s,
                "server_remote_s": s.remote_s, "server_encode_s": s.encode_s,
                "server_queue_s": s.queue_s, "server_total_s": s.server_s,
                "wire_s": self.wire_s, "decode_s": self.decode_s,
                "trainer_wait_s": self.wait_s, "h2d_s": self.h2d_s,
                "h2d_wait_s": self.h2d_wait_s, "h2d_copy_s": self.h2d_copy_s,
                "forward_backward_s": compute_s, "loss_read_s": loss_read_s}


def hidden_share(issue_s: float, wait_s: float, copy_s: float) -> float | None:
    """The share of the host-to-device copies' own time (``copy_s``, on the copy stream) that
    the trainer's host did not spend on them: 1 - (issuing + waiting) / copy time, in [0, 1];
    None without copies. Issuing counts: a copy from pageable memory holds the host until it
    is done (and until whatever the copy stream had queued before it is done)."""
    if copy_s <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - (issue_s + wait_s) / copy_s))


def _by_part(seeds: Tensor, offsets: Tensor, g: torch.Generator) -> Tensor:
    """``seeds`` (already shuffled) grouped by owning part, the parts in a random order."""
    owners = torch.searchsorted(offsets, seeds, right=True) - 1
    part_order = torch.randperm(offsets.numel() - 1, generator=g)
    return seeds[torch.argsort(part_order[owners], stable=True)]


def shard_batches(seeds: Tensor, batch_size: int, rank: int, world_size: int, *,
                  shuffle: bool, seed: int, epoch: int,
                  part_offsets: Tensor | None = None) -> list[Tensor]:
    """This rank's batches for an epoch (see the module docstring for the guarantees).

    ``part_offsets`` (the partition set's node offsets; training only, with ``shuffle``):
    batches of one part's seeds (``--batch-locality part``): the shuffled seeds are grouped
    by part, the parts in a random order, split as usual, and the order of this rank's
    batches is shuffled; only a batch that straddles two parts' groups mixes them."""
    n = seeds.numel()
    if n < world_size:
        raise ValueError(f"{n} seeds cannot be shared by {world_size} trainers; "
                         "use fewer trainers (--num-trainers) or a larger split")
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    if shuffle:
        seeds = seeds[torch.randperm(n, generator=g)]
        if part_offsets is not None:
            seeds = _by_part(seeds, part_offsets, g)
    shard = torch.tensor_split(seeds, world_size)[rank]
    largest, smallest = math.ceil(n / world_size), n // world_size
    # Same count on every rank, and never an empty batch (a rank with an empty batch could
    # not take its DDP step): only when batch_size exceeds a tiny shard does a batch grow.
    num_batches = max(1, min(math.ceil(largest / batch_size), smallest))
    batches = list(torch.tensor_split(shard, num_batches))
    if shuffle and part_offsets is not None:
        batches = [batches[i] for i in torch.randperm(num_batches, generator=g).tolist()]
    return batches


class DistNodeDataLoader:
    def __init__(self, pool: ServerPool, seeds: Tensor, node_offsets: list[int], *,
                 fanouts: list[int], batch_size: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, max_inflight: int = 4,
                 device: torch.device | str = "cpu", with_label: bool = True,
                 feat_transfer: str = "", cache: FeatureCache | None = None,
                 cache_ratio: float = 0.0, ring: ShmRing | None = None,
                 deterministic: bool = True, batch_locality: str = "global",
                 hetero: bool = False, rel_fanouts: list[list[int]] | None = None,
                 seed_ntype: str | None = None, prefetch: str = "overlap",
                 alternate_if_local: bool = False, turns: CoreTurns | None = None,
                 local_features: Sequence[Tensor] | None = None,
                 local_joined: JoinedRows | None = None):
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, got {prefetch!r}")
        self.pool = pool
        self.prefetch = prefetch
        self.alternate_if_local = alternate_if_local
        self.turns = turns  # --yield-cores: the OpenMP workers yield during each window
        self.seeds = seeds
        self.offsets = torch.tensor(node_offsets, dtype=torch.int64)
        self._offsets_np = self.offsets.numpy()
        self.fanouts = list(fanouts)
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.deterministic = deterministic
        if batch_locality not in ("global", "part"):
            raise ValueError(f"batch_locality must be 'global' or 'part', got {batch_locality!r}")
        self.batch_locality = batch_locality
        self.max_inflight = max_inflight
        self.device = torch.device(device)
        self.with_label = with_label
        self.feat_transfer = feat_transfer
        self.cache = cache
        self.cache_ratio = cache_ratio if cache is not None else 0.0
        self.ring = ring
        # --local-features: the set's feature matrices on this host, one per part (indexed
        # by node_offsets); the servers gather no rows and each MFG's input features are
        # SourceRows of them (trainer_client/local_features.py)
        self.local_features = None if local_features is None else list(local_features)
        if self.local_features is not None and len(self.local_features) != len(node_offsets) - 1:
            raise ValueError(f"local_features needs one matrix per part "
                             f"({len(node_offsets) - 1}), got {len(self.local_features)}")
        if local_features is not None and (hetero or cache is not None or feat_transfer):
            raise ValueError("local_features reads a homogeneous set's stored rows: not with "
                             "hetero, a feature cache or feat_transfer")
        # the same matrices joined into one (common/joined_rows.py), where they could be
        if local_joined is not None and (self.local_features is None or list(
                local_joined.offsets) != [int(o) for o in node_offsets]):
            raise ValueError("local_joined joins the parts' local_features (same node offsets)")
        self.local_joined = local_joined
        self.hetero, self.seed_ntype = hetero, seed_ntype
        self.rel_fanouts = RelFanouts.table(rel_fanouts) if rel_fanouts else []
        if rel_fanouts and len(rel_fanouts) != len(self.fanouts):
            raise ValueError(f"rel_fanouts needs one row per layer ({len(self.fanouts)}), "
                             f"got {len(rel_fanouts)}")
        self.no_ring: set[str] = set()  # servers that said they cannot use the ring
        self.epoch = 0
        self.stats = LoaderStats()
        self.copy_stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda"
                            else None)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[Tensor]:
        local = self.batch_locality == "part"
        return shard_batches(self.seeds, self.batch_size, self.rank, self.world_size,
                             shuffle=self.shuffle, seed=self.seed, epoch=self.epoch,
                             part_offsets=self.offsets if local else None)

    def __len__(self) -> int:
        return len(self._batches())

    def sample_seed(self, index: int) -> int:
        """The sample seed of this epoch's batch ``index`` (-1 when not deterministic)."""
        if not self.deterministic:
            return -1
        return derive_seed(self.seed, self.epoch, self.rank, index)

    def _owner(self, batch: Tensor) -> int:
        """The part owning most of ``batch``'s seeds (its request goes to that part).

        numpy, not torch: ``torch.searchsorted`` over a batch's ids runs an OpenMP parallel
        region, and the trainer's thread then waits for every thread of its pool, some of
        them descheduled by the servers' threads on the same cores. In a profile of the
        trainer loader (benchmarks.datapath, RMAT, 2 cores) that was 54 % of the loader's
        CPU samples, about 6 ms a batch; numpy's single-threaded search takes ~20 us."""
        if self._offsets_np.size == 2:  # one part
            return 0
        owners = np.searchsorted(self._offsets_np, batch.numpy(), side="right") - 1
        return int(np.bincount(owners).argmax())

    def alternating(self) -> bool:
        """Whether requests go out in whole windows, taking turns with compute (see
        ``prefetch``); under "auto" it turns on with the first reply in the ring, or from
        the start with ``local_features`` (the servers' set is on this host)."""
        if self.prefetch != "auto":
            return self.prefetch == "alternate"
        return self.alternate_if_local and (self.stats.ring_hits > 0
                                            or self.local_features is not None)

    def _take(self, req: _InFlight) -> MFGReply:
        """``req``'s reply, waiting for it (timed as ``wait_s``) unless already taken."""
        if req.reply is None:
            t0 = time.perf_counter()
            req.reply = expect(self.pool.wait(req.handle), MFGReply,
                               req.handle.channel.endpoint)
            req.taken_at = time.perf_counter()
            self.stats.wait_s += req.taken_at - t0
        return req.reply

    def _submit(self, index: int, batch: Tensor) -> _InFlight:
        local = self.local_features is not None
        req = SampleRequest(seeds=batch, fanouts=self.fanouts, with_feat=not local,
                            with_label=self.with_label, feat_dtype=self.feat_transfer,
                            cache_ratio=self.cache_ratio, sample_seed=self.sample_seed(index),
                            max_reply_bytes=self.pool.max_message_bytes,
                            rel_fanouts=self.rel_fanouts)
        offered: list[int] = []

        def offer(endpoint: str, msg: SampleRequest) -> SampleRequest:
            """The request with a ring slot, if its server can use the ring and one is free."""
            if self.ring is None or endpoint in self.no_ring or local:
                return msg  # (no features, nothing for a slot to hold)
            slot = self.ring.acquire()
            if slot is None:
                self.stats.ring_misses += 1
                return msg
            offered.append(slot)
            return dataclasses.replace(msg, slot=self.ring.ref(slot))

        handle = self.pool.submit(self._owner(batch), req, before_send=offer)
        return _InFlight(handle, offered[0] if offered else None)

    def _features(self, reply: MFGReply, slot: int | None, handle: Handle) -> list[Tensor]:
        """Each NodeSet's input features (one per node type; a homogeneous MFG has one), in
        node-set order: its frame off the wire, or its share of the ring slot (the sets' rows
        one after the other), completed from the feature cache where the server left rows
        out (the cached mode: a present-mask per NodeSet over its own global ids)."""
        ring = self.ring
        sets = reply.mfg.nodes
        if slot is not None and handle.attempts > 1:
            # Re-sent without the slot (ServerPool.for_resend); the first server may still
            # write into it, so it is never reused.
            ring.poison(slot)  # type: ignore[union-attr]
            slot = None
        endpoint = handle.channel.endpoint
        errors = [ns.feat.slot_error for ns in sets if ns.feat.slot_error]
        if errors and endpoint not in self.no_ring:
            log.warning("server %s cannot use this trainer's shared-memory ring; its replies "
                        "come over the socket: %s", endpoint, errors[0])
            self.no_ring.add(endpoint)
        via_ring = [ns.feat.via == FEAT_RING for ns in sets]
        rows: list[Tensor]
        if not any(via_ring):
            if slot is not None:
                ring.release(slot)  # type: ignore[union-attr]
            rows = [ns.feat.rows for ns in sets]
        elif slot is None:
            raise RuntimeError("a server wrote features into a ring slot this trainer did not "
                               "offer it")
        elif not all(via_ring):
            raise RuntimeError("a server sent some node types' features in the ring slot and "
                               "others on the wire; expected all in one place")
        else:
            self.stats.ring_hits += 1
            f0 = sets[0].feat
            sizes = [ns.feat.num_rows for ns in sets]  # present rows only, in the cached mode
            # Views of the slot: it is released (_release) once the last of them is gone; the
            # cache's assembly copies a set's rows out, so that set's view dies here.
            view = ring.view(slot, sum(sizes), f0.rows.shape[1],  # type: ignore[union-attr]
                             f0.rows.dtype, self._release)
            rows = [view] if len(sets) == 1 else list(torch.split(view, sizes))
            # A type without input nodes: a fresh empty tensor, so that in the cached mode
            # (every other set assembled) nothing keeps the slot past this batch's decode.
            rows = [r if r.numel() else r.clone() for r in rows]
            del view
        out = []
        for ns in sets:
            r = rows.pop(0)
            if ns.feat.present.numel():
                if self.cache is None:
                    raise RuntimeError("a server left out cached features, but this loader "
                                       "has no feature cache")
                r = self.cache.assemble(ns.ids, r, ns.feat.present)
            out.append(r)
        return out

    def _release(self, slot: int) -> None:
        """A slot's last host tensor is gone; with CUDA, free it once the copy is done."""
        event = None
        if self.copy_stream is not None:
            # Copies out of the slot ran on the copy stream (the cache's assembly too); the
            # slot is free once it, and the current stream, have passed this point.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.ring.release(slot, event)  # type: ignore[union-attr]

    def _to_mfg(self, reply: MFGReply, slot: int | None, handle: Handle) -> MFG | HeteroMFG:
        """Decode the reply into an MFG and start its copy to the device (non-blocking)."""
        t0 = time.perf_counter()
        mfg: MFG | HeteroMFG
        start = None
        if self.copy_stream is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            # the cache's assembly (a GPU cache's copies and gathers) on the copy stream too
            with torch.cuda.stream(self.copy_stream):
                feats = self._features(reply, slot, handle)
        elif self.local_features is not None:  # (no slot was offered: _submit)
            ids = reply.mfg.only.ids
            feats = [self.local_joined.source_rows(ids) if self.local_joined is not None
                     else SourceRows(self.local_features, ids, self._offsets_np)]
        else:
            feats = self._features(reply, slot, handle)
        if self.hetero:
            mfg = HeteroMFG.of(reply.mfg, {ns.ntype: f for ns, f in zip(reply.mfg.nodes, feats)},
                               seed_ntype=self.seed_ntype)
        else:
            (feat,) = feats
            mfg = MFG.of(reply.mfg, feat)
        del feats
        t1 = time.perf_counter()
        self.stats.decode_s += t1 - t0
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                mfg = to_device(mfg, self.device)  # pageable sources first: see to_device
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.copy_stream)
            mfg.ready = event  # type: ignore[union-attr]
            mfg.copy_start = start  # type: ignore[union-attr]
        else:
            mfg = mfg.to(self.device)  # the same step; on CPU nothing to copy
        self.stats.h2d_s += time.perf_counter() - t1
        return mfg

    def _finish(self, mfg: MFG | HeteroMFG) -> MFG | HeteroMFG:
        """Wait (host side, timed) for the batch's copy; the part not hidden shows here."""
        event = getattr(mfg, "ready", None)
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()
            self.stats.h2d_wait_s += time.perf_counter() - t0
            # the copy's own time on the copy stream, from the event before it to this one
            self.stats.h2d_copy_s += mfg.copy_start.elapsed_time(event) / 1e3  # type: ignore
            # Made on the copy stream, used on the current one: tell the caching allocator,
            # so that their memory is not handed to the next copy while compute reads it.
            current = torch.cuda.current_stream(self.device)
            for t in mfg_tensors(mfg):
                t.record_stream(current)
        return mfg

    def __iter__(self):
        """Batches in order. Batch i+1's reply is decoded and its device copy started before
        batch i is handed out, so the copy overlaps batch i's compute."""
        batches = deque(enumerate(self._batches()))
        inflight: deque = deque()
        ready = None
        try:
            while batches or inflight:
                alternate = self.alternating()
                if batches and not (alternate and inflight):
                    if alternate and ready is not None:
                        # The window's last batch goes out before the next window: it is
                        # computed on before the servers' turn instead of after it (the same
                        # turns), and its ring slot is free for the next window, so an
                        # alternating run fills max_inflight slots, not max_inflight + 1.
                        out, ready = self._finish(ready), None
                        yield out.input_nodes, out.output_nodes, out
                        del out
                    turns = self.turns if alternate else None
                    if turns is not None:
                        turns.give()  # the servers' turn: every core is theirs
                    try:
                        while batches and len(inflight) < self.max_inflight:
                            inflight.append(self._submit(*batches.popleft()))
                        if alternate:  # the whole window arrives before any of it is computed
                            self.stats.bursts += 1
                            for req in inflight:
                                self._take(req)
                    finally:
                        if turns is not None:
                            turns.take()  # the trainer's turn
                req = inflight[0]
                reply = self._take(req)
                inflight.popleft()
                req.reply = None
                self.stats.wire_s += max(0.0, req.taken_at - req.handle.sent_at
                                         - reply.timings.get("server_s", 0.0))
                self.stats.add_server(reply.timings)
                mfg = self._to_mfg(reply, req.slot, req.handle)
                del reply
                self.stats.batches += 1
                self.stats.seeds += mfg.output_nodes.numel()
                if ready is not None:
                    out, ready = self._finish(ready), None
                    yield out.input_nodes, out.output_nodes, out
                    del out
                ready = mfg
                del mfg
            if ready is not None:
                out, ready = self._finish(ready), None
                yield out.input_nodes, out.output_nodes, out
        except Exception:
            self._drop(inflight)
            raise
        finally:
            self._abandon(inflight)

    def _drop(self, inflight: deque) -> None:
        """A request failed (a part lost its servers, an error reply): the trainer stops, so
        nothing waits for the requests still in flight. A server still sampling into a ring
        slot may write it later; those slots are never reused. (Waiting here could last
        another part's whole peer timeout: its server may be stuck on the lost part.)"""
        for req in inflight:
            self.pool.cancel(req.handle)
            if req.slot is not None and self.ring is not None:
                self.ring.poison(req.slot)
        inflight.clear()

    def _abandon(self, inflight: deque) -> None:
        """Requests still in flight when iteration stops early (a break, or an error). A
        ring slot may still be written until its server answers, so wait for those servers
        (bounded by one request deadline in all, never failing over) and reuse a slot only
        when its server is done with it; the others are never reused."""
        deadline = Deadline(self.pool.timeout_s)
        for req in inflight:
            handle, slot = req.handle, req.slot
            if slot is None or self.ring is None:
                self.pool.cancel(handle)
                continue
            # a reply already taken (prefetch alternate): its server is done with the slot
            done = req.reply is not None or self.pool.settle(handle, deadline)
            if done and handle.attempts == 1:
                self.ring.release(slot)
            else:
                self.ring.poison(slot)
