"""Read an OGB heterogeneous node-property dataset (ogbn-mag's layout) into a typed
:class:`GraphData`, add reverse relations, derive features of featureless types.

The typed graph is the homogeneous graph plus type arrays (DistDGL's approach): node types
in ``ntypes`` order (ogb's, sorted by name), each type's ids contiguous, so the homogeneous
id of (type t, per-type id i) is ``offset[t] + i`` and ``node_type`` is non-decreasing;
``etypes`` are the canonical ``[src type, relation, dst type]`` triplets in ogb's (sorted)
order and ``edge_type`` gives each edge's position. The labelled type (paper for
ogbn-mag) is ``predict_ntype``: labels are -1 elsewhere and the splits hold homogeneous
ids of that type only. One feature matrix: the rows of types in ``feat_ntypes`` are real,
the others' are zeros.

Two ways in, like :mod:`partition.ogbn`: by name (``ogbn-mag``; downloaded into ``root``
when missing) or ``dataset_dir`` (a directory in OGB's heterogeneous raw layout with a
``meta.json``, see :mod:`partition.maggen`). Either way the files are checked first (a
missing one is a :class:`DatasetError` naming it), staged into a private working
directory and read by ogb's own ``NodePropPredDataset``.

``add_reverse_edges``: a relation whose source and destination types are equal (paper
cites paper) is symmetrised in place (its reverse edges get the same relation id, self
loops not doubled); any other relation ``(s, r, d)`` gets a new relation
``(d, "rev_" + r, s)`` appended after the originals.

``derive_features="mean"``: each featureless type gets, per node, the mean of its
neighbours' features through the first relation (in ``etypes`` order) that joins it to a
type that already has features (either direction); types are derived in rounds, so a type
joined only to derived types (ogbn-mag's institution, through author) is derived from
them in a later round. Nodes without such neighbours keep zeros. The relation used per
type is recorded in ``GraphData.feat_derived`` (and the partition metadata's stats).
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
import sys
from pathlib import Path

import numpy as np

from partition.graph_data import DatasetError, GraphData

__all__ = ["load_hetero", "is_hetero_source", "add_reverse_relations", "derive_mean_features",
           "DERIVE_CHOICES", "relation_name"]

DERIVE_CHOICES = ("none", "mean")


def relation_name(trip) -> str:
    """``src-rel-dst``, how messages and summaries name a relation."""
    return "-".join(str(x) for x in trip)


def is_hetero_source(name: str | None, dataset_dir: str | None) -> bool:
    """Whether the dataset named or in ``dataset_dir`` says ``is hetero`` True (False when
    that cannot be told: the homogeneous loader then reports the problem)."""
    from partition.ogbn import _ogb_master, _read_meta_json

    try:
        if dataset_dir:
            if not (Path(dataset_dir) / "meta.json").is_file():
                return False
            meta = _read_meta_json(Path(dataset_dir))
        elif name:
            meta = _ogb_master().get(name, {})
        else:
            return False
    except DatasetError:
        return False
    return str(meta.get("is hetero", "False")) == "True"


def _gz_header(path: Path, where: str) -> list[str]:
    try:
        with gzip.open(path, "rt") as f:
            return [h.strip() for h in f.readline().strip().split(",") if h.strip()]
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DatasetError(f"{where}: cannot read {path} ({e}); rewrite it as a gzip csv "
                           "with a header line of node types") from e


def _gz_rows(path: Path, where: str) -> list[list[str]]:
    try:
        with gzip.open(path, "rt") as f:
            return [[x.strip() for x in line.strip().split(",")] for line in f if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DatasetError(f"{where}: cannot read {path} ({e}); rewrite it") from e


_FIX = ("a heterogeneous OGB directory holds raw/num-node-dict.csv.gz, "
        "raw/triplet-type-list.csv.gz, raw/nodetype-has-label.csv.gz, "
        "raw/relations/<src>___<rel>___<dst>/{edge,num-edge-list}.csv.gz, "
        "raw/node-feat/<type>/node-feat.csv.gz, raw/node-label/<type>/node-label.csv.gz and "
        "split/<split>/{nodetype-has-split.csv.gz,<type>/{train,valid,test}.csv.gz} as "
        "ogbn-mag ships them; write one with `partition-ogbn --dataset synthetic-mag "
        "--raw-out DIR`")


def _check_layout(src: Path, meta: dict, where: str) -> None:
    """Every file ogb's heterogeneous reader needs, checked before ogb runs."""
    if meta.get("binary") == "True":
        raise DatasetError(f"{where}: meta.json says binary=True (raw/*.npz, as MAG240M-like "
                           "sets ship); partition-ogbn reads the csv heterogeneous layout "
                           "only: set binary to False and provide the csv.gz files. " + _FIX)
    raw = src / "raw"

    def need(p: Path, what: str) -> None:
        if not p.is_file():
            raise DatasetError(f"{where}: missing {p} ({what}); {_FIX}")

    need(raw / "num-node-dict.csv.gz", "the node count of each type")
    need(raw / "triplet-type-list.csv.gz", "the relations, one 'src,rel,dst' per line")
    need(raw / "nodetype-has-label.csv.gz", "which node types carry labels")
    ntypes = _gz_header(raw / "num-node-dict.csv.gz", where)
    if not ntypes:
        raise DatasetError(f"{where}: {raw / 'num-node-dict.csv.gz'} names no node types; "
                           + _FIX)
    for row in _gz_rows(raw / "triplet-type-list.csv.gz", where):
        if len(row) != 3 or row[0] not in ntypes or row[2] not in ntypes:
            raise DatasetError(f"{where}: {raw / 'triplet-type-list.csv.gz'} has the line "
                               f"{','.join(row)!r}; each line must be 'src,relation,dst' with "
                               f"src and dst among the node types {ntypes}")
        rdir = raw / "relations" / "___".join(row)
        need(rdir / "edge.csv.gz", f"the edges of relation {relation_name(row)}")
        need(rdir / "num-edge-list.csv.gz", f"the edge count of relation {relation_name(row)}")
    labelled = _flags(raw / "nodetype-has-label.csv.gz", where)
    if not labelled:
        raise DatasetError(f"{where}: {raw / 'nodetype-has-label.csv.gz'} marks no node type "
                           "as labelled; " + _FIX)
    for t in labelled:
        need(raw / "node-label" / t / "node-label.csv.gz", f"the labels of {t}")
    split = src / "split" / str(meta["split"])
    if (split / "split_dict.pt").is_file():
        return
    need(split / "nodetype-has-split.csv.gz",
         f"which node types have splits (meta.json says split={meta['split']!r})")
    for t in _flags(split / "nodetype-has-split.csv.gz", where):
        for s in ("train", "valid", "test"):
            need(split / t / f"{s}.csv.gz", f"the {s} {t} ids")


def _flags(path: Path, where: str) -> list[str]:
    rows = _gz_rows(path, where)
    if len(rows) < 2 or len(rows[0]) != len(rows[1]):
        raise DatasetError(f"{where}: {path} must hold a header of node types and one row of "
                           "True / False")
    return [t for t, v in zip(rows[0], rows[1]) if v.lower() in ("true", "1")]


def _source(name: str | None, root: str | None, dataset_dir: str | None,
            work_dir: str | None):
    from partition import ogbn

    if dataset_dir is not None:
        src = Path(dataset_dir)
        if not src.is_dir():
            raise DatasetError(f"dataset directory {src} does not exist; pass a directory in "
                               "OGB's heterogeneous raw layout. " + _FIX)
        meta = ogbn._read_meta_json(src)
        ds_name = str(meta.get("name") or src.resolve().name)
        where = f"dataset directory {src}"
        parent = work_dir
    else:
        assert name is not None
        master = ogbn._ogb_master()
        if name not in master:
            raise DatasetError(f"unknown OGB dataset {name!r}")
        meta, ds_name = master[name], name
        root_p = Path(root or ogbn.DEFAULT_ROOT)
        src = root_p / "_".join(name.split("-"))
        where = f"OGB dataset {name} in {src}"
        if not (src / "raw" / "triplet-type-list.csv.gz").is_file():
            with contextlib.redirect_stdout(sys.stderr):
                ogbn._download(name, meta, root_p, src)
        parent = work_dir if work_dir is not None else str(root_p)
    missing = [k for k in ogbn.META_KEYS if k not in meta]
    if missing:
        raise DatasetError(f"{where}: meta.json lacks the ogb meta_dict keys {missing}; add "
                           "them (ogbn-mag's row of ogb's nodeproppred/master.csv lists them)")
    if str(meta["num tasks"]) != "1" or "multiclass" not in str(meta["task type"]):
        raise DatasetError(f"{where} is a {meta['num tasks']}-task {meta['task type']!r} "
                           "heterogeneous dataset; typed graphs need single-task multiclass")
    _check_layout(src, meta, where)
    return src, meta, ds_name, where, parent


def load_hetero(name: str | None = None, root: str | None = None,
                dataset_dir: str | None = None, *, add_reverse_edges: bool = False,
                derive_features: str = "none", work_dir: str | None = None) -> GraphData:
    """Load a heterogeneous OGB node-property dataset as a typed :class:`GraphData` (see the
    module docstring). Raises :class:`DatasetError` naming the path and the fix."""
    if (name is None) == (dataset_dir is None):
        raise DatasetError("give exactly one of name (e.g. ogbn-mag) or dataset_dir")
    if derive_features not in DERIVE_CHOICES:
        raise DatasetError(f"derive_features={derive_features!r}; choose one of "
                           f"{', '.join(DERIVE_CHOICES)}")
    src, meta, ds_name, where, parent = _source(name, root, dataset_dir, work_dir)
    from ogb.nodeproppred import NodePropPredDataset

    from partition import ogbn

    work = ogbn._stage(src, meta, parent)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # ogb prints progress to stdout
            try:
                ds = NodePropPredDataset(name=ds_name, meta_dict={**meta, "dir_path": str(work)})
                graph, labels = ds[0]
                split = ds.get_idx_split()
            except (RuntimeError, ValueError, KeyError, OSError, AssertionError) as e:
                raise DatasetError(f"ogb could not read {where}: {e!r}; check its raw files. "
                                   + _FIX) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = _to_typed(graph, labels, split, ds_name, meta, where, str(src / "raw" / "node-feat"))
    if add_reverse_edges:
        add_reverse_relations(data)
    if derive_features == "mean":
        derive_mean_features(data)
    return data.validate()


def _to_typed(graph: dict, labels: dict, split: dict, name: str, meta: dict, where: str,
              feat_source: str) -> GraphData:
    counts = graph["num_nodes_dict"]
    ntypes = sorted(counts)
    if len(ntypes) > 127:
        raise DatasetError(f"{where} has {len(ntypes)} node types; at most 127 are supported")
    offset, total = {}, 0
    for t in ntypes:
        offset[t] = total
        total += int(counts[t])
    node_type = np.repeat(np.arange(len(ntypes), dtype=np.int8),
                          [int(counts[t]) for t in ntypes])
    etypes = sorted(graph["edge_index_dict"])
    src_l, dst_l, et_l = [], [], []
    for r, trip in enumerate(etypes):
        ei = np.asarray(graph["edge_index_dict"][trip], dtype=np.int64)
        s, _, d = trip
        src_l.append(ei[0] + offset[s])
        dst_l.append(ei[1] + offset[d])
        et_l.append(np.full(ei.shape[1], r, dtype=np.int16))
    feats = graph.get("node_feat_dict") or {}
    dims = {t: np.asarray(f).reshape(int(counts[t]), -1).shape[1] for t, f in feats.items()}
    if not dims:
        raise DatasetError(f"{where} has no node features for any type "
                           "(raw/node-feat/<type>/node-feat.csv.gz); mfgserve needs them")
    if len(set(dims.values())) > 1:
        raise DatasetError(f"{where}: the featured types have different feature sizes {dims}; "
                           "mfgserve stores one feature matrix: pad them to one size")
    d = next(iter(dims.values()))
    feat = np.zeros((total, d), dtype=np.float32)
    for t, f in feats.items():
        feat[offset[t]:offset[t] + int(counts[t])] = np.asarray(f, dtype=np.float32).reshape(
            int(counts[t]), d)
    if len(labels) != 1:
        raise DatasetError(f"{where} labels the node types {sorted(labels)}; typed graphs "
                           "need exactly one labelled (predicted) type")
    predict = next(iter(labels))
    lab = np.asarray(labels[predict])
    lab = lab.reshape(int(counts[predict]))
    label = np.full(total, -1, dtype=np.int64)
    if lab.dtype.kind == "f":
        ok = ~np.isnan(lab)
        label[offset[predict] + np.flatnonzero(ok)] = lab[ok].astype(np.int64)
    else:
        label[offset[predict]:offset[predict] + lab.size] = lab.astype(np.int64)
    splits = {}
    for s in ("train", "valid", "test"):
        per = split.get(s, {})
        if predict not in per:
            raise DatasetError(f"{where}: split/{meta['split']}/ has no {s} ids for the "
                               f"labelled type {predict}")
        ids = np.asarray(per[predict], dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= int(counts[predict])):
            raise DatasetError(f"{where}: the {s} split lists {predict} ids outside "
                               f"[0, {int(counts[predict])})")
        splits[s] = np.sort(ids + offset[predict])
    return GraphData(
        name=name, num_nodes=total, src=np.concatenate(src_l), dst=np.concatenate(dst_l),
        feat=feat, label=label, num_classes=int(meta["num classes"]),
        feat_source=feat_source, ntypes=list(ntypes), etypes=[list(t) for t in etypes],
        node_type=node_type, edge_type=np.concatenate(et_l), predict_ntype=predict,
        feat_ntypes=[t for t in ntypes if t in feats], **splits)


def add_reverse_relations(data: GraphData) -> GraphData:
    """Reverse relations in place (rule in the module docstring)."""
    src_l, dst_l, et_l = [data.src], [data.dst], [data.edge_type]
    etypes = [list(t) for t in data.etypes]
    for r, (s, rel, d) in enumerate(list(etypes)):
        sel = data.edge_type == r
        es, ed = data.src[sel], data.dst[sel]
        if s == d:
            keep = es != ed
            src_l.append(ed[keep])
            dst_l.append(es[keep])
            et_l.append(np.full(int(keep.sum()), r, dtype=np.int16))
        else:
            etypes.append([d, "rev_" + rel, s])
            src_l.append(ed)
            dst_l.append(es)
            et_l.append(np.full(es.size, len(etypes) - 1, dtype=np.int16))
    if len(etypes) > 32767:
        raise DatasetError(f"{data.name}: {len(etypes)} relations exceed int16")
    data.src, data.dst = np.concatenate(src_l), np.concatenate(dst_l)
    data.edge_type = np.concatenate(et_l)
    data.etypes = etypes
    return data


def _type_ranges(data: GraphData) -> dict[str, tuple[int, int]]:
    bounds = np.searchsorted(data.node_type, np.arange(len(data.ntypes) + 1), side="left")
    return {t: (int(bounds[i]), int(bounds[i + 1])) for i, t in enumerate(data.ntypes)}


def _mean_into(feat: np.ndarray, rows: np.ndarray, cols: np.ndarray, lo: int, hi: int) -> None:
    """feat[lo:hi] = per-node mean of feat[cols] over the pairs (row, col) (rows in
    [lo, hi)); nodes without pairs keep zeros."""
    import scipy.sparse as sp

    n_rows = hi - lo
    if rows.size == 0:
        return
    counts = np.bincount(rows - lo, minlength=n_rows).astype(np.float32)
    a = sp.csr_matrix((np.ones(rows.size, dtype=np.float32), (rows - lo, cols)),
                      shape=(n_rows, feat.shape[0]))
    out = np.asarray(a @ feat, dtype=np.float32)
    nz = counts > 0
    out[nz] /= counts[nz, None]
    feat[lo:hi] = out


def derive_mean_features(data: GraphData) -> GraphData:
    """``--derive-features mean`` in place (rule in the module docstring); records the
    relation used per type in ``data.feat_derived`` and lists every type in feat_ntypes."""
    ranges = _type_ranges(data)
    have = set(data.feat_ntypes)
    derived: dict[str, str] = {}
    while True:
        round_from = set(have)
        todo = [t for t in data.ntypes if t not in have]
        if not todo:
            break
        picks = {}
        for t in todo:
            for r, (s, _, d) in enumerate(data.etypes):
                if d == t and s in round_from:
                    picks[t] = (r, "in")
                    break
                if s == t and d in round_from:
                    picks[t] = (r, "out")
                    break
        if not picks:
            break  # the rest are not joined to any featured type: zeros
        for t, (r, way) in picks.items():
            sel = data.edge_type == r
            lo, hi = ranges[t]
            if way == "in":  # t is the destination: mean over its sources
                rows, cols = data.dst[sel], data.src[sel]
            else:
                rows, cols = data.src[sel], data.dst[sel]
            _mean_into(data.feat, rows, cols, lo, hi)
            derived[t] = relation_name(data.etypes[r])
        have |= set(picks)
    data.feat_derived = derived
    data.feat_ntypes = [t for t in data.ntypes if t in have]
    return data
