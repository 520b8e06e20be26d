"""On-disk layout of a partition set, and the one reader/writer for it.

A partition set is a directory::

    OUT/
      metadata.json          versioned description (see PartitionSetMeta), with ``set_id``: a
                             fresh random id per written set, so servers, trainers and peers can
                             tell two sets at the same path apart
      orig_to_new.npy        int64 [N]   original dataset node id -> global node id
      hot_rank.npy           int64 [N]   (optional) rank of each node within its part by how often
                                         pre-sampled mini-batches used it (0 = hottest); a
                                         trainer with cache ratio r caches the nodes with
                                         rank < floor(r * part size), servers skip sending them;
                                         a typed set ranks featureless types' nodes last
      part-0/
        indptr.npy           int64 [n_0 + 1]  CSC over the part's owned nodes: the in-edges of
                                              owned node i (local id) are indices[indptr[i]:indptr[i+1]]
        indices.npy          int64 [e_0]      global id of each in-edge's source node (any part)
        feat.npy             float32/float16/bfloat16-as-uint16 [n_0, D]  features of owned nodes
        label.npy            int64 [n_0]      class of each owned node, -1 where unlabeled
        orig_ids.npy         int64 [n_0]      original dataset id of each owned node
        train.npy            int64 [t_0]      global ids of the part's training seeds (sorted)
        valid.npy, test.npy  int64            same, for validation / test seeds
        halo_nodes.npy       int64 [h_0]      (only when halo_hops > 0) sorted global ids of the
                                              other parts' nodes within halo_hops in-hops of
                                              this part's nodes
        halo_indptr.npy      int64 [h_0 + 1]  CSC of ALL in-edges of each halo node ...
        halo_indices.npy     int64            ... as global source ids
        halo_feat.npy        [h_0, D]         features of the halo nodes
        halo_label.npy       int64 [h_0]      labels of the halo nodes
        etype.npy            int16 [e_0]      (typed graphs only) relation id (position in
                                              metadata etypes) of each in-edge, aligned with
                                              indices.npy; each node's in-edge segment is
                                              sorted by relation, then by source id
        halo_etype.npy       int16            (typed, with a halo) the same for halo_indices
      part-1/ ...
      node_type.npy          int8 [N]    (typed graphs only) node type (position in metadata
                                         ntypes) of each GLOBAL id

Typed (heterogeneous) graphs are the homogeneous layout plus the type arrays above (DistDGL's
approach): original ids put each type's nodes contiguously (types in ``ntypes`` order), and
the relabel keeps the types in that order within a part, so a part's nodes are grouped by type
(each type's by out-degree with ``--node-order degree``, the default). Features:
one matrix, real rows for the types in ``feat_ntypes``, zeros for the others; labels -1
outside ``predict_ntype``; the splits hold ``predict_ntype`` nodes only.

What a halo buys: a part always stores every in-edge of its own nodes, so the first hop from
its own seeds is sampled locally whatever the halo. With ``halo_hops = k`` it also holds the
complete in-edge lists and features of the nodes within k hops, so hops 2..k+1 and the
features of those frontiers need no server-to-server request when they stay inside the halo.
Sampling stays exact (a halo node's in-edges are all present), at the price of storing them.

Invariants (checked by tests/test_partition.py):

* Global ids are a contiguous relabel (within a part in the set's node order,
  ``stats.node_order``: by out-degree, highest first, or by original id; see
  :func:`partition.partitioner.node_order_keys`): part p owns exactly the global ids
  ``node_offsets[p] <= gid < node_offsets[p + 1]``; local id = ``gid - node_offsets[p]``.
  The owner of any node is therefore ``searchsorted(node_offsets, gid, side="right") - 1``.
* Every directed edge (u -> v) of the graph is stored exactly once, in the part that owns v.
  Undirected datasets are stored with both directions.
* Seeds (train/valid/test) are stored in the part that owns them.

All arrays are plain ``.npy`` files so that servers open them with ``mmap_mode="r"``: a part
is read from the page cache, once per node, however many processes load it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common.errors import MfgServeError

FORMAT_NAME = "mfgserve-partitions"
FORMAT_VERSION = 2  # 2: metadata.json carries set_id
METADATA_FILE = "metadata.json"
HOT_RANK_FILE = "hot_rank.npy"
NODE_TYPE_FILE = "node_type.npy"
PART_ARRAYS = ("indptr", "indices", "feat", "label", "orig_ids", "train", "valid", "test")
HALO_ARRAYS = ("halo_nodes", "halo_indptr", "halo_indices", "halo_feat", "halo_label")
TYPED_ARRAYS = ("etype", "halo_etype")  # written when given (typed graphs)
SPLITS = ("train", "valid", "test")
FEAT_DTYPES = ("float32", "float16", "bfloat16")


class PartitionFormatError(MfgServeError, ValueError):
    """A partition directory is missing, incomplete, corrupt, or of another format version."""


@dataclass
class PartInfo:
    """Sizes of one part, as recorded in metadata.json."""

    id: int
    dir: str
    num_nodes: int
    num_edges: int
    num_train: int = 0
    num_valid: int = 0
    num_test: int = 0
    num_halo_nodes: int = 0
    num_halo_edges: int = 0


@dataclass
class PartitionSetMeta:
    """Contents of metadata.json. Counts are in nodes / directed edges.

    ``set_id`` identifies one written partition set: :func:`new_set_id` makes a fresh one each
    time a set is written (rewriting the same path gives a new id), and :meth:`load` refuses a
    set without one. Read it as ``PartitionSetMeta.load(root).set_id`` or
    ``load_partition(root, p).meta.set_id``.
    """

    dataset: str
    num_parts: int
    num_nodes: int
    num_edges: int
    feat_dim: int
    num_classes: int
    node_offsets: list[int]
    parts: list[PartInfo]
    feat_dtype: str = "float32"
    method: str = "metis"
    halo_hops: int = 0
    edge_cut: int = 0
    seed: int = 0
    set_id: str = ""
    stats: dict = field(default_factory=dict)
    # The task, as ogb's meta_dict names it: "multiclass" (label.npy int64 [n], a class or -1)
    # or "binary" (multi-label: label.npy float32 [n, num_tasks], 0 / 1, NaN where unknown);
    # eval_metric is ogb's "eval metric" ("acc", "rocauc"), the metric the trainer reports.
    task_type: str = "multiclass"
    num_tasks: int = 1
    eval_metric: str = "acc"
    # Typed (heterogeneous) graphs; ntypes empty: homogeneous. Global ids stay one contiguous
    # range per part; node_type.npy (set level, int8 [N]) gives each global id's type
    # (position in ntypes). etypes: canonical [src type, relation, dst type], relation id =
    # position; each part's etype.npy gives each stored in-edge's relation. predict_ntype:
    # the type with labels and splits; feat_ntypes: the types whose feature rows are real
    # (read or derived); the others' rows are zeros (use learnable embeddings for them).
    ntypes: list[str] = field(default_factory=list)
    etypes: list[list[str]] = field(default_factory=list)
    predict_ntype: str = ""
    feat_ntypes: list[str] = field(default_factory=list)
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def owner_of(self, gids: np.ndarray) -> np.ndarray:
        """Part id owning each global node id."""
        return np.searchsorted(np.asarray(self.node_offsets), gids, side="right") - 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, root: str | os.PathLike) -> PartitionSetMeta:
        root = Path(root)
        path = root / METADATA_FILE
        if not root.is_dir():
            raise PartitionFormatError(
                f"partition directory {root} does not exist; create it with "
                f"`partition-ogbn --dataset-dir DIR --num-parts N --out {root}`"
            )
        if not path.is_file():
            raise PartitionFormatError(
                f"{root} has no {METADATA_FILE}: it is not a partition set; create one with "
                f"`partition-ogbn --dataset-dir DIR --num-parts N --out {root}`"
            )
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PartitionFormatError(f"cannot read {path}: {e}; re-run partition-ogbn") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise PartitionFormatError(
                f"{path} is not an mfgserve partition set (format={raw.get('format')!r} "
                f"if a dict); expected format {FORMAT_NAME!r}"
            )
        if raw.get("version") != FORMAT_VERSION:
            raise PartitionFormatError(
                f"{path} has layout version {raw.get('version')}, this mfgserve reads version "
                f"{FORMAT_VERSION}; re-partition with this version of partition-ogbn"
            )
        try:
            raw["parts"] = [PartInfo(**p) for p in raw["parts"]]
            meta = cls(**raw)
        except (TypeError, KeyError) as e:
            raise PartitionFormatError(f"{path} is malformed: {e}; re-run partition-ogbn") from e
        if len(meta.node_offsets) != meta.num_parts + 1 or len(meta.parts) != meta.num_parts:
            raise PartitionFormatError(
                f"{path}: node_offsets/parts do not match num_parts={meta.num_parts}"
            )
        if not isinstance(meta.set_id, str) or not meta.set_id:
            raise PartitionFormatError(
                f"{path} has no set_id (every version-{FORMAT_VERSION} set has one); it was not "
                "written by partition-ogbn: re-run partition-ogbn to rewrite the set"
            )
        meta._check_types(path)
        return meta

    @property
    def is_typed(self) -> bool:
        return bool(self.ntypes)

    def _check_types(self, path: Path) -> None:
        """ntypes / etypes / predict_ntype / feat_ntypes agree with each other."""
        if not self.ntypes:
            if self.etypes or self.predict_ntype or self.feat_ntypes:
                raise PartitionFormatError(f"{path}: etypes / predict_ntype / feat_ntypes are "
                                           "set but ntypes is empty; re-run partition-ogbn")
            return
        known = set(self.ntypes)
        bad = [t for t in self.etypes if len(t) != 3 or t[0] not in known or t[2] not in known]
        if (bad or not self.etypes or self.predict_ntype not in known
                or not set(self.feat_ntypes) <= known or len(self.ntypes) > 127):
            raise PartitionFormatError(
                f"{path}: inconsistent typed-graph metadata (ntypes {self.ntypes}, etypes "
                f"{self.etypes}, predict_ntype {self.predict_ntype!r}, feat_ntypes "
                f"{self.feat_ntypes}); re-run partition-ogbn")


def new_set_id() -> str:
    """A fresh partition-set id (32 hex digits), made each time a set is written."""
    return uuid.uuid4().hex


@dataclass
class Partition:
    """One part's arrays, memory-mapped read-only (see module docstring for meanings)."""

    meta: PartitionSetMeta
    part_id: int
    indptr: np.ndarray
    indices: np.ndarray
    feat: np.ndarray
    label: np.ndarray
    orig_ids: np.ndarray
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    halo_nodes: np.ndarray | None = None
    halo_indptr: np.ndarray | None = None
    halo_indices: np.ndarray | None = None
    halo_feat: np.ndarray | None = None
    halo_label: np.ndarray | None = None
    etype: np.ndarray | None = None  # typed graphs: relation id of each in-edge (indices)
    halo_etype: np.ndarray | None = None  # typed graphs with a halo: same for halo_indices

    @property
    def node_start(self) -> int:
        return self.meta.node_offsets[self.part_id]

    @property
    def num_nodes(self) -> int:
        return self.meta.parts[self.part_id].num_nodes


def _load_array(path: Path, root: str | os.PathLike, mmap: bool) -> np.ndarray:
    """``np.load`` one array of a set; a missing, truncated or garbled file is a
    PartitionFormatError naming the file."""
    if not path.is_file():
        raise PartitionFormatError(
            f"{path} is missing: the partition set {root} is incomplete; re-run partition-ogbn "
            "(with --force) to rewrite it"
        )
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        if not isinstance(arr, np.ndarray):
            raise ValueError("not a single .npy array")
    except Exception as e:  # numpy raises ValueError / OSError / EOFError / zip errors
        raise PartitionFormatError(
            f"{path} is corrupt or truncated ({e}); re-run partition-ogbn (with --force) to "
            f"rewrite the partition set {root}"
        ) from e
    return arr


def _expected_shapes(meta: PartitionSetMeta, info: PartInfo) -> dict[str, tuple[int, ...]]:
    n, h, d = info.num_nodes, info.num_halo_nodes, meta.feat_dim
    lab: tuple[int, ...] = () if meta.task_type == "multiclass" else (meta.num_tasks,)
    shapes = {"indptr": (n + 1,), "indices": (info.num_edges,), "feat": (n, d),
              "label": (n, *lab),
              "orig_ids": (n,), "train": (info.num_train,), "valid": (info.num_valid,),
              "test": (info.num_test,)}
    if meta.halo_hops > 0:
        shapes.update(halo_nodes=(h,), halo_indptr=(h + 1,),
                      halo_indices=(info.num_halo_edges,), halo_feat=(h, d),
                      halo_label=(h, *lab))
    if meta.ntypes:
        shapes["etype"] = (info.num_edges,)
        if meta.halo_hops > 0:
            shapes["halo_etype"] = (info.num_halo_edges,)
    return shapes


def _check_csc(indptr: np.ndarray, num_edges: int, path: Path) -> None:
    if indptr.shape[0] and (int(indptr[0]) != 0 or int(indptr[-1]) != num_edges):
        raise PartitionFormatError(
            f"{path} spans edges [{int(indptr[0])}, {int(indptr[-1])}) but the part stores "
            f"{num_edges}; the set is inconsistent: re-run partition-ogbn (with --force)"
        )


def load_partition(root: str | os.PathLike, part_id: int, mmap: bool = True) -> Partition:
    """Open part ``part_id`` of the set at ``root``; arrays are mmaps unless ``mmap=False``.

    Raises :class:`PartitionFormatError` naming the file when an array is missing, corrupt,
    truncated, or of a shape that disagrees with metadata.json (header-only checks, plus the
    two ends of each ``indptr``)."""
    meta = PartitionSetMeta.load(root)
    if not 0 <= part_id < meta.num_parts:
        raise PartitionFormatError(
            f"part {part_id} does not exist in {root}: it has parts 0..{meta.num_parts - 1}; "
            "change --part-id"
        )
    info = meta.parts[part_id]
    pdir = Path(root) / info.dir
    arrays = {}
    for name, shape in _expected_shapes(meta, info).items():
        f = pdir / f"{name}.npy"
        arrays[name] = _load_array(f, root, mmap)
        if arrays[name].shape != shape:
            raise PartitionFormatError(
                f"{f} has shape {arrays[name].shape} but metadata.json says {shape} "
                f"(part {part_id}: {info.num_nodes} nodes, {info.num_edges} edges); the set is "
                "inconsistent: re-run partition-ogbn (with --force) to rewrite it"
            )
    _check_csc(arrays["indptr"], info.num_edges, pdir / "indptr.npy")
    for name in ("etype", "halo_etype"):
        if name in arrays and arrays[name].dtype != np.int16:
            raise PartitionFormatError(
                f"{pdir / (name + '.npy')} has dtype {arrays[name].dtype}, expected int16; "
                "re-run partition-ogbn (with --force) to rewrite the set")
    if meta.halo_hops > 0:
        _check_csc(arrays["halo_indptr"], info.num_halo_edges, pdir / "halo_indptr.npy")
    return Partition(meta=meta, part_id=part_id, **arrays)


def load_hot_rank(root: str | os.PathLike) -> np.ndarray | None:
    """The set's hot_rank.npy (mmap), or None if it was written without pre-sampling."""
    path = Path(root) / HOT_RANK_FILE
    if not path.is_file():
        return None
    rank = _load_array(path, root, mmap=True)
    n = PartitionSetMeta.load(root).num_nodes
    if rank.shape != (n,):
        raise PartitionFormatError(
            f"{path} has shape {rank.shape} but the set has {n} nodes; re-run partition-ogbn "
            "(with --force) to rewrite it"
        )
    return rank


def load_node_type(root: str | os.PathLike) -> np.ndarray | None:
    """The set's node_type.npy (int8 [N], mmap) for a typed set, None for a homogeneous one."""
    meta = PartitionSetMeta.load(root)
    if not meta.ntypes:
        return None
    path = Path(root) / NODE_TYPE_FILE
    arr = _load_array(path, root, mmap=True)
    if arr.shape != (meta.num_nodes,) or arr.dtype != np.int8:
        raise PartitionFormatError(
            f"{path} has shape {arr.shape} and dtype {arr.dtype} but the set has "
            f"{meta.num_nodes} nodes (expected int8 [{meta.num_nodes}]); re-run partition-ogbn "
            "(with --force) to rewrite it")
    return arr


def cached_mask(rank: np.ndarray, gids: np.ndarray, node_offsets: list[int],
                cache_ratio: float) -> np.ndarray:
    """Which of ``gids`` a trainer with ``cache_ratio`` caches: rank < floor(ratio * size)."""
    offsets = np.asarray(node_offsets)
    owner = np.searchsorted(offsets, gids, side="right") - 1
    limit = np.floor(cache_ratio * np.diff(offsets)).astype(np.int64)
    return rank[gids] < limit[owner]


def write_part(root: str | os.PathLike, part_id: int, arrays: dict[str, np.ndarray]) -> PartInfo:
    """Write one part's arrays (all of PART_ARRAYS, plus HALO_ARRAYS when any is given, plus
    the TYPED_ARRAYS given) under ``root/part-{part_id}``."""
    names = PART_ARRAYS + (HALO_ARRAYS if any(k in arrays for k in HALO_ARRAYS) else ())
    names += tuple(k for k in TYPED_ARRAYS if k in arrays)
    missing = set(names) - set(arrays)
    if missing:
        raise ValueError(f"write_part: missing arrays {sorted(missing)}")
    pdir = Path(root) / f"part-{part_id}"
    pdir.mkdir(parents=True, exist_ok=True)
    for name in names:
        save_array(pdir / f"{name}.npy", arrays[name])
    n = int(arrays["indptr"].shape[0] - 1)
    return PartInfo(
        id=part_id,
        dir=pdir.name,
        num_nodes=n,
        num_edges=int(arrays["indices"].shape[0]),
        num_train=int(arrays["train"].shape[0]),
        num_valid=int(arrays["valid"].shape[0]),
        num_test=int(arrays["test"].shape[0]),
        num_halo_nodes=int(arrays["halo_nodes"].shape[0]) if "halo_nodes" in arrays else 0,
        num_halo_edges=int(arrays["halo_indices"].shape[0]) if "halo_indices" in arrays else 0,
    )


def save_array(path: Path, arr: np.ndarray) -> None:
    """``np.save`` that names the file in its OSError (numpy's own says only "N requested and
    M written" when the disk fills up)."""
    arr = np.ascontiguousarray(arr)
    try:
        np.save(path, arr)
    except OSError as e:
        code, reason = e.errno, e.strerror
        if code is None:
            try:
                full = shutil.disk_usage(path.parent).free < arr.nbytes + 4096
            except OSError:
                full = False
            code = errno.ENOSPC if full else errno.EIO
            reason = os.strerror(code) if full else str(e)
        raise OSError(code, reason, str(path)) from e


def write_metadata(root: str | os.PathLike, meta: PartitionSetMeta) -> None:
    """Write metadata.json last and atomically: a set without it is never mistaken for complete.

    ``meta.set_id`` must be set (a fresh :func:`new_set_id` for every written set)."""
    if not meta.set_id:
        raise ValueError("write_metadata: meta.set_id is empty; set it to new_set_id()")
    path = Path(root) / METADATA_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(meta.to_json())
    os.replace(tmp, path)
