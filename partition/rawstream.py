"""Stream an OGB node-property dataset from its raw files, chunk by chunk.

:func:`partition.ogbn.load_ogb` lets ogb read a dataset whole (ogbn-papers100M: 57 GB of
features, 26 GB of edges, before any copy); a bounded-memory partitioner cannot. This
module reads the same raw files -- after the same ``meta.json`` and layout checks
(:func:`partition.ogbn._dir_source` / ``_named_source``, so a bad directory fails with the
same :class:`DatasetError`) -- and hands them out in chunks:

* **binary layout** (``meta.json`` ``binary`` "True", what ogbn-papers100M ships):
  ``raw/data.npz`` (``edge_index [2, E]``, ``node_feat [N, F]``, ``num_nodes_list``,
  ``num_edges_list``) and ``raw/node-label.npz`` (``node_label [N, 1]``, float with NaN
  for unlabelled nodes) through :mod:`partition.npzio`: a stored member is read at its
  offset in the file, a deflated one inflated in order; ``edge_index`` rows 0 and 1 are
  read by two readers side by side.
* **csv layout**: ``raw/edge.csv.gz``, ``raw/node-feat.csv.gz``, ``raw/node-label.csv.gz``
  (+ ``num-node-list`` / ``num-edge-list``), parsed by pandas with ``chunksize``.

What comes out equals what :func:`~partition.ogbn.load_ogb` builds (the tests compare them):
edges as DIRECTED ``(src, dst)`` int64 chunks -- every stored edge, and when the meta says
``add_inverse_edge`` also its inverse right after it (``(u, v), (v, u)``, ogb's order; a
self loop then appears twice, as ogb does it), or with ``add_reverse_edges=True`` (a
directed dataset such as ogbn-papers100M made bidirected) each non-self-loop edge's
reverse appended to its chunk; features in node order in the stored dtype (float16 stays
float16; csv and other dtypes become float32), a non-finite value rejected with its row;
labels as int64 with ``-1`` for NaN (unlabelled); the train / valid / test ids.
Memory: one chunk at a time, plus whatever the caller keeps; nothing here is O(edges).
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from partition.graph_data import DatasetError
from partition.npzio import NpyMemberReader

__all__ = ["open_raw", "RawSource", "DEFAULT_EDGE_ROWS", "DEFAULT_NODE_ROWS"]

DEFAULT_EDGE_ROWS = 1 << 22  # stored edges per chunk (64 MiB of int64 src + dst)
DEFAULT_NODE_ROWS = 1 << 16  # feature / label rows per chunk

# what pandas / gzip / zlib raise on an unreadable, truncated or malformed csv.gz
_CSV_ERRORS = (ValueError, OSError, EOFError, zlib.error, UnicodeDecodeError)


def open_raw(dataset_dir: str | None = None, name: str | None = None,
             root: str | None = None) -> RawSource:
    """A :class:`RawSource` over ``dataset_dir`` (a directory in OGB raw layout with
    ``meta.json``) or the ogb dataset ``name`` under ``root`` (default ``./data/ogb``;
    downloaded when its raw files are missing, as :func:`partition.ogbn.load_ogb` does).
    Give exactly one of the two. The directory is checked as ``load_ogb`` checks it (meta
    keys, supported task, raw files, npz member headers, split files); nothing large is
    read here."""
    from partition.ogbn import _dir_source, _named_source

    if (name is None) == (dataset_dir is None):
        raise DatasetError("give exactly one of name (an ogbn-* dataset) or dataset_dir")
    if dataset_dir is not None:
        src, meta, ds_name, where, _ = _dir_source(dataset_dir, None)
    else:
        assert name is not None
        src, meta, ds_name, where, _ = _named_source(name, root, None)
    return RawSource(src, meta, ds_name, where)


def _pd():
    import pandas as pd

    return pd


def _read_count(path: Path, what: str, where: str) -> int:
    """The single integer of ``num-node-list.csv.gz`` / ``num-edge-list.csv.gz``."""
    try:
        vals = _pd().read_csv(path, compression="gzip", header=None).to_numpy().reshape(-1)
        vals = vals.astype(np.int64)
    except _CSV_ERRORS as e:
        raise DatasetError(f"{where}: cannot read {path} ({type(e).__name__}: {e}); it must "
                           f"be a gzip CSV holding the {what} (one line)") from e
    if vals.shape != (1,):
        raise DatasetError(f"{where}: {path} lists {vals.size} graphs; a node-property "
                           f"dataset has exactly one (one line: its {what})")
    return int(vals[0])


def _csv_width(path: Path, where: str) -> int:
    try:
        with gzip.open(path, "rt") as f:
            first = f.readline()
    except _CSV_ERRORS as e:
        raise DatasetError(f"{where}: cannot read {path} ({type(e).__name__}: {e}); "
                           "re-download or rewrite it") from e
    if not first.strip():
        raise DatasetError(f"{where}: {path} is empty; it must hold one line of features per "
                           "node")
    return first.count(",") + 1


class RawSource:
    """Chunked access to one dataset in OGB raw layout (see the module docstring); made by
    :func:`open_raw`. Attributes: ``name``, ``num_nodes``, ``num_stored_edges`` (edges in
    the files), ``feat_dim``, ``feat_dtype`` (``np.float16`` or ``np.float32``),
    ``num_classes``, ``add_inverse_edge`` (meta), ``binary`` (layout), ``where`` (for
    messages), ``feat_source`` (the features' file), ``src`` (the directory), ``meta``.
    Every method opens its files afresh, so iterators may be run again (one per pass) and
    a RawSource holds no open file between calls."""

    def __init__(self, src: Path, meta: dict, name: str, where: str):
        self.src = Path(src)
        self.meta = meta
        self.name = name
        self.where = where
        self.binary = meta.get("binary") == "True"
        self.add_inverse_edge = meta["add_inverse_edge"] == "True"
        self.num_classes = int(meta["num classes"])
        self._split_dir = self.src / "split" / str(meta["split"])
        self._directed: dict[bool, int] = {}
        self._splits: dict[str, np.ndarray] | None = None
        raw = self.src / "raw"
        if self.binary:
            self.data_npz = raw / "data.npz"
            self.label_npz = raw / "node-label.npz"
            with np.load(self.data_npz) as z:  # the two one-element members only
                self.num_nodes = int(np.asarray(z["num_nodes_list"]).reshape(-1)[0])
            with NpyMemberReader(self.data_npz, "edge_index") as r:
                self.num_stored_edges = int(r.shape[1])
            with NpyMemberReader(self.data_npz, "node_feat") as r:
                fshape, fdtype = r.shape, r.dtype
            with NpyMemberReader(self.label_npz, "node_label") as r:
                lshape = r.shape
            if len(lshape) == 2 and lshape[1] != 1 or len(lshape) > 2:
                raise DatasetError(f"{where}: {self.label_npz} node_label has shape {lshape}, "
                                   f"expected ({self.num_nodes}, 1)")
            self.feat_dim = int(fshape[1]) if len(fshape) == 2 else 1
            self._stored_feat_dtype = fdtype
            self.feat_dtype = np.dtype(np.float16 if fdtype == np.float16 else np.float32)
            self.feat_source = str(self.data_npz)
        else:
            self.edge_csv = raw / "edge.csv.gz"
            self.feat_csv = raw / "node-feat.csv.gz"
            self.label_csv = raw / "node-label.csv.gz"
            self.num_nodes = _read_count(raw / "num-node-list.csv.gz", "number of nodes", where)
            self.num_stored_edges = _read_count(raw / "num-edge-list.csv.gz", "number of edges",
                                                where)
            self.feat_dim = _csv_width(self.feat_csv, where)
            self._stored_feat_dtype = np.dtype(np.float32)
            self.feat_dtype = np.dtype(np.float32)
            self.feat_source = str(self.feat_csv)
        if self.num_nodes < 1:
            raise DatasetError(f"{where} has {self.num_nodes} nodes; a graph needs at least one")

    def __repr__(self) -> str:
        return (f"RawSource({self.name!r}, {'binary' if self.binary else 'csv'}, "
                f"nodes={self.num_nodes}, stored_edges={self.num_stored_edges}, "
                f"feat={self.feat_dim}x{self.feat_dtype}, where={self.where!r})")

    # -- csv helper -------------------------------------------------------------------------
    def _csv_chunks(self, path: Path, rows: int, dtype, expect_rows: int, width: int,
                    what: str) -> Iterator[np.ndarray]:
        """``[r, width]`` blocks of ``path``, exactly ``expect_rows`` rows in all."""
        pd = _pd()
        seen = 0
        try:
            reader = pd.read_csv(path, compression="gzip", header=None, dtype=dtype,
                                 chunksize=max(1, int(rows)))
            with reader:
                for df in reader:
                    block = df.to_numpy(dtype=dtype)
                    if block.shape[1] != width:
                        raise DatasetError(f"{self.where}: {path} has {block.shape[1]} columns "
                                           f"(from line {seen + 1}); {what} need {width}")
                    if seen + block.shape[0] > expect_rows:
                        raise DatasetError(f"{self.where}: {path} has more than {expect_rows} "
                                           f"lines, but the dataset has {expect_rows} {what}; "
                                           "fix the file or num-node-list / num-edge-list")
                    seen += block.shape[0]
                    yield block
        except DatasetError:
            raise
        except _CSV_ERRORS as e:
            raise DatasetError(f"{self.where}: cannot read {path} near line {seen + 1} "
                               f"({type(e).__name__}: {e}); it must be a gzip CSV of {width} "
                               f"numeric column(s) per line: re-download or rewrite it") from e
        if seen != expect_rows:
            raise DatasetError(f"{self.where}: {path} has {seen} lines but the dataset has "
                               f"{expect_rows} {what}; the file is truncated or the counts "
                               "(num-node-list / num-edge-list) are wrong")

    # -- edges ------------------------------------------------------------------------------
    def _stored_edge_chunks(self, rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(src, dst)`` int64 chunks of the edges as stored (no inverses), range-checked."""
        n = self.num_nodes
        start = 0
        if self.binary:
            with NpyMemberReader(self.data_npz, "edge_index") as r0, \
                    NpyMemberReader(self.data_npz, "edge_index") as r1:
                pairs = zip(r0.iter_row_slices(0, rows), r1.iter_row_slices(1, rows))
                for s, d in pairs:
                    s, d = s.astype(np.int64, copy=False), d.astype(np.int64, copy=False)
                    self._check_ids(s, d, start, n, self.data_npz)
                    start += s.shape[0]
                    yield s, d
        else:
            for block in self._csv_chunks(self.edge_csv, rows, np.int64,
                                          self.num_stored_edges, 2, "edges"):
                s, d = np.ascontiguousarray(block[:, 0]), np.ascontiguousarray(block[:, 1])
                self._check_ids(s, d, start, n, self.edge_csv)
                start += s.shape[0]
                yield s, d

    def _check_ids(self, s, d, start: int, n: int, path) -> None:
        if not s.shape[0]:
            return
        bad = (s < 0) | (s >= n) | (d < 0) | (d >= n)
        if bad.any():
            i = int(np.argmax(bad))
            raise DatasetError(f"{self.where}: edge {start + i} ({s[i]} -> {d[i]}) in {path} "
                               f"has an endpoint outside [0, {n}) (the dataset has {n} nodes); "
                               "fix the edge list or the node count")

    def edge_chunks(self, rows: int = DEFAULT_EDGE_ROWS, add_reverse_edges: bool = False
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(src, dst)`` int64 arrays of DIRECTED edges, ``rows`` stored edges per chunk
        (up to twice as many directed ones with inverses). With ``add_inverse_edge`` in the
        meta each stored edge ``(u, v)`` is followed by ``(v, u)`` (self loops too, as ogb
        does); else with ``add_reverse_edges`` the chunk's non-self-loop edges reversed are
        appended to it. The multiset of edges equals ``load_ogb(...,
        add_reverse_edges=...)``'s; with ``add_inverse_edge`` so does the order."""
        for s, d in self._stored_edge_chunks(rows):
            if self.add_inverse_edge:
                k = s.shape[0]
                src = np.empty(2 * k, dtype=np.int64)
                dst = np.empty(2 * k, dtype=np.int64)
                src[0::2], src[1::2] = s, d
                dst[0::2], dst[1::2] = d, s
                yield src, dst
            elif add_reverse_edges:
                keep = s != d  # a self loop is its own reverse
                yield np.concatenate([s, d[keep]]), np.concatenate([d, s[keep]])
            else:
                yield s, d

    def num_directed_edges(self, add_reverse_edges: bool = False) -> int:
        """Edges :meth:`edge_chunks` yields in all (one counting pass over the edges for
        ``add_reverse_edges`` on a directed dataset, for its self loops; cached)."""
        if self.add_inverse_edge:
            return 2 * self.num_stored_edges
        if not add_reverse_edges:
            return self.num_stored_edges
        if True not in self._directed:
            loops = sum(int(np.count_nonzero(s == d)) for s, d in self._stored_edge_chunks(
                DEFAULT_EDGE_ROWS))
            self._directed[True] = 2 * self.num_stored_edges - loops
        return self._directed[True]

    # -- nodes ------------------------------------------------------------------------------
    def feat_chunks(self, rows: int = DEFAULT_NODE_ROWS) -> Iterator[np.ndarray]:
        """Consecutive ``[r, feat_dim]`` blocks of node features in node order, dtype
        :attr:`feat_dtype`. A NaN / inf raises :class:`DatasetError` naming the node."""
        start = 0
        for block in self._raw_feat_chunks(rows):
            block = block.reshape(block.shape[0], -1)
            if block.dtype != self.feat_dtype:
                block = block.astype(self.feat_dtype)
            self._check_finite(block, start)
            start += block.shape[0]
            yield block

    def _raw_feat_chunks(self, rows: int) -> Iterator[np.ndarray]:
        if self.binary:
            with NpyMemberReader(self.data_npz, "node_feat") as r:
                yield from r.iter_rows(rows)
        else:
            yield from self._csv_chunks(self.feat_csv, rows, np.float64, self.num_nodes,
                                        self.feat_dim, "nodes")

    def _check_finite(self, block: np.ndarray, start: int) -> None:
        ok = np.isfinite(block)
        if ok.all():
            return
        r, c = (int(x) for x in np.argwhere(~ok)[0])
        row = start + r
        raise DatasetError(
            f"{self.feat_source}: row {row} (node {row}, counting from 0) holds a non-finite "
            f"feature value ({block[r, c]} in column {c}); node features must be finite "
            "numbers: fix that row (and any later ones) in the source, e.g. replace NaN / inf "
            "by 0, then re-run")

    def label_chunks(self, rows: int = DEFAULT_NODE_ROWS) -> Iterator[np.ndarray]:
        """Consecutive int64 label blocks in node order, ``-1`` where the label is NaN
        (unlabelled); a label outside ``[-1, num_classes)`` raises :class:`DatasetError`."""
        start = 0
        if self.binary:
            with NpyMemberReader(self.label_npz, "node_label") as r:
                if r.shape[0] != self.num_nodes:
                    raise DatasetError(f"{self.where}: {self.label_npz} node_label has "
                                       f"shape {r.shape}, expected ({self.num_nodes}, 1)")
                for block in r.iter_rows(rows):
                    yield self._labels(block.reshape(-1), start, self.label_npz)
                    start += block.shape[0]
        else:
            for block in self._csv_chunks(self.label_csv, rows, np.float64, self.num_nodes, 1,
                                          "nodes"):
                yield self._labels(block.reshape(-1), start, self.label_csv)
                start += block.shape[0]

    def _labels(self, lab: np.ndarray, start: int, path) -> np.ndarray:
        if lab.dtype.kind == "f":
            out = np.full(lab.shape[0], -1, dtype=np.int64)
            ok = ~np.isnan(lab)
            out[ok] = lab[ok].astype(np.int64)
        else:
            out = lab.astype(np.int64)
        bad = (out < -1) | (out >= self.num_classes)
        if bad.any():
            i = int(np.argmax(bad))
            raise DatasetError(f"{self.where}: {path} gives node {start + i} the label "
                               f"{lab[i]}, outside [0, {self.num_classes}) (num classes in "
                               "meta.json; NaN marks an unlabelled node): fix the label or "
                               "'num classes'")
        return out

    def labels(self) -> np.ndarray:
        """All labels, int64 ``[num_nodes]`` (8 bytes per node)."""
        out = np.empty(self.num_nodes, dtype=np.int64)
        pos = 0
        for block in self.label_chunks():
            out[pos: pos + block.shape[0]] = block
            pos += block.shape[0]
        return out

    # -- splits -----------------------------------------------------------------------------
    def splits(self) -> dict[str, np.ndarray]:
        """``{"train", "valid", "test"}``: int64 node ids as the split files list them
        (read once, cached), each checked to be in range and free of duplicates."""
        if self._splits is None:
            self._splits = self._read_splits()
        return dict(self._splits)

    def _read_splits(self) -> dict[str, np.ndarray]:
        d = self._split_dir
        out: dict[str, np.ndarray] = {}
        if (d / "split_dict.pt").is_file():  # ogb's own short cut takes precedence
            import torch

            try:
                sd = torch.load(d / "split_dict.pt", weights_only=True)
                for s in ("train", "valid", "test"):
                    ids = sd[s]
                    out[s] = np.asarray(ids.numpy() if hasattr(ids, "numpy") else ids,
                                        dtype=np.int64).reshape(-1)
            except (OSError, RuntimeError, KeyError, TypeError, ValueError) as e:
                raise DatasetError(f"{self.where}: cannot read {d / 'split_dict.pt'} ({e!r}); "
                                   "it must hold {'train','valid','test'} id tensors") from e
        else:
            pd = _pd()
            for s in ("train", "valid", "test"):
                path = d / f"{s}.csv.gz"
                try:
                    vals = pd.read_csv(path, compression="gzip", header=None).to_numpy()
                    out[s] = np.asarray(vals.T[0], dtype=np.int64).reshape(-1)
                except (*_CSV_ERRORS, IndexError, TypeError) as e:
                    raise DatasetError(f"{self.where}: cannot read the split file {path} "
                                       f"({type(e).__name__}: {e}); it must list integer node "
                                       "ids, one per line") from e
        n = self.num_nodes
        for s, ids in out.items():
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                raise DatasetError(f"{self.where}: the {s} split holds node ids in "
                                   f"[{ids.min()}, {ids.max()}], outside [0, {n}); fix "
                                   f"split/{self.meta['split']}/{s}")
            if np.unique(ids).size != ids.size:
                raise DatasetError(f"{self.where}: the {s} split lists some node more than "
                                   f"once; fix split/{self.meta['split']}/{s}")
        return out

    def train_mask(self) -> np.ndarray:
        """Boolean ``[num_nodes]`` mask of the training seeds."""
        mask = np.zeros(self.num_nodes, dtype=bool)
        mask[self.splits()["train"]] = True
        return mask

    # a RawSource holds no open file; the context manager is for symmetry with readers
    def close(self) -> None:
        pass

    def __enter__(self) -> RawSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
