"""A DGL-DataLoader-like iterator over mini-batches sampled by the servers.

Each iteration yields ``(input_nodes, output_nodes, mfg)`` with ``mfg[0].srcdata["feat"]``
and ``mfg[-1].dstdata["label"]``, like ``dgl.dataloading.DataLoader`` with a
``NeighborSampler``. Guarantees:

* Every epoch, the seeds are shuffled with a generator seeded by ``(seed, epoch)`` that all
  ranks share, split into ``world_size`` near-equal shards, and each shard into the same
  number of batches on every rank (sizes differ by at most one): every seed is used exactly
  once per epoch and DDP ranks step in lockstep.
* At most ``max_inflight`` requests are outstanding (credit-based prefetch); batches are
  yielded in order.
* A batch goes to a server of the part owning most of its seeds; that server samples across
  part boundaries, so the MFG does not depend on which part received it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.messages import MFGReply, SampleRequest
from common.mfg import MFG
from common.rpc import expect
from trainer_client.feature_cache import FeatureCache
from trainer_client.server_pool import ServerPool


@dataclass
class LoaderStats:
    """Seconds and bytes accumulated over the batches this loader yielded."""

    batches: int = 0
    seeds: int = 0
    wait_s: float = 0.0  # blocked waiting for a reply (not hidden by prefetch)
    h2d_s: float = 0.0
    server: dict[str, float] = field(default_factory=dict)

    def add_server(self, timings: dict[str, float]) -> None:
        for k, v in timings.items():
            self.server[k] = self.server.get(k, 0.0) + v


def shard_batches(seeds: Tensor, batch_size: int, rank: int, world_size: int, *,
                  shuffle: bool, seed: int, epoch: int) -> list[Tensor]:
    """This rank's batches for an epoch (see the module docstring for the guarantees)."""
    n = seeds.numel()
    if n < world_size:
        raise ValueError(f"{n} seeds cannot be shared by {world_size} trainers; "
                         "use fewer trainers (--num-trainers) or a larger split")
    if shuffle:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        seeds = seeds[torch.randperm(n, generator=g)]
    shard = torch.tensor_split(seeds, world_size)[rank]
    largest, smallest = math.ceil(n / world_size), n // world_size
    # Same count on every rank, and never an empty batch (a rank with an empty batch could
    # not take its DDP step): only when batch_size exceeds a tiny shard does a batch grow.
    num_batches = max(1, min(math.ceil(largest / batch_size), smallest))
    return list(torch.tensor_split(shard, num_batches))


class DistNodeDataLoader:
    def __init__(self, pool: ServerPool, seeds: Tensor, node_offsets: list[int], *,
                 fanouts: list[int], batch_size: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, max_inflight: int = 4,
                 device: torch.device | str = "cpu", with_label: bool = True,
                 feat_transfer: str = "", cache: FeatureCache | None = None,
                 cache_ratio: float = 0.0):
        self.pool = pool
        self.seeds = seeds
        self.offsets = torch.tensor(node_offsets, dtype=torch.int64)
        self.fanouts = list(fanouts)
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.max_inflight = max_inflight
        self.device = torch.device(device)
        self.with_label = with_label
        self.feat_transfer = feat_transfer
        self.cache = cache
        self.cache_ratio = cache_ratio if cache is not None else 0.0
        self.epoch = 0
        self.stats = LoaderStats()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[Tensor]:
        return shard_batches(self.seeds, self.batch_size, self.rank, self.world_size,
                             shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)

    def __len__(self) -> int:
        return len(self._batches())

    def _owner(self, batch: Tensor) -> int:
        owners = torch.searchsorted(self.offsets, batch, right=True) - 1
        return int(torch.bincount(owners).argmax())

    def _submit(self, batch: Tensor):
        req = SampleRequest(seeds=batch, fanouts=self.fanouts, with_feat=True,
                            with_label=self.with_label, feat_dtype=self.feat_transfer,
                            cache_ratio=self.cache_ratio)
        return self.pool.submit(self._owner(batch), req)

    def _to_mfg(self, reply: MFGReply) -> MFG:
        mfg = MFG.from_csc(reply.input_nodes, reply.num_src, reply.num_dst, reply.indptr,
                           reply.indices)
        feat = reply.feat
        if reply.feat_present.numel():
            if self.cache is None:
                raise RuntimeError("a server left out cached features, but this loader has "
                                   "no feature cache")
            feat = self.cache.assemble(reply.input_nodes, feat, reply.feat_present)
        mfg.blocks[0].srcdata["feat"] = feat
        mfg.blocks[-1].dstdata["label"] = reply.label
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            mfg = mfg.pin_memory().to(self.device, non_blocking=True)
            self.stats.h2d_s += time.perf_counter() - t0
        return mfg

    def __iter__(self):
        batches = deque(self._batches())
        inflight: deque = deque()
        while batches or inflight:
            while batches and len(inflight) < self.max_inflight:
                inflight.append(self._submit(batches.popleft()))
            handle = inflight.popleft()
            t0 = time.perf_counter()
            reply = expect(self.pool.wait(handle), MFGReply, handle.channel.endpoint)
            now = time.perf_counter()
            self.stats.wait_s += now - t0
            self.stats.add_server(reply.timings)
            mfg = self._to_mfg(reply)
            self.stats.batches += 1
            self.stats.seeds += mfg.output_nodes.numel()
            yield mfg.input_nodes, mfg.output_nodes, mfg
