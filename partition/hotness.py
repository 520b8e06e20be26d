"""Pre-sampled node hotness: the order in which trainers fill their feature caches.

:func:`presample_hotness` samples mini-batches of training seeds over the relabelled graph
(the sorted edge keys ``new_dst * n + new_src`` of :mod:`partition.partitioner`) and counts
how often each node is an input node; :func:`rank_within_parts` turns the counts into each
node's rank within its part (``hot_rank.npy``, see :mod:`partition.layout`).
"""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

__all__ = ["presample_hotness", "rank_within_parts"]


def presample_hotness(keys: np.ndarray, n: int, train: np.ndarray, batches: int,
                      fanouts: tuple[int, ...], batch_size: int, seed: int,
                      progress: bool, stride: int | None = None) -> np.ndarray:
    """How often each node (new id) is an input node of sampled mini-batches of ``train``.

    ``stride``: the destination's multiplier in the keys (``n``, the default; ``n * R`` for
    a typed graph, whose relations are ignored here: it is sampled as homogeneous)."""
    import torch

    from common.dgl_compat import import_dgl

    dgl = import_dgl()
    indptr = np.searchsorted(keys, np.arange(n + 1, dtype=np.int64) * (stride or n),
                             side="left")
    g = dgl.graph(("csc", (torch.from_numpy(indptr), torch.from_numpy(np.remainder(keys, n)),
                           torch.empty(0, dtype=torch.int64))), num_nodes=n)
    sampler = dgl.dataloading.NeighborSampler(list(fanouts))
    rng = np.random.default_rng(seed)
    counts = np.zeros(n, dtype=np.int64)
    dgl.seed(seed)
    for _ in tqdm(range(batches), desc="pre-sample hot nodes", file=sys.stderr,
                  disable=not progress):
        seeds = rng.choice(train, size=min(batch_size, train.size), replace=False)
        input_nodes, _, _ = sampler.sample(g, torch.from_numpy(seeds))
        counts[input_nodes.numpy()] += 1
    return counts


def rank_within_parts(hot: np.ndarray, offsets: np.ndarray,
                      last: np.ndarray | None = None) -> np.ndarray:
    """rank[gid] = position of gid in its part when sorted by hotness (desc), ties by id;
    nodes where ``last`` is True (a typed set's featureless types, whose feature rows are
    zeros that no cache needs) rank after every other node of their part."""
    rank = np.empty(hot.size, dtype=np.int64)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        if last is None:
            order = np.argsort(-hot[lo:hi], kind="stable")
        else:  # lexsort is stable: ties stay in id order
            order = np.lexsort((-hot[lo:hi], last[lo:hi]))
        rank[lo + order] = np.arange(hi - lo)
    return rank
