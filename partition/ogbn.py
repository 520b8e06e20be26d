"""Load an OGB node-property dataset (by name, or any directory in OGB's raw layout).

Two ways in, one loader (ogb's :class:`NodePropPredDataset`) underneath:

* ``load_ogb(name="ogbn-arxiv", root="./data/ogb")``: the dataset lives in
  ``root/ogbn_arxiv`` (ogb's own download layout). When its raw files are missing it is
  downloaded from ogb's URL (no interactive prompt); offline, unzip it there yourself.
* ``load_ogb(dataset_dir="../shared/datasets/cora")``: a directory with ``raw/``,
  ``split/<split>/``, ``RELEASE_v1.txt`` and a ``meta.json`` holding ogb's ``meta_dict``
  fields (see ``docs/partitions.md``).

Either way the raw files are staged into a private, writable working directory
(per-file symlinks, copies where links are impossible) and ogb processes them there: ogb
writes a ``processed/`` cache next to ``raw/``, the source may be read-only, and a stale
cache written by an older torch would not load under ``torch.load(weights_only=True)``.
The working directory is removed afterwards.

Tasks: single-task multiclass datasets (labels int64, -1 unlabelled) and binary
classification with any number of tasks (multi-label, e.g. ogbn-proteins: labels float32
``[N, num tasks]``, NaN unknown; the set's metric is ogb's ``rocauc``). Heterogeneous
datasets are not read here (partition/hetero.py). A dataset without node features but with
edge features (ogbn-proteins: ``has_node_attr`` False, ``raw/edge-feat.csv.gz``) gets node
features from them (``edge_feat_to_node``: per node the mean or sum of its incoming edges'
features; with ogb's inverse edges that is every incident edge). ``node_species``, an
additional node file of ogbn-proteins, is read by ogb as shipped (``raw/species.csv.gz`` in the
zip is renamed by ogb, in the private working copy) and by default used only through the
``species`` split files; ``node_species="onehot"`` appends it to the features as a one-hot.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np

from partition.graph_data import DatasetError, GraphData

__all__ = ["load_ogb", "DatasetError", "META_KEYS", "DEFAULT_ROOT", "reduce_edge_feat", "is_multilabel",
           "dataset_meta", "EDGE_FEAT_TO_NODE", "NODE_SPECIES"]

DEFAULT_ROOT = "./data/ogb"

# Keys NodePropPredDataset reads from meta_dict (ogb/nodeproppred/dataset.py), besides
# dir_path which the loader sets, and url which it only reads when downloading.
META_KEYS = (
    "num tasks",
    "num classes",
    "eval metric",
    "task type",
    "download_name",
    "version",
    "add_inverse_edge",
    "split",
    "additional node files",
    "additional edge files",
    "is hetero",
    "binary",
)


def _ogb_master() -> dict[str, dict]:
    """ogb's table of known node-property datasets, read without importing torch."""
    import csv
    import importlib.util

    spec = importlib.util.find_spec("ogb")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("the ogb package is not installed; pip install ogb")
    path = Path(next(iter(spec.submodule_search_locations))) / "nodeproppred" / "master.csv"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    names = rows[0][1:]
    return {name: {row[0]: row[i + 1] for row in rows[1:]} for i, name in enumerate(names)}


def _meta_str(v) -> str:
    """ogb compares meta_dict values with strings ("True", "1"); accept JSON bools / numbers."""
    return str(v) if not isinstance(v, str) else v


def _required_raw_files(meta: dict) -> list[str]:
    """The raw files ogb reads for ``meta``: node features unless ``has_node_attr`` is
    "False" (ogbn-proteins), edge features when ``has_edge_attr`` is "True", and every
    ``additional node files`` / ``additional edge files`` entry."""
    if meta.get("binary") == "True":
        return ["raw/data.npz", "raw/node-label.npz"]
    files = ["raw/edge.csv.gz", "raw/num-node-list.csv.gz", "raw/num-edge-list.csv.gz"]
    if str(meta.get("has_node_attr", "True")) != "False":
        files.append("raw/node-feat.csv.gz")
    if str(meta.get("has_edge_attr", "False")) == "True":
        files.append("raw/edge-feat.csv.gz")
    files.append("raw/node-label.csv.gz")
    for key in ("additional node files", "additional edge files"):
        extra = str(meta.get(key, "None"))
        if extra != "None":
            files += [f"raw/{f.strip()}.csv.gz" for f in extra.split(",") if f.strip()]
    return files


def is_multilabel(meta: dict) -> bool:
    """Whether ``meta`` (ogb's meta_dict) describes a binary (multi-label) task, e.g.
    ogbn-proteins' 112 binary tasks."""
    return "binary" in str(meta.get("task type", ""))


def _check_supported(meta: dict, where: str) -> None:
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise DatasetError(
            f"{where}: meta.json lacks the ogb meta_dict keys {missing}; add them (see "
            "../shared/datasets/cora/meta.json for a complete example)"
        )
    if meta["is hetero"] == "True":
        raise DatasetError(
            f"{where} is a heterogeneous graph (is hetero=True, e.g. ogbn-mag); partition-ogbn "
            "handles homogeneous node-property datasets only"
        )
    task, tasks = str(meta["task type"]), str(meta["num tasks"])
    if is_multilabel(meta):
        if not tasks.isdigit() or int(tasks) < 1:
            raise DatasetError(f"{where}: meta.json says 'num tasks' {tasks!r} for a binary "
                               "classification dataset; it must be a positive integer")
        return
    if tasks != "1" or "multiclass" not in task:
        raise DatasetError(
            f"{where} is a {tasks}-task {task!r} dataset; partition-ogbn handles "
            "single-task multiclass classification and (multi-label) binary classification "
            "(e.g. ogbn-proteins), not this task type"
        )


def _present(src: Path, f: str) -> bool:
    """Whether raw file ``f`` is in ``src``; ogbn-proteins' zip names its species file
    raw/species.csv.gz, which ogb renames to raw/node_species.csv.gz when reading."""
    if (src / f).is_file():
        return True
    return f == "raw/node_species.csv.gz" and (src / "raw" / "species.csv.gz").is_file()


def _check_layout(src: Path, meta: dict, where: str) -> None:
    missing = [f for f in _required_raw_files(meta) if not _present(src, f)]
    if missing:
        if meta.get("binary") == "True":
            raise DatasetError(
                f"{where}: missing {', '.join(str(src / f) for f in missing)}; meta.json says "
                "binary=True, so the directory must hold OGB's binary raw layout (raw/data.npz, "
                "raw/node-label.npz, split/, meta.json) -- write one with `partition-ogbn "
                "--dataset rmat --raw-out DIR`, or set binary to False for raw/*.csv.gz files"
            )
        if is_multilabel(meta):
            raise DatasetError(
                f"{where}: missing {', '.join(str(src / f) for f in missing)}; meta.json "
                f"describes a multi-label dataset shaped like ogbn-proteins (has_node_attr="
                f"{meta.get('has_node_attr')}, has_edge_attr={meta.get('has_edge_attr')}, "
                f"additional node files={meta.get('additional node files')}), so the "
                "directory must hold those raw files (raw/edge.csv.gz, raw/edge-feat.csv.gz, "
                "raw/node-label.csv.gz, ...) -- write one with `partition-ogbn --dataset "
                "synthetic-proteins --raw-out DIR`, or fix meta.json"
            )
        raise DatasetError(
            f"{where}: missing {', '.join(str(src / f) for f in missing)}; the directory must "
            "hold the dataset in OGB raw layout (raw/*.csv.gz with node features, split/, "
            "meta.json) -- write one with `partition-ogbn --dataset synthetic --raw-out DIR`"
        )
    if meta.get("binary") == "True":
        _check_binary(src, where, int(meta["num tasks"]) if is_multilabel(meta) else 0)
    split_dir = src / "split" / str(meta["split"])
    if not (split_dir / "split_dict.pt").is_file():
        absent = [
            s for s in ("train", "valid", "test") if not (split_dir / f"{s}.csv.gz").is_file()
        ]
        if absent:
            raise DatasetError(
                f"{where}: split files {[str(split_dir / f'{s}.csv.gz') for s in absent]} are "
                f"missing (meta.json says split={meta['split']!r}); add them or fix 'split'"
            )
        for s in ("train", "valid", "test"):
            _check_split_file(split_dir / f"{s}.csv.gz", s, where)


# data.npz members ogb's read_binary_graph_raw reads (every other member must start with
# node_ or edge_); mfgserve needs node_feat as well
_NPZ_REQUIRED = ("edge_index", "num_nodes_list", "num_edges_list", "node_feat")


def _npz_headers(path: Path, where: str) -> dict[str, tuple[tuple, np.dtype]]:
    """``{member: (shape, dtype)}`` of an ``.npz`` file, read from the array headers only."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            out = {}
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(f)
                out[info.filename[:-4]] = (shape, dtype)
            return out
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        raise DatasetError(
            f"{where}: cannot read {path} as a numpy .npz archive ({e}); rewrite it with "
            "numpy.savez (see partition/rmat.py's write_ogb_binary)"
        ) from e


def _check_binary(src: Path, where: str, num_tasks: int = 0) -> None:
    """The members, shapes and dtypes ogb's binary reader and mfgserve need, checked from
    the npz headers (nothing large is read), so a wrong file fails here with a message
    instead of inside ogb."""
    data = src / "raw" / "data.npz"
    fix = (f"{data} must hold edge_index [2, E] (integers), node_feat [N, F], "
           "num_nodes_list [N] and num_edges_list [E] (one graph), and only other members "
           "named node_* or edge_*")
    h = _npz_headers(data, where)
    missing = [k for k in _NPZ_REQUIRED if k not in h]
    if missing:
        raise DatasetError(f"{where}: {data} lacks the member(s) {missing} (it has "
                           f"{sorted(h)}); {fix}")
    odd = [k for k in h if k not in _NPZ_REQUIRED and not k.startswith(("node_", "edge_"))]
    if odd:
        raise DatasetError(f"{where}: {data} has member(s) {odd} that ogb refuses (names must "
                           f"start with node_ or edge_); rename or remove them. {fix}")
    (ei_shape, ei_dtype), (nf_shape, _) = h["edge_index"], h["node_feat"]
    if len(ei_shape) != 2 or ei_shape[0] != 2 or ei_dtype.kind not in "iu":
        raise DatasetError(f"{where}: {data} edge_index has shape {ei_shape} and dtype "
                           f"{ei_dtype}, expected [2, E] integers; {fix}")
    with np.load(data) as z:
        nn_list = np.asarray(z["num_nodes_list"]).reshape(-1)
        ne_list = np.asarray(z["num_edges_list"]).reshape(-1)
    if nn_list.shape != (1,) or ne_list.shape != (1,):
        raise DatasetError(f"{where}: {data} num_nodes_list / num_edges_list hold "
                           f"{nn_list.size} / {ne_list.size} graphs; a node-property dataset "
                           f"has exactly one. {fix}")
    n, e = int(nn_list[0]), int(ne_list[0])
    if e != ei_shape[1]:
        raise DatasetError(f"{where}: {data} num_edges_list says {e} edges but edge_index "
                           f"has {ei_shape[1]}; {fix}")
    if len(nf_shape) not in (1, 2) or nf_shape[0] != n:
        raise DatasetError(f"{where}: {data} node_feat has shape {nf_shape} but "
                           f"num_nodes_list says {n} nodes; {fix}")
    labels = src / "raw" / "node-label.npz"
    lh = _npz_headers(labels, where)
    if "node_label" not in lh:
        raise DatasetError(f"{where}: {labels} lacks the member 'node_label' (it has "
                           f"{sorted(lh)}); write the labels as node_label [N, 1]")
    want = (n, num_tasks or 1)
    if tuple(lh["node_label"][0]) != want and not (
            not num_tasks and lh["node_label"][0][:1] == (n,)):
        raise DatasetError(f"{where}: {labels} node_label has shape {lh['node_label'][0]}, "
                           f"expected {want}")


def _check_split_file(path: Path, split: str, where: str) -> None:
    """ogb (pandas) fails with a traceback on an empty or unreadable split file: check first."""
    try:
        with gzip.open(path, "rt") as f:
            has_ids = any(line.strip() for line in f)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DatasetError(
            f"{where}: cannot read the split file {path} ({e}); it must be a gzip-compressed "
            f"CSV with one {split} node id per line: rewrite it"
        ) from e
    if not has_ids:
        raise DatasetError(
            f"{where}: the split file {path} is empty; ogb cannot read an empty split: write the "
            f"{split} node ids into it, one per line (at least one)"
        )


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.symlink(src.resolve(), dst)
    except OSError:
        shutil.copy2(src, dst)


def _stage(src: Path, meta: dict, work_parent: str | None) -> Path:
    """Make a private working dir that ogb may write processed/ into; return its path."""
    if work_parent is not None:
        Path(work_parent).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mfgserve-ogb-", dir=work_parent))
    for sub in ("raw", "split"):
        for f in sorted((src / sub).rglob("*")) if (src / sub).is_dir() else []:
            target = work / f.relative_to(src)
            if f.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(f, target)
    (work / "processed").mkdir()
    release = f"RELEASE_v{meta['version']}.txt"
    if (src / release).is_file():
        shutil.copy2(src / release, work / release)
    else:  # ogb would otherwise stop and ask on stdin whether to delete the dataset
        print(
            f"warning: {src / release} is missing; assuming the files are version "
            f"{meta['version']}",
            file=sys.stderr,
        )
        (work / release).write_text(f"v{meta['version']}\n")
    return work


def _download(name: str, meta: dict, root: Path, target: Path) -> None:
    """Fetch ogb's zip for ``name`` into ``target`` (what ogb does, minus its y/N prompts)."""
    from ogb.utils.url import download_url, extract_zip

    url = meta.get("url", "")
    hint = (
        f"Without internet, download {url} elsewhere and unzip it so that "
        f"{target / 'raw'} exists (or pass --dataset-dir to a directory in OGB raw layout)"
    )
    if target.exists():
        raise DatasetError(
            f"{target} exists but lacks the raw files of {name}; remove it to re-download, or "
            f"complete it. {hint}"
        )
    root.mkdir(parents=True, exist_ok=True)
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)
    try:
        path = download_url(url, str(root))
        extract_zip(path, str(root))
        os.unlink(path)
        shutil.move(str(root / meta["download_name"]), str(target))
    except (OSError, RuntimeError) as e:  # URLError is an OSError
        raise DatasetError(
            f"{name} is not in {target} and downloading {url} failed ({e}). {hint}"
        ) from e
    finally:
        socket.setdefaulttimeout(old_timeout)


def _labels(raw, n: int, where: str) -> np.ndarray:
    lab = np.asarray(raw)
    if lab.ndim == 2 and lab.shape[1] == 1:
        lab = lab[:, 0]
    if lab.shape != (n,):
        raise DatasetError(f"{where}: labels have shape {np.asarray(raw).shape}, expected ({n}, 1)")
    if lab.dtype.kind == "f":
        out = np.full(n, -1, dtype=np.int64)
        ok = ~np.isnan(lab)
        out[ok] = lab[ok].astype(np.int64)
        return out
    return lab.astype(np.int64, copy=False)


def _read_splits(ds, meta: dict, where: str) -> dict[str, np.ndarray]:
    try:
        split = ds.get_idx_split()
        splits = {}
        for s in ("train", "valid", "test"):
            ids = split[s]
            if hasattr(ids, "numpy"):
                ids = ids.numpy()
            splits[s] = np.asarray(ids, dtype=np.int64).reshape(-1)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError) as e:
        raise DatasetError(
            f"{where}: ogb could not read the split split/{meta['split']}/ ({e!r}); its "
            "train/valid/test files must list integer node ids, one per line"
        ) from e
    return splits


EDGE_FEAT_TO_NODE = ("auto", "mean", "sum", "none")
NODE_SPECIES = ("none", "onehot")


def _multilabels(raw, n: int, num_tasks: int, where: str) -> np.ndarray:
    """ogb's labels of a binary (multi-label) dataset as float32 ``[n, num_tasks]``: 0 / 1,
    NaN where unknown."""
    lab = np.asarray(raw)
    if lab.ndim == 1:
        lab = lab.reshape(-1, 1)
    if lab.shape != (n, num_tasks):
        raise DatasetError(f"{where}: labels have shape {lab.shape}, expected ({n}, "
                           f"{num_tasks}) (meta.json 'num tasks' = {num_tasks}); fix "
                           "raw/node-label.csv.gz or 'num tasks'")
    lab = lab.astype(np.float32)
    bad = ~(np.isnan(lab) | (lab == 0) | (lab == 1))
    if bad.any():
        r, c = (int(x) for x in np.argwhere(bad)[0])
        raise DatasetError(f"{where}: the label of node {r}, task {c} is {lab[r, c]}; a "
                           "binary task's labels must be 0, 1 or empty (NaN: unknown)")
    return np.ascontiguousarray(lab)


def reduce_edge_feat(dst: np.ndarray, edge_feat: np.ndarray, n: int,
                     how: str) -> np.ndarray:
    """Node features from edge features: per node, the ``how`` ("mean" / "sum") of the
    feature rows of its incoming edges (``dst`` == the node), float32 ``[n, D]``; zeros for
    a node without in-edges. (ogbn-proteins' usual baseline: mean of incident edges.)"""
    ef = np.asarray(edge_feat, dtype=np.float64)
    if ef.ndim == 1:
        ef = ef.reshape(-1, 1)
    out = np.empty((n, ef.shape[1]), dtype=np.float64)
    for k in range(ef.shape[1]):
        out[:, k] = np.bincount(dst, weights=ef[:, k], minlength=n)
    if how == "mean":
        out /= np.maximum(np.bincount(dst, minlength=n), 1)[:, None]
    return out.astype(np.float32)


def _species_onehot(graph: dict, n: int, where: str) -> np.ndarray:
    species = graph.get("node_species")
    if species is None:
        raise DatasetError(f"{where} has no node_species (an 'additional node file' of "
                           "ogbn-proteins); drop --node-species onehot")
    species = np.asarray(species).reshape(-1)
    if species.shape != (n,):
        raise DatasetError(f"{where}: node_species has {species.shape[0]} rows for {n} nodes")
    values, idx = np.unique(species, return_inverse=True)
    out = np.zeros((n, values.shape[0]), dtype=np.float32)
    out[np.arange(n), idx] = 1.0
    return out


def _node_features(graph: dict, n: int, src: np.ndarray, dst: np.ndarray,
                   edge_feat: np.ndarray | None, where: str, edge_feat_to_node: str,
                   node_species: str) -> np.ndarray:
    """The node feature matrix: the dataset's node features and / or the reduction of the
    incoming edges' features (``edge_feat_to_node``; "auto": mean when the dataset has edge
    features and no node features), then the species one-hot when asked for."""
    node_feat = graph.get("node_feat")
    how = edge_feat_to_node
    if how == "auto":
        how = "mean" if node_feat is None and edge_feat is not None else "none"
    if how != "none" and edge_feat is None:
        raise DatasetError(f"{where} has no edge features (raw/edge-feat.csv.gz), so "
                           f"--edge-feat-to-node {edge_feat_to_node} has nothing to reduce; "
                           "use --edge-feat-to-node none")
    if node_feat is None and how == "none":
        if edge_feat is None:
            raise DatasetError(
                f"{where} has neither node features (raw/node-feat.csv.gz, or node_feat in "
                "raw/data.npz) nor edge features (raw/edge-feat.csv.gz); mfgserve needs one "
                "of them: node features directly, or edge features reduced to node features "
                "with --edge-feat-to-node mean|sum")
        raise DatasetError(
            f"{where} has no node features (raw/node-feat.csv.gz) and --edge-feat-to-node "
            "none was given; derive them from its edge features with --edge-feat-to-node "
            "mean (the usual ogbn-proteins baseline) or sum")
    cols = []
    if node_feat is not None:
        feat = np.asarray(node_feat, dtype=np.float32)
        cols.append(feat.reshape(n, -1) if feat.ndim == 1 else feat)
    if how != "none":
        assert edge_feat is not None
        cols.append(reduce_edge_feat(dst, edge_feat, n, how))
    if node_species == "onehot":
        cols.append(_species_onehot(graph, n, where))
    feat = cols[0] if len(cols) == 1 else np.concatenate(cols, axis=1)
    return np.ascontiguousarray(feat, dtype=np.float32)


def _to_graph_data(ds, name: str, meta: dict, add_reverse_edges: bool, where: str,
                   feat_source: str, edge_feat_to_node: str = "auto",
                   node_species: str = "none") -> GraphData:
    graph, labels = ds[0]
    n = int(graph["num_nodes"])
    ei = np.asarray(graph["edge_index"], dtype=np.int64)
    src, dst = ei[0], ei[1]
    edge_feat = graph.get("edge_feat")
    if edge_feat is not None and np.asarray(edge_feat).shape[0] != src.shape[0]:
        raise DatasetError(f"{where}: raw/edge-feat.csv.gz has {np.asarray(edge_feat).shape[0]} "
                           f"rows for {src.shape[0]} edges (after ogb's inverse edges); it "
                           "needs one row per line of raw/edge.csv.gz")
    if add_reverse_edges and meta["add_inverse_edge"] != "True":
        keep = src != dst  # a self loop is its own reverse
        src = np.concatenate([src, dst[keep]])
        dst = np.concatenate([dst, ei[0][keep]])
        if edge_feat is not None:  # a reversed edge carries its edge's features
            ef = np.asarray(edge_feat)
            edge_feat = np.concatenate([ef, ef[keep]])
    feat = _node_features(graph, n, src, dst, edge_feat, where, edge_feat_to_node,
                          node_species)
    splits = _read_splits(ds, meta, where)
    if is_multilabel(meta):
        tasks = int(meta["num tasks"])
        task = dict(label=_multilabels(labels, n, tasks, where), task_type="binary",
                    num_tasks=tasks, eval_metric=str(meta.get("eval metric") or "rocauc"))
    else:
        task = dict(label=_labels(labels, n, where))
    data = GraphData(
        name=name,
        num_nodes=n,
        src=np.ascontiguousarray(src),
        dst=np.ascontiguousarray(dst),
        feat=feat,
        num_classes=int(meta["num classes"]),
        feat_source=feat_source,
        **task,
        **splits,
    )
    return data.validate()


def _read_meta_json(src: Path) -> dict:
    """``src/meta.json`` as a dict, ogb's meta_dict values as the strings ogb compares."""
    meta_path = src / "meta.json"
    if not meta_path.is_file():
        raise DatasetError(
            f"{src} has no meta.json: it is not in OGB raw layout; add a meta.json with ogb's "
            "meta_dict fields (see ../shared/datasets/cora/meta.json)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DatasetError(f"cannot read {meta_path}: {e}; fix the JSON") from e
    if not isinstance(meta, dict):
        raise DatasetError(f"{meta_path} must hold a JSON object of ogb meta_dict fields")
    return {k: _meta_str(v) if k in META_KEYS else v for k, v in meta.items()}


def _dir_source(dataset_dir: str, work_dir: str | None):
    """(src, meta, ds_name, where, work parent) of a directory in OGB raw layout, checked."""
    src = Path(dataset_dir)
    if not src.is_dir():
        raise DatasetError(
            f"dataset directory {src} does not exist; pass a directory in OGB raw layout "
            "(raw/, split/, meta.json), e.g. ../shared/datasets/cora"
        )
    meta = _read_meta_json(src)
    ds_name = str(meta.get("name") or src.resolve().name)
    where = f"dataset directory {src}"
    _check_supported(meta, where)
    _check_layout(src, meta, where)
    return src, meta, ds_name, where, work_dir


def _named_source(name: str, root: str | None, work_dir: str | None):
    """(src, meta, ds_name, where, work parent) of an ogb dataset by name, downloaded when
    its raw files are missing, checked."""
    master = _ogb_master()
    if name not in master:
        known = ", ".join(k for k in master if k.startswith("ogbn-"))
        raise DatasetError(
            f"unknown OGB dataset {name!r}; ogb knows {known}. For other data pass "
            "--dataset-dir DIR (OGB raw layout) or --dataset synthetic"
        )
    meta = master[name]
    ds_name = name
    root_p = Path(root or DEFAULT_ROOT)
    src = root_p / "_".join(name.split("-"))
    where = f"OGB dataset {name} in {src}"
    _check_supported(meta, where)
    if any(not _present(src, f) for f in _required_raw_files(meta)):
        with contextlib.redirect_stdout(sys.stderr):
            _download(name, meta, root_p, src)
    _check_layout(src, meta, where)
    parent = work_dir if work_dir is not None else str(root_p)
    return src, meta, ds_name, where, parent


def _load_staged(src: Path, meta: dict, ds_name: str, where: str, parent: str | None,
                 add_reverse_edges: bool, edge_feat_to_node: str = "auto",
                 node_species: str = "none") -> GraphData:
    """Stage ``src`` into a working dir under ``parent``, let ogb read it, remove the dir."""
    from ogb.nodeproppred import NodePropPredDataset

    work = _stage(src, meta, parent)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # ogb prints progress to stdout
            try:
                ds = NodePropPredDataset(name=ds_name, meta_dict={**meta, "dir_path": str(work)})
            except (RuntimeError, ValueError, KeyError, OSError) as e:
                raise DatasetError(f"ogb could not read {where}: {e!r}; check its raw files") from e
            feat_file = "raw/data.npz" if meta.get("binary") == "True" else "raw/node-feat.csv.gz"
            if meta.get("binary") != "True" and not (src / feat_file).is_file():
                feat_file = "raw/edge-feat.csv.gz"  # features derived from edge features
            return _to_graph_data(ds, ds_name, meta, add_reverse_edges, where,
                                  str(src / feat_file), edge_feat_to_node, node_species)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_ogb(
    name: str | None = None,
    root: str | None = None,
    dataset_dir: str | None = None,
    *,
    add_reverse_edges: bool = False,
    work_dir: str | None = None,
    edge_feat_to_node: str = "auto",
    node_species: str = "none",
) -> GraphData:
    """Load an OGB node-property dataset into a :class:`GraphData`.

    Give exactly one of ``name`` (an ogb dataset name such as ``ogbn-arxiv``; files live in
    ``root/<name with _>``, default root ``./data/ogb``) or ``dataset_dir`` (a directory in
    OGB raw layout with ``meta.json``; its name is ``meta['name']`` or the directory name).

    ``add_inverse_edge`` in the dataset's meta is applied by ogb (edges come in
    ``(u -> v), (v -> u)`` pairs). ``add_reverse_edges=True`` additionally makes a directed
    dataset (``add_inverse_edge`` False, e.g. ogbn-arxiv) bidirected by appending every
    non-self-loop edge reversed; it is a no-op when ogb already inverted the edges.
    ``work_dir`` is where the temporary working directory goes (default: ``root`` for named
    datasets, the system temp dir otherwise).

    Node features: ``edge_feat_to_node`` "mean" / "sum" derives them from the edge features
    (per node, the mean / sum over its incoming edges, appended to any node features);
    "auto" does "mean" for a dataset with edge features and no node features (ogbn-proteins)
    and nothing otherwise; "none" never. ``node_species`` "onehot" appends a one-hot of
    ogbn-proteins' ``node_species`` (an additional node file); "none" leaves it out (it then
    only matters through the ``species`` split files). Binary (multi-label) datasets give
    ``task_type`` "binary" and float32 ``[N, num tasks]`` labels with NaN where unknown.

    Raises :class:`DatasetError` with a message naming the path and the fix.
    """
    if (name is None) == (dataset_dir is None):
        raise DatasetError("give exactly one of name (an ogbn-* dataset) or dataset_dir")
    if edge_feat_to_node not in EDGE_FEAT_TO_NODE or node_species not in NODE_SPECIES:
        raise DatasetError(f"edge_feat_to_node={edge_feat_to_node!r} must be one of "
                           f"{EDGE_FEAT_TO_NODE} and node_species={node_species!r} one of "
                           f"{NODE_SPECIES}")
    if dataset_dir is not None:
        src, meta, ds_name, where, parent = _dir_source(dataset_dir, work_dir)
    else:
        assert name is not None  # exactly one of the two is given
        src, meta, ds_name, where, parent = _named_source(name, root, work_dir)
    return _load_staged(src, meta, ds_name, where, parent, add_reverse_edges,
                        edge_feat_to_node, node_species)


def dataset_meta(name: str | None = None, dataset_dir: str | None = None) -> dict | None:
    """ogb's meta_dict of a dataset (``meta.json`` of a directory, or ogb's table for a
    name), without reading or downloading anything else; None when there is none."""
    if dataset_dir is not None:
        try:
            return _read_meta_json(Path(dataset_dir))
        except DatasetError:
            return None
    try:
        return _ogb_master().get(str(name))
    except DatasetError:
        return None
