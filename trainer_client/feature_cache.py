"""The trainer's feature cache: the hottest nodes' features, held on the training device.

Which nodes are cached is decided by the partition set (``hot_rank.npy``, pre-sampled at
partition time): with ratio r, the nodes ranked below floor(r * part size) in each part.
Servers apply the same rule and leave those rows out of their replies (the cached mode of
common.sampled_mfg.Features: a present-mask), so neither side sends a list of cached ids.
:meth:`assemble` rebuilds the full feature matrix.

Typed (heterogeneous) sets keep one global id space over all node types and one feature
matrix, and hot_rank.npy ranks a part's nodes of every type together: one cache serves every
type, and the loader assembles each NodeSet of a typed MFG (its global ids, its received rows,
its present-mask) like a homogeneous MFG's one set. Featureless types (their rows are zeros)
are cached like the others when hot: correct, but cache space spent on rows a run with
``--node-emb-dim`` does not read.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from common import native
from common.messages import CacheFillReply, CacheFillRequest
from common.rpc import expect


class FeatureCache:
    def __init__(self, nodes: Tensor, feat: Tensor, num_nodes: int, device: torch.device):
        self.device = device
        self.feat = feat.to(device)
        # Cache row of every node (-1: not cached), on the host even for a GPU cache: a
        # batch's row positions are found on the host (:meth:`assemble`), so assembling never
        # makes the host wait for the device. int32 where the rows fit: 4 bytes a node.
        dtype = torch.int32 if nodes.numel() < 2**31 else torch.int64
        self.slot = torch.full((num_nodes,), -1, dtype=dtype)
        self.slot[nodes.cpu()] = torch.arange(nodes.numel(), dtype=dtype)
        self.rows_served = 0  # rows taken from the cache instead of the wire
        self.bytes_saved = 0

    @classmethod
    def fill(cls, pool, num_parts: int, num_nodes: int, ratio: float, feat_dtype: str,
             device: torch.device) -> FeatureCache:
        """Ask every part's server for its share of hot nodes (one request per part)."""
        nodes, feats = [], []
        for part in range(num_parts):
            reply = expect(pool.wait(pool.submit(part, CacheFillRequest(
                cache_ratio=ratio, feat_dtype=feat_dtype))), CacheFillReply, f"part {part}")
            nodes.append(reply.nodes.clone())
            feats.append(reply.feat.clone())
        return cls(torch.cat(nodes), torch.cat(feats), num_nodes, device)

    @property
    def num_cached(self) -> int:
        return int(self.feat.shape[0])

    @property
    def nbytes(self) -> int:
        return self.feat.numel() * self.feat.element_size()

    def assemble(self, input_nodes: Tensor, received: Tensor, present: Tensor) -> Tensor:
        """Features of ``input_nodes``: received rows where ``present``, cached rows elsewhere,
        on the cache's device. ``input_nodes`` and ``present`` are host tensors (the reply's).

        Row positions are found on the host (numpy), then rows copied with index_select /
        index_copy_ (boolean-mask indexing would find them again for every read and write).
        With a CUDA cache the work is queued on the current stream and nothing waits for the
        device: the three index vectors go over in one page-locked copy, the received rows
        (page-locked in a ring slot) without a wait either. Run on the loader's copy stream, the
        assembly overlaps the previous batch's compute (on the default stream it would queue
        behind it, and a pageable copy or a device-side ``nonzero`` would make the host wait
        for both).
        A CPU cache assembles in one pass of a native kernel where it is loaded
        (:meth:`_assemble_native`)."""
        if self.device.type == "cpu":
            out = self._assemble_native(input_nodes, received, present)
            if out is not None:
                return out
        p = present.cpu().numpy()
        have = np.flatnonzero(p)  # numpy: 3-4x torch.nonzero's speed on the CPU
        fill = np.flatnonzero(~p)
        slots = self.slot.numpy()[input_nodes.cpu().numpy()[fill]]
        if slots.size and int(slots.min()) < 0:
            raise RuntimeError("a server left out features of a node this trainer does not "
                               "cache: trainer and servers disagree on --cache-ratio / "
                               "hot_rank.npy")
        index = torch.empty(have.size + fill.size + slots.size, dtype=torch.int64,
                            pin_memory=self.device.type == "cuda")
        np.concatenate([have, fill, slots], out=index.numpy())  # int32 slots widened
        if self.device.type != "cpu":
            index = index.to(self.device, non_blocking=True)
        have, fill, slots = index.split([have.size, fill.size, slots.size])
        out = torch.empty((input_nodes.numel(), self.feat.shape[1]), dtype=self.feat.dtype,
                          device=self.device)
        out.index_copy_(0, have, received.to(self.device, non_blocking=True).to(self.feat.dtype))
        out.index_copy_(0, fill, self.feat.index_select(0, slots))
        self.rows_served += int(fill.numel())
        self.bytes_saved += int(fill.numel()) * self.feat.shape[1] * received.element_size()
        return out

    def _assemble_native(self, input_nodes: Tensor, received: Tensor,
                         present: Tensor) -> Tensor | None:
        """:meth:`assemble` for a CPU cache by common/native.c's ``mfg_assemble_rows``: each
        row copied once, in order, from the reply or the cache (the torch path copies the
        cached rows twice, through ``index_select`` and ``index_copy_``: 27 ms of CPU against
        16 for an RMAT batch, docs/benchmarks.md, "Issue 14, session 45"). None where the
        kernel does not apply (not loaded, a reply of another dtype than the cache's, int64
        cache slots): the caller takes the torch path."""
        lib = native.load()
        if (lib is None or self.slot.dtype != torch.int32 or received.dtype != self.feat.dtype
                or input_nodes.dtype != torch.int64 or present.dtype != torch.bool):
            return None
        nodes = input_nodes.contiguous()
        mask = present.contiguous()
        rows = received.contiguous()
        n, width = nodes.numel(), self.feat.shape[1]
        if mask.numel() != n or (rows.numel() and rows.shape[1:] != self.feat.shape[1:]):
            raise RuntimeError(f"a reply's features do not match its input nodes: {n} nodes, "
                               f"a present-mask of {mask.numel()}, rows of shape "
                               f"{tuple(rows.shape)} against the cache's width {width}")
        out = torch.empty((n, width), dtype=self.feat.dtype)
        row_bytes = width * self.feat.element_size()
        got = lib.mfg_assemble_rows(
            self.feat.data_ptr(), row_bytes, self.feat.shape[0], self.slot.data_ptr(),
            self.slot.numel(), nodes.data_ptr(), mask.data_ptr(), n, rows.data_ptr(),
            rows.shape[0], out.data_ptr())
        if got != n:
            raise RuntimeError(
                "a reply's features cannot be assembled with this trainer's cache: a node "
                "outside the graph, a node left out of the reply that this trainer does not "
                "cache, or a reply whose row count differs from its present-mask (trainer and "
                "servers disagree on --cache-ratio / hot_rank.npy)")
        served = n - rows.shape[0]
        self.rows_served += served
        self.bytes_saved += served * width * received.element_size()
        return out
