"""Halo arrays of a part: the other parts' nodes within k in-hops, with their in-edges.

Both helpers work on the sorted edge keys ``new_dst * n + new_src`` of
:mod:`partition.partitioner` and ``g_indptr``, the CSC row pointer over all nodes
(``searchsorted(keys, arange(n + 1) * n)``). Typed graphs key their edges
``new_dst * n * R + etype * n + new_src`` (R relations, ``g_indptr`` then
``searchsorted(keys, arange(n + 1) * n * R)``): the source is still ``key % n`` and the
relation ``key // n % R`` (``halo_etype``).
"""

from __future__ import annotations

import numpy as np

from partition.graph_data import GraphData

__all__ = ["in_neighbours", "halo_arrays"]


def in_neighbours(keys: np.ndarray, g_indptr: np.ndarray, n: int,
                  nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, sources) of the in-edges of ``nodes`` (new ids), from the sorted edge keys."""
    starts, ends = g_indptr[nodes], g_indptr[nodes + 1]
    counts = ends - starts
    indptr = np.zeros(nodes.size + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    pos = np.repeat(starts - indptr[:-1], counts) + np.arange(indptr[-1], dtype=np.int64)
    return indptr, np.remainder(keys[pos], n)


def halo_arrays(keys: np.ndarray, g_indptr: np.ndarray, n: int, lo: int, hi: int, hops: int,
                data: GraphData, new_to_orig: np.ndarray,
                num_etypes: int = 0) -> dict[str, np.ndarray]:
    """The halo of part [lo, hi): other parts' nodes within ``hops`` in-hops, with all their
    in-edges, features and labels (and, with ``num_etypes`` R > 0, a typed graph's
    ``halo_etype``: each halo in-edge's relation)."""
    frontier = np.arange(lo, hi, dtype=np.int64)
    halo = np.empty(0, dtype=np.int64)
    for _ in range(hops):
        _, nbrs = in_neighbours(keys, g_indptr, n, frontier)
        nbrs = np.unique(nbrs)
        nbrs = nbrs[(nbrs < lo) | (nbrs >= hi)]
        frontier = np.setdiff1d(nbrs, halo, assume_unique=True)
        halo = np.union1d(halo, frontier)
    indptr, indices = in_neighbours(keys, g_indptr, n, halo)
    orig = new_to_orig[halo]
    out = {"halo_nodes": halo, "halo_indptr": indptr, "halo_indices": indices,
           "halo_feat": data.feat[orig], "halo_label": data.label[orig]}
    if num_etypes:
        starts = g_indptr[halo]
        pos = np.repeat(starts - indptr[:-1], np.diff(indptr)) + np.arange(indptr[-1],
                                                                          dtype=np.int64)
        out["halo_etype"] = ((keys[pos] // n) % num_etypes).astype(np.int16)
    return out
