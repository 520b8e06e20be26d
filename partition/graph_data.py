"""In-memory homogeneous graph with node features, labels and a train/valid/test split.

:class:`GraphData` is what the loaders (:mod:`partition.ogbn`, :mod:`partition.synthetic`)
produce and what :func:`partition.partitioner.partition_graph` consumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.errors import MfgServeError

__all__ = ["GraphData", "DatasetError"]

_FINITE_CHUNK = 1 << 22  # feature values checked for NaN / inf per step


class DatasetError(MfgServeError, ValueError):
    """A dataset cannot be loaded or is inconsistent; the message says what to change."""


@dataclass
class GraphData:
    """A graph in original (dataset) node ids.

    Invariants (checked by :meth:`validate`):

    * ``src``, ``dst``: ``np.int64`` arrays of equal length E, one entry per DIRECTED edge
      ``src[i] -> dst[i]``, every id in ``[0, num_nodes)``. Undirected datasets hold both
      directions of every edge. Loaders that read an OGB ``add_inverse_edge`` dataset (and the
      synthetic generator) store an undirected edge ``{u, v}`` as the adjacent pair
      ``(u -> v)`` at an even index ``2k`` and ``(v -> u)`` at ``2k + 1`` (ogb's own order);
      :func:`partition.synthetic.write_ogb_raw` relies on that to write each edge once.
    * ``feat``: ``np.float32 [num_nodes, D]``, row i = features of node i, all finite (no NaN
      or inf; checked in chunks of rows, so the check needs no second copy of ``feat``).
      ``feat_source`` names where they were read from (a file), for error messages.
    * ``label``: ``np.int64 [num_nodes]``, class in ``[0, num_classes)``, ``-1`` where the
      node is unlabeled (NaN in the source). With ``task_type`` "binary" (multi-label, e.g.
      ogbn-proteins): ``np.float32 [num_nodes, num_tasks]``, each entry 0, 1 or NaN
      (unknown), and ``eval_metric`` "rocauc".
    * ``train``, ``valid``, ``test``: ``np.int64`` original node ids, each within
      ``[0, num_nodes)``, no duplicates within a split.
    * ``num_classes >= 1``.
    """

    name: str
    num_nodes: int
    src: np.ndarray
    dst: np.ndarray
    feat: np.ndarray
    label: np.ndarray
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    num_classes: int
    feat_source: str = ""
    # The task (ogb's meta_dict): "multiclass" (label int64 [N], class or -1) or "binary"
    # (multi-label: label float32 [N, num_tasks], 0 / 1, NaN where unknown); eval_metric is
    # ogb's "eval metric" ("acc", "rocauc").
    task_type: str = "multiclass"
    num_tasks: int = 1
    eval_metric: str = "acc"
    # Typed (heterogeneous) graphs; ntypes empty: homogeneous. Node ids are homogeneous: the
    # types in ntypes order, each type's ids contiguous (DGL's to_homogeneous order), so
    # node_type (int8 [N]) is non-decreasing. edge_type (int16 [E]) gives each edge's position
    # in etypes ([src type, relation, dst type]). predict_ntype: the type with labels and
    # splits; feat_ntypes: the types whose feature rows are real (read or derived).
    ntypes: list = None  # type: ignore[assignment]
    etypes: list = None  # type: ignore[assignment]
    node_type: np.ndarray | None = None
    edge_type: np.ndarray | None = None
    predict_ntype: str = ""
    feat_ntypes: list = None  # type: ignore[assignment]
    # --derive-features: featureless type -> the relation ("src-rel-dst") its rows were
    # derived through (partition.hetero.derive_mean_features); empty otherwise
    feat_derived: dict = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for attr in ("ntypes", "etypes", "feat_ntypes"):
            if getattr(self, attr) is None:
                setattr(self, attr, [])
        if self.feat_derived is None:
            self.feat_derived = {}

    @property
    def is_typed(self) -> bool:
        return bool(self.ntypes)

    @property
    def num_edges(self) -> int:
        """Number of directed edges."""
        return int(self.src.shape[0])

    @property
    def feat_dim(self) -> int:
        return int(self.feat.shape[1])

    def split(self, name: str) -> np.ndarray:
        """The ``train`` / ``valid`` / ``test`` node ids."""
        if name not in ("train", "valid", "test"):
            raise KeyError(f"unknown split {name!r}; expected train, valid or test")
        return getattr(self, name)

    def train_mask(self) -> np.ndarray:
        """Boolean ``[num_nodes]`` mask of the training seeds."""
        mask = np.zeros(self.num_nodes, dtype=bool)
        mask[self.train] = True
        return mask

    def is_interleaved_undirected(self) -> bool:
        """True when edges come in ``(u -> v), (v -> u)`` pairs at indices ``2k, 2k + 1``."""
        e = self.num_edges
        if e % 2:
            return False
        return bool(
            np.array_equal(self.src[1::2], self.dst[0::2])
            and np.array_equal(self.dst[1::2], self.src[0::2])
        )

    def validate(self) -> GraphData:
        """Check the invariants above; raise :class:`DatasetError` naming the broken one."""
        n = int(self.num_nodes)
        where = f"dataset {self.name!r}"
        if n < 1:
            raise DatasetError(f"{where} has {n} nodes; a graph needs at least one node")
        binary = self._check_task(where)
        for attr in ("src", "dst", *(() if binary else ("label",)), "train", "valid", "test"):
            arr = getattr(self, attr)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.int64 or arr.ndim != 1:
                raise DatasetError(f"{where}: {attr} must be a 1-D np.int64 array")
        if self.src.shape != self.dst.shape:
            raise DatasetError(
                f"{where}: src has {self.src.shape[0]} edges but dst has {self.dst.shape[0]}"
            )
        if self.num_edges:
            lo = min(int(self.src.min()), int(self.dst.min()))
            hi = max(int(self.src.max()), int(self.dst.max()))
            if lo < 0 or hi >= n:
                raise DatasetError(
                    f"{where}: edge endpoints span [{lo}, {hi}] but there are {n} nodes"
                )
        if not isinstance(self.feat, np.ndarray) or self.feat.dtype != np.float32:
            raise DatasetError(f"{where}: feat must be a np.float32 array")
        if self.feat.ndim != 2 or self.feat.shape[0] != n:
            raise DatasetError(f"{where}: feat has shape {self.feat.shape}, expected ({n}, D)")
        self._check_finite()
        if binary:
            self._check_multilabels(where)
        elif self.label.shape != (n,):
            raise DatasetError(f"{where}: label has shape {self.label.shape}, expected ({n},)")
        if self.num_classes < 1:
            raise DatasetError(f"{where}: num_classes={self.num_classes} must be >= 1")
        if n and not binary and (self.label.min() < -1
                                 or self.label.max() >= self.num_classes):
            raise DatasetError(
                f"{where}: labels span [{self.label.min()}, {self.label.max()}] but "
                f"num_classes={self.num_classes} (-1 marks unlabeled nodes)"
            )
        for s in ("train", "valid", "test"):
            ids = getattr(self, s)
            if ids.size and (ids.min() < 0 or ids.max() >= n):
                raise DatasetError(f"{where}: {s} split has node ids outside [0, {n})")
            if np.unique(ids).size != ids.size:
                raise DatasetError(f"{where}: {s} split lists some node more than once")
        if self.is_typed:
            self._validate_types(where)
        return self

    def _validate_types(self, where: str) -> None:
        """The typed-graph invariants (see the field comments above)."""
        n, nt, ne = int(self.num_nodes), len(self.ntypes), len(self.etypes)
        nty, ety = self.node_type, self.edge_type
        if not isinstance(nty, np.ndarray) or nty.dtype != np.int8 or nty.shape != (n,):
            raise DatasetError(f"{where}: node_type must be np.int8 [{n}]")
        if not isinstance(ety, np.ndarray) or ety.dtype != np.int16 or ety.shape != (
                self.num_edges,):
            raise DatasetError(f"{where}: edge_type must be np.int16 [{self.num_edges}]")
        if n and (nty.min() < 0 or nty.max() >= nt or np.any(np.diff(nty) < 0)):
            raise DatasetError(f"{where}: node_type must be non-decreasing within [0, {nt}) "
                               "(each type's ids contiguous, types in ntypes order)")
        if self.num_edges and (ety.min() < 0 or ety.max() >= ne):
            raise DatasetError(f"{where}: edge_type spans [{ety.min()}, {ety.max()}] but "
                               f"there are {ne} relations")
        index = {t: i for i, t in enumerate(self.ntypes)}
        bad = [t for t in self.etypes if len(t) != 3 or t[0] not in index or t[2] not in index]
        if bad:
            raise DatasetError(f"{where}: relations {bad} name node types outside {self.ntypes}")
        if self.num_edges:
            s_t = np.array([index[t[0]] for t in self.etypes], dtype=np.int8)
            d_t = np.array([index[t[2]] for t in self.etypes], dtype=np.int8)
            wrong = (nty[self.src] != s_t[ety]) | (nty[self.dst] != d_t[ety])
            if wrong.any():
                i = int(np.argmax(wrong))
                raise DatasetError(f"{where}: edge {i} ({self.src[i]} -> {self.dst[i]}) does "
                                   f"not join the types of its relation {self.etypes[ety[i]]}")
        if self.predict_ntype not in index:
            raise DatasetError(f"{where}: predict_ntype {self.predict_ntype!r} is not one of "
                               f"{self.ntypes}")
        if not set(self.feat_ntypes) <= set(index):
            raise DatasetError(f"{where}: feat_ntypes {self.feat_ntypes} not within "
                               f"{self.ntypes}")
        pt = index[self.predict_ntype]
        if np.any(self.label[nty != pt] != -1):
            raise DatasetError(f"{where}: only {self.predict_ntype} nodes may carry labels")
        for s in ("train", "valid", "test"):
            ids = getattr(self, s)
            if ids.size and np.any(nty[ids] != pt):
                raise DatasetError(f"{where}: the {s} split holds nodes that are not "
                                   f"{self.predict_ntype}")

    def _check_task(self, where: str) -> bool:
        """The task fields; True for a binary (multi-label) task."""
        if self.task_type not in ("multiclass", "binary"):
            raise DatasetError(f"{where}: task_type={self.task_type!r} must be 'multiclass' "
                               "or 'binary' (multi-label)")
        if self.task_type == "multiclass":
            if self.num_tasks != 1:
                raise DatasetError(f"{where}: a multiclass task has num_tasks=1, not "
                                   f"{self.num_tasks}")
            return False
        if int(self.num_tasks) < 1:
            raise DatasetError(f"{where}: num_tasks={self.num_tasks} must be >= 1")
        if self.eval_metric != "rocauc":
            raise DatasetError(f"{where}: a binary (multi-label) task is evaluated by "
                               f"'rocauc', not {self.eval_metric!r}")
        return True

    def _check_multilabels(self, where: str) -> None:
        """Binary task: label float32 [N, num_tasks], every entry 0, 1 or NaN (unknown)."""
        lab, n, t = self.label, int(self.num_nodes), int(self.num_tasks)
        if not isinstance(lab, np.ndarray) or lab.dtype != np.float32 or lab.shape != (n, t):
            raise DatasetError(
                f"{where}: a binary (multi-label) task needs label as np.float32 [{n}, {t}] "
                f"(num_nodes, num_tasks), got {getattr(lab, 'dtype', type(lab))} "
                f"{getattr(lab, 'shape', '')}")
        rows = max(1, _FINITE_CHUNK // max(1, t))
        for start in range(0, n, rows):
            block = lab[start:start + rows]
            bad = ~((block == 0) | (block == 1) | np.isnan(block))
            if bad.any():
                r, c = (int(x) for x in np.argwhere(bad)[0])
                raise DatasetError(f"{where}: label of node {start + r}, task {c} is "
                                   f"{block[r, c]}; binary labels are 0, 1 or NaN (unknown)")

    def _check_finite(self) -> None:
        """Raise DatasetError naming the source and the first row with a NaN or inf feature."""
        feat = self.feat
        rows = max(1, _FINITE_CHUNK // max(1, feat.shape[1]))
        for start in range(0, feat.shape[0], rows):
            ok = np.isfinite(feat[start : start + rows])
            if ok.all():
                continue
            r, c = (int(x) for x in np.argwhere(~ok)[0])
            row = start + r
            source = self.feat_source or f"the node features of dataset {self.name!r}"
            raise DatasetError(
                f"{source}: row {row} (node {row}, counting from 0) holds a non-finite feature "
                f"value ({feat[row, c]} in column {c}); node features must be finite numbers: "
                "fix that row (and any later ones) in the source, e.g. replace NaN / inf by 0, "
                "then re-run"
            )
