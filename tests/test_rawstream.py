"""partition/rawstream.py: an OGB dataset streamed from its raw files equals what
partition.ogbn.load_ogb (ogb's own reader) builds from them -- edges as a multiset (and in
ogb's order for add_inverse_edge datasets), features, labels (-1 for NaN), splits -- for the
csv layout (../shared/datasets/cora) and the binary layout (stored, deflated, written by
npzio.NpzWriter with float16 features and NaN labels, as ogbn-papers100M ships), plus clear
DatasetErrors naming the file for bad input, and bounded memory while streaming edges."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import REPO, clean_env

from partition.graph_data import DatasetError, GraphData
from partition.npzio import NpzWriter
from partition.ogbn import load_ogb
from partition.rawstream import RawSource, open_raw
from partition.rmat import generate_rmat, ogb_meta, write_ogb_binary
from partition.synthetic import _write_int_csv


def _edge_keys(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    return np.sort(src.astype(np.int64) * (1 << 32) + dst)


def _stream(r: RawSource, rows: int, add_reverse_edges: bool):
    chunks = list(r.edge_chunks(rows=rows, add_reverse_edges=add_reverse_edges))
    assert all(s.dtype == np.int64 and d.dtype == np.int64 for s, d in chunks)
    src = np.concatenate([s for s, _ in chunks])
    dst = np.concatenate([d for _, d in chunks])
    return src, dst, chunks


def _same_as_load_ogb(path: Path, add_reverse_edges: bool, rows: int = 997,
                      feat_rows: int = 101) -> RawSource:
    """Everything RawSource streams from ``path`` equals load_ogb's GraphData."""
    g = load_ogb(dataset_dir=str(path), add_reverse_edges=add_reverse_edges)
    r = open_raw(dataset_dir=str(path))
    assert (r.num_nodes, r.num_classes, r.feat_dim) == (g.num_nodes, g.num_classes, g.feat_dim)
    src, dst, chunks = _stream(r, rows, add_reverse_edges)
    assert r.num_directed_edges(add_reverse_edges) == src.shape[0] == g.num_edges
    assert np.array_equal(_edge_keys(src, dst), _edge_keys(g.src, g.dst))
    if r.add_inverse_edge:  # ogb's own interleaved order, chunk by chunk
        assert np.array_equal(src, g.src) and np.array_equal(dst, g.dst)
        assert all(s.shape[0] <= 2 * rows for s, _ in chunks)
    feat_blocks = list(r.feat_chunks(rows=feat_rows))
    assert all(b.dtype == r.feat_dtype and b.shape[1] == r.feat_dim for b in feat_blocks)
    assert all(b.shape[0] == feat_rows for b in feat_blocks[:-1])
    feat = np.concatenate(feat_blocks)
    assert np.array_equal(feat.astype(np.float32), g.feat)  # float16 -> float32 is exact
    assert np.array_equal(np.concatenate(list(r.label_chunks(rows=101))), g.label)
    assert np.array_equal(r.labels(), g.label)
    for s in ("train", "valid", "test"):
        assert np.array_equal(r.splits()[s], g.split(s)), s
    assert np.array_equal(r.train_mask(), g.train_mask())
    assert r.feat_source == g.feat_source
    return r


# ------------------------------------------------------------------------------ csv layout


@pytest.mark.timeout(90)
def test_cora_csv_matches_load_ogb(cora_dir):
    r = _same_as_load_ogb(cora_dir, add_reverse_edges=False, feat_rows=500)
    assert not r.binary and r.add_inverse_edge and r.feat_dtype == np.float32
    # iterators can be run again (one per partitioner pass); add_reverse_edges is a no-op
    # on a dataset ogb already inverts (add_inverse_edge True), as in load_ogb
    a = _stream(r, 1 << 22, False)[:2]
    b = _stream(r, 333, True)[:2]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert r.num_directed_edges(True) == r.num_directed_edges(False) == 2 * r.num_stored_edges


# ------------------------------------------------------------------------------ binary layout


def _directed_graph(n: int = 500, e: int = 4000, seed: int = 5, loops: int = 7) -> GraphData:
    """A directed graph with self loops and NaN-free labels (ogb's binary layout as
    write_ogb_binary writes it: add_inverse_edge False)."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, n, e, dtype=np.int64)
    dst = rng.integers(0, n, e, dtype=np.int64)
    dst[:loops] = src[:loops]  # self loops: their reverse is themselves
    perm = rng.permutation(n)
    return GraphData(name="directed", num_nodes=n, src=src, dst=dst,
                     feat=rng.standard_normal((n, 6)).astype(np.float32),
                     label=rng.integers(0, 4, n), train=np.sort(perm[:200]),
                     valid=np.sort(perm[200:300]), test=np.sort(perm[300:]), num_classes=4)


@pytest.fixture(scope="module")
def directed_dir(tmp_path_factory) -> Path:
    return write_ogb_binary(_directed_graph(), tmp_path_factory.mktemp("raw") / "directed",
                            progress=False)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("add_reverse_edges", [False, True])
def test_binary_stored_matches_load_ogb(directed_dir, add_reverse_edges):
    r = _same_as_load_ogb(directed_dir, add_reverse_edges)
    assert r.binary and not r.add_inverse_edge
    # self loops are reversed once only: 2 E - loops
    g = _directed_graph()
    loops = int(np.count_nonzero(g.src == g.dst))
    assert loops >= 7 and r.num_directed_edges(True) == 2 * 4000 - loops
    assert r.num_directed_edges(False) == 4000


@pytest.mark.timeout(90)
def test_rmat_binary_matches_load_ogb(tmp_path):
    g = generate_rmat(3000, avg_degree=10, feat_dim=8, num_classes=5, seed=1, progress=False)
    path = write_ogb_binary(g, tmp_path / "rmat", progress=False)
    _same_as_load_ogb(path, add_reverse_edges=False, rows=4096)


@pytest.mark.timeout(90)
def test_binary_deflated_matches_load_ogb(directed_dir, tmp_path):
    """data.npz and node-label.npz rewritten by np.savez_compressed (deflated members,
    streamed in order; edge_index rows by two readers)."""
    path = tmp_path / "deflated"
    shutil.copytree(directed_dir, path)
    for f in ("data.npz", "node-label.npz"):
        with np.load(path / "raw" / f) as z:
            arrays = {k: z[k] for k in z.files}
        np.savez_compressed(path / "raw" / f, **arrays)
    _same_as_load_ogb(path, add_reverse_edges=True, rows=600)


def _write_papers_like(out: Path, n: int, src, dst, feat, label, splits: dict,
                       num_classes: int, chunk: int = 1000) -> Path:
    """OGB's binary layout as ogbn-papers100M ships it, written by chunks with NpzWriter:
    edge_index once per undirected edge (add_inverse_edge False), features of any dtype,
    node_label float64 [N, 1] with NaN for unlabelled nodes."""
    raw, split = out / "raw", out / "split" / "time"
    raw.mkdir(parents=True)
    split.mkdir(parents=True)
    e = src.shape[0]
    with NpzWriter(raw / "data.npz") as w:
        with w.member_columns("edge_index", (2, e), np.int64) as m:
            for s in range(0, e, chunk):
                m.write_rows(src[s:s + chunk], dst[s:s + chunk])
        with w.member("node_feat", feat.shape, feat.dtype) as m:
            for s in range(0, n, chunk):
                m.write(feat[s:s + chunk])
        w.add("num_nodes_list", np.array([n], dtype=np.int64))
        w.add("num_edges_list", np.array([e], dtype=np.int64))
    with NpzWriter(raw / "node-label.npz") as w:
        w.add("node_label", label.reshape(-1, 1))
    for s, ids in splits.items():
        _write_int_csv(split / f"{s}.csv.gz", [ids])
    (out / "RELEASE_v1.txt").write_text("v1")
    meta = ogb_meta(out.name, num_classes, "time", binary=True, add_inverse_edge=False)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out


@pytest.fixture(scope="module")
def papers_like(tmp_path_factory) -> tuple[Path, dict]:
    rng = np.random.default_rng(7)
    n, e, c = 2000, 9000, 11
    src = rng.integers(0, n, e, dtype=np.int64)
    dst = rng.integers(0, n, e, dtype=np.int64)
    feat = (rng.standard_normal((n, 12)) * 3).astype(np.float16)
    label = rng.integers(0, c, n).astype(np.float64)
    labelled = rng.random(n) < 0.3
    label[~labelled] = np.nan
    ids = rng.permutation(np.flatnonzero(labelled))
    splits = {"train": np.sort(ids[: len(ids) // 2]),
              "valid": np.sort(ids[len(ids) // 2: 3 * len(ids) // 4]),
              "test": np.sort(ids[3 * len(ids) // 4:])}
    path = _write_papers_like(tmp_path_factory.mktemp("raw") / "papers_like", n, src, dst,
                              feat, label, splits, c)
    return path, dict(src=src, dst=dst, feat=feat, label=label, labelled=labelled)


@pytest.mark.timeout(90)
def test_papers_like_float16_nan_labels(papers_like):
    path, arrays = papers_like
    r = _same_as_load_ogb(path, add_reverse_edges=True, rows=1500)
    assert r.feat_dtype == np.float16  # kept as stored (load_ogb makes float32)
    feat = np.concatenate(list(r.feat_chunks(rows=512)))
    assert feat.dtype == np.float16 and np.array_equal(feat, arrays["feat"])
    labels = r.labels()
    assert np.array_equal(labels == -1, ~arrays["labelled"])
    assert np.array_equal(labels[arrays["labelled"]],
                          arrays["label"][arrays["labelled"]].astype(np.int64))
    s, d, _ = _stream(r, 4096, False)  # as stored: each edge once
    assert np.array_equal(s, arrays["src"]) and np.array_equal(d, arrays["dst"])


# ------------------------------------------------------------------------------ bad input


def _feat_rows_with(path: Path, row: int, value) -> None:
    """Set one feature of ``row`` in the binary layout at ``path`` to ``value``."""
    data = path / "raw" / "data.npz"
    with np.load(data) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["node_feat"] = arrays["node_feat"].copy()
    arrays["node_feat"][row, 3] = value
    np.savez(data, **arrays)


@pytest.mark.timeout(60)
def test_non_finite_feature_row_is_named(papers_like, tmp_path):
    path = tmp_path / "inf"
    shutil.copytree(papers_like[0], path)
    _feat_rows_with(path, 1234, np.inf)
    r = open_raw(dataset_dir=str(path))
    with pytest.raises(DatasetError, match=rf"{path / 'raw' / 'data.npz'}: row 1234 \(node "
                                           r"1234.*\(inf in column 3\)"):
        for _ in r.feat_chunks(rows=100):
            pass


@pytest.mark.timeout(60)
def test_csv_nan_feature_row_is_named(cora_dir, tmp_path):
    path = tmp_path / "cora_nan"
    shutil.copytree(cora_dir, path)
    feat = path / "raw" / "node-feat.csv.gz"
    with gzip.open(feat, "rt") as f:
        lines = f.read().splitlines()
    cells = lines[777].split(",")
    cells[2] = "nan"
    lines[777] = ",".join(cells)
    with gzip.open(feat, "wt") as f:
        f.write("\n".join(lines) + "\n")
    r = open_raw(dataset_dir=str(path))
    with pytest.raises(DatasetError, match=rf"{feat}: row 777 .*\(nan in column 2\)"):
        list(r.feat_chunks(rows=500))


@pytest.mark.timeout(60)
def test_truncated_files_give_dataset_errors(directed_dir, cora_dir, tmp_path):
    # binary: data.npz cut short (a download stopped half-way): refused when opened
    path = tmp_path / "cut"
    shutil.copytree(directed_dir, path)
    data = path / "raw" / "data.npz"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(DatasetError, match=str(data)):
        open_raw(dataset_dir=str(path))
    # csv: edge.csv.gz cut short: the stream fails naming the file
    path = tmp_path / "cora_cut"
    shutil.copytree(cora_dir, path)
    edges = path / "raw" / "edge.csv.gz"
    edges.write_bytes(edges.read_bytes()[: edges.stat().st_size // 2])
    r = open_raw(dataset_dir=str(path))
    with pytest.raises(DatasetError, match=rf"cannot read {edges}|{edges} has \d+ lines"):
        list(r.edge_chunks(rows=256))
    # csv: more node-count than feature lines
    path = tmp_path / "cora_count"
    shutil.copytree(cora_dir, path)
    _write_int_csv(path / "raw" / "num-node-list.csv.gz", [np.array([5000])])
    r = open_raw(dataset_dir=str(path))
    with pytest.raises(DatasetError, match=r"node-feat.csv.gz has 2708 lines but the dataset "
                                           r"has 5000 nodes"):
        list(r.feat_chunks())


@pytest.mark.timeout(60)
def test_bad_edges_and_labels_are_named(tmp_path):
    g = _directed_graph()
    g.dst[1234] = 10_000  # validate() would refuse: write the arrays by hand
    path = _write_papers_like(tmp_path / "bad_edge", g.num_nodes, g.src, g.dst, g.feat,
                              g.label.astype(np.float64), {"train": g.train, "valid": g.valid,
                                                           "test": g.test}, 4)
    r = open_raw(dataset_dir=str(path))
    with pytest.raises(DatasetError, match=r"edge 1234 \(\d+ -> 10000\) .*outside \[0, 500\)"):
        list(r.edge_chunks(rows=1000))
    g = _directed_graph()
    label = g.label.astype(np.float64)
    label[42] = 9
    path = _write_papers_like(tmp_path / "bad_label", g.num_nodes, g.src, g.dst, g.feat,
                              label, {"train": g.train, "valid": g.valid, "test": g.test}, 4)
    with pytest.raises(DatasetError, match=r"node 42 the label 9.0, outside \[0, 4\)"):
        open_raw(dataset_dir=str(path)).labels()
    with pytest.raises(DatasetError, match="exactly one of"):
        open_raw()


# ------------------------------------------------------------------------------ memory

_EDGE_SCRIPT = r"""
import json, sys
import numpy as np, psutil
from partition.rawstream import open_raw

rss = psutil.Process().memory_info
r = open_raw(dataset_dir=sys.argv[1])
rows = int(sys.argv[2])
next(iter(r.edge_chunks(rows=16)))  # imports and first allocations before the baseline
base = rss().rss
high = base
total = 0
for s, d in r.edge_chunks(rows=rows, add_reverse_edges=True):
    total += s.shape[0]
    high = max(high, rss().rss)  # sampled while a chunk is alive
feat_rows = 0
for f in r.feat_chunks(rows=rows // 8):
    feat_rows += f.shape[0]
    high = max(high, rss().rss)
print(json.dumps({"growth": high - base, "edges": total, "feat_rows": feat_rows}))
"""


@pytest.mark.timeout(120)
def test_streaming_a_binary_dataset_keeps_rss_small(tmp_path):
    """A binary dataset with 12M stored edges (192 MiB edge_index) and 96 MiB of features,
    streamed with reverse edges by 256k-edge chunks in a fresh process: peak RSS grows by
    a few chunks, not by the edges."""
    rng = np.random.default_rng(3)
    n, e = 400_000, 12_000_000
    src = rng.integers(0, n, e, dtype=np.int64)
    dst = (src + 1) % n
    feat = np.zeros((n, 64), dtype=np.float32)
    path = _write_papers_like(tmp_path / "big", n, src, dst, feat,
                              np.zeros(n), {"train": np.arange(10), "valid": np.arange(10, 20),
                                            "test": np.arange(20, 30)}, 2, chunk=1 << 20)
    del src, dst, feat
    out = subprocess.run([sys.executable, "-c", _EDGE_SCRIPT, str(path), str(1 << 18)],
                         cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["edges"] == 2 * e and m["feat_rows"] == n
    assert m["growth"] < 64 << 20, m  # edge_index alone is 192 MiB
