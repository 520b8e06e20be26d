"""One partition in memory: its topology as a DGL sampling graph, its features and labels.

Local operations only (no networking): sample in-neighbours of owned nodes with DGL's C++
sampler, and gather owned nodes' features/labels. Arrays come from the partition set's
memory-mapped ``.npy`` files, so several processes on a node share the page cache.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor

from common.dgl_compat import import_dgl
from partition.layout import Partition, load_partition


def _as_tensor(a: np.ndarray) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap; never written
        return torch.from_numpy(a)


class PartitionStore:
    """Owned nodes are global ids ``[start, end)``; local id = global id - start."""

    def __init__(self, root: str, part_id: int, seed: int = 0):
        self.dgl = import_dgl()
        self.part: Partition = load_partition(root, part_id)
        self.meta = self.part.meta
        self.part_id = part_id
        self.start = self.meta.node_offsets[part_id]
        self.end = self.meta.node_offsets[part_id + 1]
        self.node_offsets = torch.tensor(self.meta.node_offsets, dtype=torch.int64)
        indptr = _as_tensor(self.part.indptr)
        indices = _as_tensor(self.part.indices)
        self.graph = self.dgl.heterograph(
            {("src", "e", "dst"): ("csc", (indptr, indices, torch.empty(0, dtype=torch.int64)))},
            num_nodes_dict={"src": self.meta.num_nodes, "dst": self.end - self.start},
        )
        self.feat = _as_tensor(self.part.feat)
        self.label = _as_tensor(self.part.label)
        self.dgl.seed(seed)

    def owner_of(self, gids: Tensor) -> Tensor:
        return torch.searchsorted(self.node_offsets, gids, right=True) - 1

    def _local(self, gids: Tensor) -> Tensor:
        local = gids - self.start
        if local.numel() and (int(local.min()) < 0 or int(gids.max()) >= self.end):
            raise ValueError(f"part {self.part_id} does not own all of the requested nodes "
                             f"(it owns global ids [{self.start}, {self.end}))")
        return local

    def sample_neighbors(self, nodes: Tensor, fanout: int) -> tuple[Tensor, Tensor]:
        """Uniformly sample up to ``fanout`` in-neighbours (without replacement; -1: all) of
        each owned node in ``nodes`` (unique global ids).

        Returns ``(counts, src)``: ``counts[i]`` = min(in-degree, fanout) and the sampled
        sources (global ids) of ``nodes[i]`` concatenated in the order of ``nodes``.
        """
        local = self._local(nodes)
        if local.numel() == 0:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        sg = self.dgl.sampling.sample_neighbors(self.graph, {"dst": local}, fanout)
        src, dst = sg.edges()
        # Positions of each edge's destination within ``nodes`` (nodes are unique).
        order = torch.argsort(local)
        pos = order[torch.searchsorted(local[order], dst)]
        counts = torch.bincount(pos, minlength=local.numel())
        perm = torch.argsort(pos, stable=True)
        return counts, src[perm]

    def gather(self, nodes: Tensor, with_feat: bool, with_label: bool) -> tuple[Tensor, Tensor]:
        """Features and labels of owned nodes (empty tensors where not asked for)."""
        local = self._local(nodes)
        feat = (self.feat.index_select(0, local) if with_feat
                else torch.empty((0, self.feat.shape[1]), dtype=self.feat.dtype))
        label = self.label.index_select(0, local) if with_label else torch.empty(0, dtype=torch.int64)
        return feat, label

    def seeds(self, split: str) -> Tensor:
        return _as_tensor(np.ascontiguousarray(getattr(self.part, split)))
