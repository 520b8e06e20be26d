"""Split a :class:`GraphData` into parts and write them in the layout of :mod:`partition.layout`.

Steps of :func:`partition_graph`:

1. **Assign** every node to a part: METIS (``dgl.metis_partition_assignment``, which
   symmetrises the graph, with the training seeds as a second balance constraint), or a random
   assignment that deals nodes round-robin from a shuffled order (training seeds and the
   rest separately, so both are balanced). One part skips both.
2. **Relabel**: new global ids are sorted by part; part p owns ``node_offsets[p] <= gid <
   node_offsets[p + 1]``. Within a part, ``node_order="degree"`` (the default) sorts them by
   out-degree, highest first (ties by original id; a typed graph's nodes stay grouped by type,
   each type's by degree), ``"id"`` by original id. See :func:`node_order_keys`.
3. **Write** each part with :func:`partition.layout.write_part`: the in-edges of its nodes
   in CSC (sources as new global ids, each node's in-edges sorted by source id), features,
   labels, original ids and seeds; then ``orig_to_new.npy``; then ``metadata.json`` last
   (:func:`partition.layout.write_metadata`) with the statistics below and a fresh
   ``set_id``. All of it goes into a temporary directory beside ``out`` that is renamed to
   ``out`` when complete (:mod:`partition.outdir`): a failed run leaves nothing behind.

``meta.stats`` holds: ``edge_cut`` / ``edge_cut_frac`` (directed edges whose endpoints lie in
different parts), ``node_balance`` / ``edge_balance`` / ``train_balance`` (max over mean of
the per-part counts; 1.0 is perfect), ``part_nodes`` / ``part_edges`` / ``part_train`` /
``part_edge_cut`` (per part), ``assign_s`` / ``relabel_s`` / ``write_s`` / ``elapsed_s``
(seconds) and ``peak_rss_bytes`` (peak resident memory of this process so far).

Typed graphs (``data.is_typed``, see :mod:`partition.hetero`): METIS balances every node
type and the training seeds (``balance_ntypes`` = node type * 2 + train mask, as DistDGL
does), random deals each (type, seed or not) group separately; the sort key carries the
relation, ``new_dst * (n * R) + etype * n + new_src`` (R relations), so each destination's
in-edges come out grouped by relation (then by source) and each part also gets
``etype.npy`` (and ``halo_etype.npy``); the set gets ``node_type.npy`` and the metadata
``ntypes`` / ``etypes`` / ``predict_ntype`` / ``feat_ntypes``. ``meta.stats`` adds
``part_ntype_nodes`` / ``ntype_balance`` (per type) and ``derived_features`` (type ->
relation its features were derived through). Homogeneous graphs: R = 1, the key is unchanged.

Memory: besides the input, one int64 sort key per edge (three while large key arrays are
sorted with ``torch.sort``, which returns indices too) plus one part's arrays at a time;
with METIS, DGL's symmetrised copy of the graph and METIS's own structures dominate.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from partition import layout
from partition.config import NODE_ORDERS
from partition.graph_data import GraphData
from partition.halo import halo_arrays
from partition.hotness import presample_hotness, rank_within_parts
from partition.layout import PartitionSetMeta
from partition.outdir import (
    PartitionError,
    clear_partition_set,
    is_partition_set,
    staged_out,
)

__all__ = [
    "partition_graph",
    "assign_parts",
    "PartitionError",
    "peak_rss_bytes",
    "is_partition_set",
    "clear_partition_set",
    "METHODS",
]

METHODS = ("metis", "random")
_CHUNK = 1 << 22
_TORCH_SORT_MIN = 1 << 24  # edges; below this numpy's sort is fast enough


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (bytes).

    On Linux this is ``VmHWM`` of /proc/self/status: the high-water mark of this process
    image alone. ``getrusage``'s ``ru_maxrss`` is not used there because Linux carries a
    parent's peak into a child across fork + exec, so a small partitioner started by a large
    process (a test runner, a benchmark driver) would report the parent's peak. Elsewhere
    ``ru_maxrss``; the current RSS where neither is known."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(kb) * (1 if sys.platform == "darwin" else 1024)
    except (ImportError, OSError):
        import psutil

        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))


def _metis_assign(data: GraphData, num_parts: int) -> np.ndarray:
    try:
        from common.dgl_compat import import_dgl

        dgl = import_dgl()
        import torch
    except ImportError as e:
        raise PartitionError(
            f"METIS partitioning needs DGL, which cannot be imported ({e}); install "
            "dgl==2.1.0, or choose --method random"
        ) from e
    # METIS runs on the symmetrised graph, which DGL builds; when the edges already come in
    # (u -> v), (v -> u) pairs, one edge per pair gives the same symmetric graph, faster.
    if data.is_interleaved_undirected():
        src, dst = np.ascontiguousarray(data.src[0::2]), np.ascontiguousarray(data.dst[0::2])
    else:
        src, dst = data.src, data.dst
    g = dgl.graph(
        (torch.from_numpy(src), torch.from_numpy(dst)),
        num_nodes=data.num_nodes,
        idtype=torch.int64,
    )
    del src, dst
    balance = data.train_mask().astype(np.int64)
    if data.is_typed:  # every (type, seed or not) group balanced, as DistDGL does
        balance += 2 * data.node_type.astype(np.int64)
    balance = torch.from_numpy(balance)
    if not hasattr(dgl, "metis_partition_assignment"):
        raise PartitionError(
            "this DGL has no metis_partition_assignment; install dgl==2.1.0, or choose "
            "--method random"
        )
    with contextlib.redirect_stdout(sys.stderr):  # DGL prints its timings to stdout
        try:
            assign = dgl.metis_partition_assignment(g, num_parts, balance_ntypes=balance)
        except Exception as e:  # DGLError from the C API
            raise PartitionError(
                f"METIS failed on {data.name} ({data.num_nodes} nodes, {data.num_edges} edges, "
                f"{num_parts} parts): {e}; try fewer parts or --method random"
            ) from e
    del g
    if assign is None:
        raise PartitionError(
            "METIS is unavailable: this DGL build returned no assignment (built without "
            "METIS). Install a DGL with METIS (the PyPI dgl==2.1.0 wheel has it), or choose "
            "--method random explicitly"
        )
    return assign.numpy().astype(np.int64, copy=False)


def _random_assign(data: GraphData, num_parts: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts = np.empty(data.num_nodes, dtype=np.int64)
    mask = data.train_mask()
    offset = 0
    if getattr(data, "is_typed", False):  # each (type, seed or not) group dealt evenly
        key = data.node_type.astype(np.int64) * 2 + (~mask)
        order = np.argsort(key, kind="stable")
        bounds = np.searchsorted(key[order], np.arange(int(key.max()) + 2))
        groups = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        groups = [np.flatnonzero(mask), np.flatnonzero(~mask)]
    for group in groups:
        group = rng.permutation(group)
        parts[group] = (np.arange(group.shape[0]) + offset) % num_parts
        offset += group.shape[0]  # continue the deal where the seeds stopped
    return parts


def assign_parts(
    data: GraphData, num_parts: int, method: str = "metis", seed: int = 0
) -> np.ndarray:
    """Part id (``int64 [num_nodes]``) of every node, by ``method`` (see module docstring)."""
    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if num_parts == 1:
        return np.zeros(data.num_nodes, dtype=np.int64)
    if method == "random":
        return _random_assign(data, num_parts, seed)
    return _metis_assign(data, num_parts)


def _sort_keys(keys: np.ndarray) -> np.ndarray:
    """Sort int64 keys; large arrays go through torch.sort, which uses every core."""
    if keys.shape[0] >= _TORCH_SORT_MIN:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            values, _ = torch.sort(torch.from_numpy(keys))
            del keys
            return values.numpy()
    keys.sort()
    return keys


def _balance(counts: np.ndarray) -> float:
    mean = float(np.mean(counts)) if counts.size else 0.0
    return float(np.max(counts) / mean) if mean > 0 else 1.0


def partition_graph(
    data: GraphData,
    num_parts: int,
    out: str | os.PathLike,
    method: str = "metis",
    seed: int = 0,
    progress: bool = True,
    *,
    overwrite: bool = False,
    halo_hops: int = 0,
    presample_batches: int = 16,
    presample_fanouts: tuple[int, ...] = (15, 10, 5),
    presample_batch_size: int = 1024,
    node_order: str = NODE_ORDERS[0],
) -> PartitionSetMeta:
    """Partition ``data`` into ``num_parts`` parts written under ``out``; return the metadata.

    ``halo_hops=k`` also stores, per part, the complete in-edge lists and features of the
    other parts' nodes within k in-hops of its own nodes (see partition.layout).
    ``presample_batches`` > 0 samples that many mini-batches of training seeds (with
    ``presample_fanouts``) and writes ``hot_rank.npy``: each node's rank within its part by
    how often it appeared as an input node, the order trainers fill their feature caches in
    (on a typed set, the nodes of featureless types rank after every featured node).
    ``node_order`` orders each part's nodes (:data:`NODE_ORDERS`, :func:`node_order_keys`).

    ``out`` must be empty or new; an existing partition set there is replaced only with
    ``overwrite=True``, and only when it holds nothing but the set's own files. The set is
    written beside ``out`` and renamed into place when complete (see :mod:`partition.outdir`);
    on failure nothing is left behind. Raises :class:`PartitionError` for bad arguments, an
    unusable ``out`` (an OSError while writing becomes one too), or METIS being unavailable
    (there is no silent fallback to ``random``).
    """
    t0 = time.perf_counter()
    if not isinstance(num_parts, (int, np.integer)) or num_parts < 1:
        raise PartitionError(f"num_parts={num_parts} must be a positive integer")
    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if not isinstance(halo_hops, (int, np.integer)) or not 0 <= halo_hops <= 3:
        raise PartitionError(f"halo_hops={halo_hops} must be 0, 1, 2 or 3")
    check_node_order(node_order)
    data.validate()
    n, num_parts = int(data.num_nodes), int(num_parts)
    if num_parts > n:
        raise PartitionError(f"num_parts={num_parts} exceeds the {n} nodes of {data.name}")
    if n * n * _num_rel(data) >= 2**63:
        raise PartitionError(f"{n} nodes, {_num_rel(data)} relation(s): edge sort keys "
                             "(dst * n * R + etype * n + src) would overflow int64")
    presample = (presample_batches, presample_fanouts, presample_batch_size)
    with staged_out(out, overwrite) as tmp:
        return _write_set(data, num_parts, tmp, Path(out), method, seed, progress, halo_hops,
                          presample, t0, node_order)


def _checked_assignment(data: GraphData, num_parts: int, method: str, seed: int) -> np.ndarray:
    """Step 1: :func:`assign_parts`, checked to give every node a part in range."""
    n = int(data.num_nodes)
    parts = assign_parts(data, num_parts, method, seed)
    if parts.shape != (n,) or (n and (parts.min() < 0 or parts.max() >= num_parts)):
        raise PartitionError(f"part assignment is malformed (range [{parts.min()}, {parts.max()}])")
    return parts


def check_node_order(node_order: str) -> None:
    """Refuse a ``node_order`` that is not one of :data:`NODE_ORDERS`, naming them."""
    if node_order not in NODE_ORDERS:
        raise PartitionError(f"node_order={node_order!r}: choose one of "
                             f"{', '.join(NODE_ORDERS)}")


def node_order_keys(node_order: str, out_degree: np.ndarray | None,
                    node_type: np.ndarray | None = None) -> list[np.ndarray]:
    """The keys that order a part's nodes, least significant first (``np.lexsort``'s order,
    the part being the most significant and the original id, through the stable sort, the
    last tie-break): none for ``"id"``; for ``"degree"`` the negated out-degree, then the
    node type on a typed graph (so a part's nodes stay grouped by type). An int64
    ``out_degree`` is negated in place (no copy of a per-node array).

    Why by out-degree: a node is sampled as a source about as often as it has out-edges, so
    on a graph with skewed degrees (RMAT, power-law social and web graphs) a few nodes are in
    most mini-batches. With them first, their CSC segments, feature rows and the samplers'
    per-node state share pages and cache lines; on the benchmarks' RMAT graph (random ids)
    a server delivered about 10 % more seeds per CPU-second (7-17 % over four alternated
    pairs; docs/benchmarks.md, session 60)."""
    check_node_order(node_order)
    if node_order == "id":
        return []
    if out_degree is None:
        raise PartitionError("node_order='degree' needs the out-degrees")
    deg = np.asarray(out_degree, dtype=np.int64)
    keys = [np.negative(deg, out=deg)]  # in place: an int64 out_degree is consumed
    if node_type is not None:
        keys.append(np.asarray(node_type))
    return keys


def _relabel_nodes(parts: np.ndarray, num_parts: int, n: int,
                   order_keys: list[np.ndarray] | None = None):
    """Step 2, nodes: (new_to_orig, orig_to_new, part_nodes, offsets); new ids are sorted by
    part, then by ``order_keys`` (:func:`node_order_keys`), then by original id."""
    if order_keys:
        new_to_orig = np.lexsort((*order_keys, parts)).astype(np.int64, copy=False)
    else:
        new_to_orig = np.argsort(parts, kind="stable").astype(np.int64, copy=False)
    orig_to_new = np.empty(n, dtype=np.int64)
    orig_to_new[new_to_orig] = np.arange(n, dtype=np.int64)
    part_nodes = np.bincount(parts, minlength=num_parts).astype(np.int64)
    offsets = np.zeros(num_parts + 1, dtype=np.int64)
    np.cumsum(part_nodes, out=offsets[1:])
    return new_to_orig, orig_to_new, part_nodes, offsets


def _num_rel(data: GraphData) -> int:
    """R: relations of a typed graph (1 for a homogeneous one)."""
    return max(1, len(data.etypes)) if data.is_typed else 1


def _edge_keys(data: GraphData, orig_to_new: np.ndarray, n: int, progress: bool) -> np.ndarray:
    """Step 2, edges: keys new_dst * n * R + etype * n + new_src (R = 1, no etype term, for a
    homogeneous graph), sorted (CSC order, in-edges grouped by relation, then by source)."""
    stride = n * _num_rel(data)
    e = data.num_edges
    keys = np.empty(e, dtype=np.int64)
    bar = tqdm(
        total=e,
        desc="relabel edges",
        unit="edge",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
    )
    for s in range(0, e, _CHUNK):
        sl = slice(s, min(e, s + _CHUNK))
        np.multiply(orig_to_new[data.dst[sl]], stride, out=keys[sl])
        keys[sl] += orig_to_new[data.src[sl]]
        if data.is_typed:
            keys[sl] += data.edge_type[sl].astype(np.int64) * n
        bar.update(sl.stop - sl.start)
    bar.close()
    return _sort_keys(keys)


def _part_arrays(data: GraphData, keys: np.ndarray, n: int, lo_n: int, hi_n: int,
                 new_to_orig: np.ndarray, splits_new: dict[str, np.ndarray]):
    """(arrays, edge cut) of the part owning new ids [lo_n, hi_n), halo excluded."""
    r = _num_rel(data)
    bounds = np.searchsorted(keys, np.arange(lo_n, hi_n + 1, dtype=np.int64) * (n * r),
                             side="left")
    lo_e, hi_e = int(bounds[0]), int(bounds[-1])
    indptr = bounds - lo_e
    indices = np.empty(hi_e - lo_e, dtype=np.int64)
    cut = 0
    for s in range(lo_e, hi_e, _CHUNK):
        chunk = np.remainder(keys[s : min(hi_e, s + _CHUNK)], n)
        indices[s - lo_e : s - lo_e + chunk.shape[0]] = chunk
        cut += int(np.count_nonzero((chunk < lo_n) | (chunk >= hi_n)))
    orig_ids = new_to_orig[lo_n:hi_n]
    typed = {}
    if data.is_typed:
        typed["etype"] = ((keys[lo_e:hi_e] // n) % r).astype(np.int16)
    arrays = {
        "indptr": indptr,
        "indices": indices,
        "feat": data.feat[orig_ids],
        "label": data.label[orig_ids],
        "orig_ids": orig_ids,
        **typed,
    }
    for s in layout.SPLITS:
        ids = splits_new[s]
        a, b = np.searchsorted(ids, [lo_n, hi_n])
        arrays[s] = ids[a:b]
    return arrays, cut


def _write_parts(out: Path, shown: Path, data: GraphData, keys: np.ndarray,
                 offsets: np.ndarray, new_to_orig: np.ndarray,
                 splits_new: dict[str, np.ndarray], halo_hops: int, progress: bool):
    """Step 3, parts: write every part; return (part infos, per-part edge cut)."""
    n, num_parts = int(data.num_nodes), int(offsets.shape[0]) - 1
    r = _num_rel(data)
    g_indptr = (np.searchsorted(keys, np.arange(n + 1, dtype=np.int64) * (n * r), side="left")
                if halo_hops else None)
    infos, part_cut = [], []
    for p in tqdm(
        range(num_parts), desc=f"write parts to {shown}", file=sys.stderr, disable=not progress
    ):
        lo_n, hi_n = int(offsets[p]), int(offsets[p + 1])
        arrays, cut = _part_arrays(data, keys, n, lo_n, hi_n, new_to_orig, splits_new)
        if halo_hops:
            arrays.update(halo_arrays(keys, g_indptr, n, lo_n, hi_n, halo_hops, data,
                                      new_to_orig, num_etypes=r if data.is_typed else 0))
        infos.append(layout.write_part(out, p, arrays))
        part_cut.append(cut)
        del arrays
    return infos, part_cut


def _hotness(keys: np.ndarray, n: int, train: np.ndarray, presample: tuple, seed: int,
             progress: bool, stride: int | None = None) -> np.ndarray | None:
    """Pre-sampled hotness counts, or None when ``presample`` asks for no batches or there
    are no training seeds (a typed graph sampled as homogeneous: ``stride`` = n * R)."""
    presample_batches, presample_fanouts, presample_batch_size = presample
    if presample_batches > 0 and train.size:
        return presample_hotness(keys, n, train, presample_batches, presample_fanouts,
                                 presample_batch_size, seed, progress, stride=stride)
    return None


def _stats(e: int, part_nodes: np.ndarray, infos: list, part_cut: list[int],
           times: tuple[float, float, float, float]) -> dict:
    """``meta.stats`` (see the module docstring); ``times`` = (t0, assign, relabel, write)."""
    t0, t_assign, t_relabel, t_write = times
    part_edges = np.array([i.num_edges for i in infos], dtype=np.int64)
    part_train = np.array([i.num_train for i in infos], dtype=np.int64)
    edge_cut = int(sum(part_cut))
    return {
        "edge_cut": edge_cut,
        "edge_cut_frac": edge_cut / e if e else 0.0,
        "node_balance": _balance(part_nodes),
        "edge_balance": _balance(part_edges),
        "train_balance": _balance(part_train),
        "part_nodes": part_nodes.tolist(),
        "part_edges": part_edges.tolist(),
        "part_train": part_train.tolist(),
        "part_edge_cut": part_cut,
        "part_halo_nodes": [i.num_halo_nodes for i in infos],
        "part_halo_edges": [i.num_halo_edges for i in infos],
        "assign_s": round(t_assign - t0, 3),
        "relabel_s": round(t_relabel - t_assign, 3),
        "write_s": round(t_write - t_relabel, 3),
        "elapsed_s": round(time.perf_counter() - t0, 3),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def _type_stats(data: GraphData, new_to_orig: np.ndarray, offsets: np.ndarray) -> dict:
    """Per-type node counts per part and their balance; relation sizes; derived features."""
    nt = len(data.ntypes)
    per = [np.bincount(data.node_type[new_to_orig[lo:hi]].astype(np.int64), minlength=nt)
           for lo, hi in zip(offsets[:-1], offsets[1:])]
    counts = np.array(per, dtype=np.int64).reshape(-1, nt)
    rel = np.bincount(data.edge_type.astype(np.int64), minlength=len(data.etypes))
    return {
        "part_ntype_nodes": {t: counts[:, i].tolist() for i, t in enumerate(data.ntypes)},
        "ntype_balance": {t: _balance(counts[:, i]) for i, t in enumerate(data.ntypes)},
        "relation_edges": {"-".join(t): int(rel[i]) for i, t in enumerate(data.etypes)},
        "derived_features": dict(data.feat_derived),
    }


def _write_set(data: GraphData, num_parts: int, out: Path, shown: Path, method: str, seed: int,
               progress: bool, halo_hops: int, presample: tuple, t0: float,
               node_order: str = NODE_ORDERS[0]) -> PartitionSetMeta:
    """Steps 1-3 of the module docstring, into the (new, empty) directory ``out``; ``shown``
    is the ``out`` the user asked for, ``presample`` (batches, fanouts, batch size)."""
    n, e = int(data.num_nodes), data.num_edges
    parts = _checked_assignment(data, num_parts, method, seed)  # 1. assignment
    t_assign = time.perf_counter()
    degree = np.bincount(data.src, minlength=n) if node_order == "degree" else None
    order = node_order_keys(node_order, degree, data.node_type if data.is_typed else None)
    del degree
    new_to_orig, orig_to_new, part_nodes, offsets = _relabel_nodes(parts, num_parts, n,
                                                                   order)  # 2.
    del parts, order
    keys = _edge_keys(data, orig_to_new, n, progress)
    t_relabel = time.perf_counter()
    splits_new = {s: np.sort(orig_to_new[data.split(s)]) for s in layout.SPLITS}  # 3. write
    infos, part_cut = _write_parts(out, shown, data, keys, offsets, new_to_orig, splits_new,
                                   halo_hops, progress)
    hot = _hotness(keys, n, splits_new["train"], presample, seed, progress,
                   stride=n * _num_rel(data))
    del keys
    layout.save_array(out / "orig_to_new.npy", orig_to_new)
    last = None
    if data.is_typed:
        node_type = data.node_type[new_to_orig]
        layout.save_array(out / layout.NODE_TYPE_FILE, node_type)
        featureless = [i for i, t in enumerate(data.ntypes) if t not in set(data.feat_ntypes)]
        last = np.isin(node_type, featureless) if featureless else None
    if hot is not None:  # featureless types last: a feature cache holds real rows first
        layout.save_array(out / layout.HOT_RANK_FILE, rank_within_parts(hot, offsets, last))
    t_write = time.perf_counter()
    stats = _stats(e, part_nodes, infos, part_cut, (t0, t_assign, t_relabel, t_write))
    stats["node_order"] = node_order
    if data.is_typed:
        stats.update(_type_stats(data, new_to_orig, offsets))
    meta = PartitionSetMeta(
        dataset=data.name,
        num_parts=num_parts,
        num_nodes=n,
        num_edges=e,
        feat_dim=data.feat_dim,
        num_classes=int(data.num_classes),
        node_offsets=offsets.tolist(),
        parts=infos,
        feat_dtype="float32",
        method=method,
        halo_hops=int(halo_hops),
        edge_cut=stats["edge_cut"],
        seed=int(seed),
        set_id=layout.new_set_id(),
        stats=stats,
        task_type=data.task_type,
        num_tasks=int(data.num_tasks),
        eval_metric=data.eval_metric,
    )
    if data.is_typed:
        meta.ntypes = list(data.ntypes)
        meta.etypes = [list(t) for t in data.etypes]
        meta.predict_ntype = data.predict_ntype
        meta.feat_ntypes = list(data.feat_ntypes)
    layout.write_metadata(out, meta)
    return meta
