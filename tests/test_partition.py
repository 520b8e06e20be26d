"""Tests of the partition package: loaders, synthetic generator, partitioner, CLI, layout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partition.graph_data import DatasetError, GraphData
from partition.layout import (
    PartitionFormatError,
    PartitionSetMeta,
    load_partition,
)
from partition.ogbn import load_ogb
from partition.partitioner import PartitionError, partition_graph
from partition.synthetic import generate, write_ogb_raw

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "datasets"
CORA = SHARED / "cora"
needs_cora = pytest.mark.skipif(
    not (CORA / "meta.json").is_file(),
    reason=f"shared Cora dataset not found at {CORA} (expected ../shared/datasets/cora "
    "next to the repository)",
)


def _writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for p in [dst, *dst.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return dst


@pytest.fixture(scope="module")
def cora_dir(tmp_path_factory) -> Path:
    if not (CORA / "meta.json").is_file():
        pytest.skip(f"shared Cora dataset not found at {CORA}")
    return _writable_copy(CORA, tmp_path_factory.mktemp("shared") / "cora")


@pytest.fixture(scope="module")
def cora(cora_dir) -> GraphData:
    return load_ogb(dataset_dir=str(cora_dir))


def _edge_keys(src: np.ndarray, dst: np.ndarray, n: int) -> np.ndarray:
    return np.sort(src.astype(np.int64) * n + dst)


def check_node_order(orig_ids: np.ndarray, out_degree: np.ndarray | None) -> None:
    """A part's nodes (their original ids in new-id order) follow the node order: by
    out-degree, highest first, ties by original id (``out_degree`` given), or by id."""
    if out_degree is None:
        assert np.all(np.diff(orig_ids) > 0)
        return
    deg = out_degree[orig_ids]
    assert np.all(np.diff(deg) <= 0), "out-degrees rise within a part"
    ties = np.diff(deg) == 0
    assert np.all(np.diff(orig_ids)[ties] > 0), "equal degrees not in original-id order"


def check_partition_set(data: GraphData, out: Path) -> PartitionSetMeta:
    """Assert every invariant of partition/layout.py for ``out`` against ``data``."""
    meta = PartitionSetMeta.load(out)
    n = data.num_nodes
    k = meta.num_parts
    off = np.asarray(meta.node_offsets)
    assert meta.num_nodes == n and meta.num_edges == data.num_edges
    assert meta.feat_dim == data.feat_dim and meta.num_classes == data.num_classes
    assert off[0] == 0 and off[-1] == n and np.all(np.diff(off) >= 0)
    assert [p.num_nodes for p in meta.parts] == np.diff(off).tolist()
    orig_to_new = np.load(out / "orig_to_new.npy")
    assert np.array_equal(np.sort(orig_to_new), np.arange(n))

    parts = [load_partition(out, p) for p in range(k)]
    new_to_orig = np.concatenate([np.asarray(p.orig_ids) for p in parts])
    # every node exactly once, contiguous relabel sorted by part, then (the node order) by
    # out-degree, highest first, or by original id
    assert np.array_equal(np.sort(new_to_orig), np.arange(n))
    by_degree = meta.stats.get("node_order", "degree") == "degree"
    out_degree = np.bincount(data.src, minlength=n)
    assert np.array_equal(orig_to_new[new_to_orig], np.arange(n))
    src_new, dst_new = [], []
    for p, part in enumerate(parts):
        lo, hi = off[p], off[p + 1]
        assert part.node_start == lo and part.num_nodes == hi - lo
        check_node_order(np.asarray(part.orig_ids), out_degree if by_degree else None)
        gids = np.arange(lo, hi)
        assert np.all(meta.owner_of(gids) == p)
        indptr = np.asarray(part.indptr)
        assert indptr[0] == 0 and indptr[-1] == part.indices.shape[0]
        assert np.all(np.diff(indptr) >= 0)
        assert meta.parts[p].num_edges == part.indices.shape[0]
        dst = np.repeat(gids, np.diff(indptr))
        src = np.asarray(part.indices)
        if src.size:
            assert src.min() >= 0 and src.max() < n
            same = dst[1:] == dst[:-1]
            assert np.all(src[1:][same] >= src[:-1][same]), "in-edges not sorted by source"
        src_new.append(src)
        dst_new.append(dst)
        # rows equal the original rows
        assert np.array_equal(np.asarray(part.feat), data.feat[part.orig_ids])
        assert np.array_equal(np.asarray(part.label), data.label[part.orig_ids])
        for s in ("train", "valid", "test"):
            ids = np.asarray(getattr(part, s))
            assert np.all(np.diff(ids) > 0)
            assert np.all((ids >= lo) & (ids < hi))
            assert getattr(meta.parts[p], f"num_{s}") == ids.size
    for s in ("train", "valid", "test"):
        got = np.concatenate([new_to_orig[np.asarray(getattr(p, s))] for p in parts])
        assert np.array_equal(np.sort(got), np.sort(data.split(s)))
    # every directed edge exactly once (as a multiset), in the part owning its destination
    src_all = new_to_orig[np.concatenate(src_new)]
    dst_all = new_to_orig[np.concatenate(dst_new)]
    assert np.array_equal(_edge_keys(src_all, dst_all, n), _edge_keys(data.src, data.dst, n))
    owner = meta.owner_of(orig_to_new)
    cut = int(np.count_nonzero(owner[data.src] != owner[data.dst]))
    assert meta.edge_cut == cut == meta.stats["edge_cut"]
    assert meta.stats["part_nodes"] == np.diff(off).tolist()
    assert meta.stats["peak_rss_bytes"] > 0 and meta.stats["elapsed_s"] >= 0
    return meta


# ---------------------------------------------------------------------------------------
# Cora: OGB raw layout -> GraphData -> partitions


@needs_cora
@pytest.mark.timeout(60)
def test_load_cora(cora):
    assert cora.name == "cora"
    assert cora.num_nodes == 2708 and cora.num_edges == 2 * 5278
    assert cora.feat.shape == (2708, 1433) and cora.feat.dtype == np.float32
    assert cora.num_classes == 7 and cora.label.min() == 0 and cora.label.max() == 6
    assert (cora.train.size, cora.valid.size, cora.test.size) == (140, 500, 1000)
    assert cora.is_interleaved_undirected()
    cora.validate()


@needs_cora
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "num_parts,method",
    [(1, "metis"), (2, "metis"), (4, "metis"), (1, "random"), (2, "random"), (4, "random")],
)
def test_cora_partition_round_trip(cora, tmp_path, num_parts, method):
    out = tmp_path / "parts"
    meta = partition_graph(cora, num_parts, out, method=method, progress=False)
    assert meta.num_parts == num_parts and meta.method == method
    loaded = check_partition_set(cora, out)
    assert loaded.to_json() == meta.to_json()
    if num_parts > 1:
        assert loaded.stats["train_balance"] < 1.25
        assert loaded.stats["node_balance"] < 1.25
    if method == "metis" and num_parts > 1:
        assert loaded.stats["edge_cut_frac"] < 0.3  # random cuts ~ (1 - 1/k) of the edges


@pytest.mark.timeout(60)
def test_large_graph_sort_path(tmp_path, monkeypatch):
    """Edge keys of large graphs are sorted with torch.sort; the result must be the same."""
    import partition.partitioner as partitioner

    g = generate(2000, avg_degree=6, feat_dim=4, num_classes=3, progress=False)
    partition_graph(g, 3, tmp_path / "np", method="random", progress=False)
    monkeypatch.setattr(partitioner, "_TORCH_SORT_MIN", 1)
    partition_graph(g, 3, tmp_path / "torch", method="random", progress=False)
    check_partition_set(g, tmp_path / "torch")
    for p in range(3):
        for name in ("indptr", "indices"):
            a = np.load(tmp_path / "np" / f"part-{p}" / f"{name}.npy")
            b = np.load(tmp_path / "torch" / f"part-{p}" / f"{name}.npy")
            assert np.array_equal(a, b)


@needs_cora
@pytest.mark.timeout(60)
def test_partition_refuses_to_clobber(cora, tmp_path):
    out = tmp_path / "parts"
    partition_graph(cora, 4, out, method="random", progress=False)
    with pytest.raises(PartitionError, match="--force"):
        partition_graph(cora, 2, out, method="random", progress=False)
    partition_graph(cora, 2, out, method="random", progress=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "hot_rank.npy",
        "metadata.json",
        "orig_to_new.npy",
        "part-0",
        "part-1",
    ]
    # without pre-sampling, no stale hot ranking of the old set survives the overwrite
    partition_graph(cora, 2, out, method="random", progress=False, overwrite=True,
                    presample_batches=0)
    assert not (out / "hot_rank.npy").exists()
    check_partition_set(cora, out)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(PartitionError, match="not a partition set"):
        partition_graph(cora, 2, other, method="random", progress=False, overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(PartitionError, match="num_parts"):
        partition_graph(cora, 0, tmp_path / "zero", progress=False)


@needs_cora
@pytest.mark.timeout(60)
def test_cora_write_ogb_raw_round_trip(cora, tmp_path):
    small = GraphData(  # keep the float CSV small: first 64 feature columns
        name="cora64",
        num_nodes=cora.num_nodes,
        src=cora.src,
        dst=cora.dst,
        feat=np.ascontiguousarray(cora.feat[:, :64]),
        label=cora.label,
        train=cora.train,
        valid=cora.valid,
        test=cora.test,
        num_classes=cora.num_classes,
    )
    write_ogb_raw(small, tmp_path / "raw", progress=False)
    assert json.loads((tmp_path / "raw" / "meta.json").read_text())["add_inverse_edge"] == "True"
    back = load_ogb(dataset_dir=str(tmp_path / "raw"))
    _assert_same_graph(small, back)
    # ogb already inverted cora's edges: add_reverse_edges must not double them
    assert load_ogb(dataset_dir=str(tmp_path / "raw"), add_reverse_edges=True).num_edges == (
        cora.num_edges
    )


# ---------------------------------------------------------------------------------------
# synthetic generator


def _assert_same_graph(a: GraphData, b: GraphData) -> None:
    assert a.name == b.name and a.num_nodes == b.num_nodes and a.num_classes == b.num_classes
    for f in ("src", "dst", "feat", "label", "train", "valid", "test"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype, f
        assert np.array_equal(x, y), f


@pytest.mark.timeout(60)
def test_node_order_degree_and_id(tmp_path):
    """``degree`` (the default) orders each part's nodes by out-degree, highest first, ties
    by original id; ``id`` by original id; both are complete, valid sets of the same graph
    whose samples differ only by the relabel. A bad order is refused by name."""
    g = generate(2000, avg_degree=8, feat_dim=4, num_classes=3, seed=1, progress=False)
    deg = np.bincount(g.src, minlength=g.num_nodes)
    orders = {}
    for order in ("degree", "id"):
        meta = partition_graph(g, 2, tmp_path / order, "random", seed=0, progress=False,
                               presample_batches=0, node_order=order)
        assert meta.stats["node_order"] == order
        check_partition_set(g, tmp_path / order)
        orders[order] = np.concatenate([np.asarray(load_partition(tmp_path / order, p).orig_ids)
                                        for p in range(2)])
    assert deg[orders["degree"][0]] == deg[orders["degree"][: meta.node_offsets[1]]].max()
    assert not np.array_equal(orders["degree"], orders["id"])
    for p in range(2):  # the same nodes in each part: only their order differs
        lo, hi = meta.node_offsets[p], meta.node_offsets[p + 1]
        assert np.array_equal(np.sort(orders["degree"][lo:hi]), orders["id"][lo:hi])
    with pytest.raises(PartitionError, match="node_order='hot'.*degree, id"):
        partition_graph(g, 2, tmp_path / "bad", "random", progress=False, node_order="hot")
    assert not (tmp_path / "bad").exists()


def test_synthetic_deterministic_and_valid():
    a = generate(3000, avg_degree=10, feat_dim=16, num_classes=5, seed=3, progress=False)
    b = generate(3000, avg_degree=10, feat_dim=16, num_classes=5, seed=3, progress=False)
    c = generate(3000, avg_degree=10, feat_dim=16, num_classes=5, seed=4, progress=False)
    _assert_same_graph(a, b)
    assert not np.array_equal(a.src, c.src)
    a.validate()
    assert a.num_edges == 2 * 15000 and a.is_interleaved_undirected()
    assert not np.any(a.src == a.dst)
    und = np.minimum(a.src[0::2], a.dst[0::2]) * a.num_nodes + np.maximum(a.src[0::2], a.dst[0::2])
    assert np.unique(und).size == und.size, "duplicate undirected edges"
    assert a.feat.shape == (3000, 16) and a.feat.dtype == np.float32
    splits = np.concatenate([a.train, a.valid, a.test])
    assert np.array_equal(np.sort(splits), np.arange(3000))
    assert a.train.size == 1800 and a.valid.size == 600


def _nearest_centroid_acc(x: np.ndarray, g: GraphData) -> float:
    y = g.label
    cent = np.stack([x[g.train][y[g.train] == c].mean(0) for c in range(g.num_classes)])
    d = ((x[g.test][:, None, :] - cent[None]) ** 2).sum(-1)
    return float((d.argmin(1) == y[g.test]).mean())


@pytest.mark.timeout(60)
def test_synthetic_power_law_homophily_learnable():
    g = generate(20000, avg_degree=20, feat_dim=32, num_classes=10, seed=0, progress=False)
    deg = np.bincount(g.dst, minlength=g.num_nodes)
    assert abs(deg.mean() - 20) < 0.01
    assert deg.max() > 10 * deg.mean(), "no heavy tail"
    assert np.median(deg) < deg.mean(), "degree distribution not right-skewed"
    same = float((g.label[g.src] == g.label[g.dst]).mean())
    assert abs(same - 0.8) < 0.03
    # features alone are partly informative; the neighbourhood mean is much more so
    order = np.argsort(g.dst, kind="stable")
    sums = np.add.reduceat(g.feat[g.src[order]], np.r_[0, np.cumsum(deg)[:-1]], axis=0)
    sums[deg == 0] = 0
    neigh = sums / np.maximum(deg, 1)[:, None]
    own = _nearest_centroid_acc(g.feat, g)
    agg = _nearest_centroid_acc(neigh, g)
    assert 0.2 < own < 0.9 and agg > own + 0.1
    low = generate(5000, avg_degree=20, num_classes=10, homophily=0.3, feat_dim=4, progress=False)
    assert abs(float((low.label[low.src] == low.label[low.dst]).mean()) - 0.3) < 0.03


@pytest.mark.timeout(60)
def test_synthetic_write_ogb_raw_round_trip(tmp_path):
    g = generate(1500, avg_degree=8, feat_dim=12, num_classes=4, seed=7, progress=False)
    write_ogb_raw(g, tmp_path / "syn", progress=False)
    meta = json.loads((tmp_path / "syn" / "meta.json").read_text())
    assert meta["add_inverse_edge"] == "True" and meta["num classes"] == 4
    assert (tmp_path / "syn" / "RELEASE_v1.txt").is_file()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    back = load_ogb(dataset_dir=str(tmp_path / "syn"))
    _assert_same_graph(g, back)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, (
        "load_ogb wrote into the source directory"
    )


@pytest.mark.timeout(60)
def test_directed_raw_round_trip_and_reverse_edges(tmp_path):
    rng = np.random.default_rng(0)
    n = 50
    src = rng.integers(0, n, 300)
    dst = rng.integers(0, n, 300)
    src[:3] = dst[:3]  # self loops: their reverse is themselves
    g = GraphData(
        name="directed",
        num_nodes=n,
        src=src,
        dst=dst,
        feat=rng.standard_normal((n, 3)).astype(np.float32),
        label=np.where(rng.random(n) < 0.1, -1, rng.integers(0, 3, n)),
        train=np.arange(10),
        valid=np.arange(10, 20),
        test=np.arange(20, 50),
        num_classes=3,
    ).validate()
    write_ogb_raw(g, tmp_path / "d", progress=False)
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["add_inverse_edge"] == "False"
    back = load_ogb(dataset_dir=str(tmp_path / "d"))
    _assert_same_graph(g, back)
    bi = load_ogb(dataset_dir=str(tmp_path / "d"), add_reverse_edges=True)
    keep = src != dst
    exp = _edge_keys(np.r_[src, dst[keep]], np.r_[dst, src[keep]], n)
    assert np.array_equal(_edge_keys(bi.src, bi.dst, n), exp)


@pytest.mark.timeout(60)
def test_named_ogb_dataset_offline_with_files_in_place(tmp_path):
    """--dataset ogbn-arxiv works offline when ROOT/ogbn_arxiv holds the unzipped files."""
    rng = np.random.default_rng(1)
    n = 40
    g = GraphData(
        name="ogbn-arxiv",
        num_nodes=n,
        src=rng.integers(0, n, 100),
        dst=rng.integers(0, n, 100),
        feat=rng.standard_normal((n, 4)).astype(np.float32),
        label=rng.integers(0, 40, n),
        train=np.arange(20),
        valid=np.arange(20, 30),
        test=np.arange(30, 40),
        num_classes=40,
    )
    target = tmp_path / "ogb" / "ogbn_arxiv"
    write_ogb_raw(g, target, split_name="time", progress=False)  # arxiv's split is "time"
    import gzip

    with gzip.open(target / "raw" / "node_year.csv.gz", "wt") as f:  # arxiv's extra node file
        f.write("\n".join(["2020"] * n) + "\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    back = load_ogb(name="ogbn-arxiv", root=str(tmp_path / "ogb"))
    _assert_same_graph(g, back)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    bi = load_ogb(name="ogbn-arxiv", root=str(tmp_path / "ogb"), add_reverse_edges=True)
    keep = g.src != g.dst
    exp = _edge_keys(np.r_[g.src, g.dst[keep]], np.r_[g.dst, g.src[keep]], n)
    assert np.array_equal(_edge_keys(bi.src, bi.dst, n), exp)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 40),
    e=st.integers(0, 120),
    k=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
@pytest.mark.timeout(120)
def test_random_partition_property(tmp_path_factory, n, e, k, seed):
    k = min(k, n)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    g = GraphData(
        name="prop",
        num_nodes=n,
        src=rng.integers(0, n, e),
        dst=rng.integers(0, n, e),
        feat=rng.standard_normal((n, 2)).astype(np.float32),
        label=rng.integers(-1, 3, n),
        train=np.sort(perm[: n // 2]),
        valid=np.sort(perm[n // 2 : 3 * n // 4]),
        test=np.sort(perm[3 * n // 4 :]),
        num_classes=3,
    )
    out = tmp_path_factory.mktemp("prop") / "parts"
    partition_graph(g, k, out, method="random", seed=seed, progress=False)
    check_partition_set(g, out)


# ---------------------------------------------------------------------------------------
# load_ogb / load_partition errors


@pytest.mark.timeout(60)
def test_load_ogb_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_ogb(dataset_dir=str(tmp_path / "nope"))
    with pytest.raises(DatasetError, match="no meta.json"):
        load_ogb(dataset_dir=str(tmp_path))
    if (CORA / "meta.json").is_file():
        only_meta = tmp_path / "only_meta"
        only_meta.mkdir()
        shutil.copyfile(CORA / "meta.json", only_meta / "meta.json")
        with pytest.raises(DatasetError, match=r"missing .*edge\.csv\.gz"):
            load_ogb(dataset_dir=str(only_meta))
    with pytest.raises(DatasetError, match="unknown OGB dataset 'ogbn-nonexistent'.*ogbn-arxiv"):
        load_ogb(name="ogbn-nonexistent", root=str(tmp_path))
    with pytest.raises(DatasetError, match="exactly one"):
        load_ogb()


@pytest.mark.timeout(60)
def test_load_partition_bad_dirs(tmp_path):
    with pytest.raises(PartitionFormatError, match="does not exist"):
        load_partition(tmp_path / "missing", 0)
    with pytest.raises(PartitionFormatError, match="no metadata.json"):
        load_partition(tmp_path, 0)
    (tmp_path / "metadata.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(PartitionFormatError, match="not an mfgserve partition set"):
        load_partition(tmp_path, 0)
    g = generate(200, avg_degree=4, feat_dim=3, num_classes=2, progress=False)
    out = tmp_path / "parts"
    partition_graph(g, 2, out, method="random", progress=False)
    with pytest.raises(PartitionFormatError, match="part 5 does not exist"):
        load_partition(out, 5)
    (out / "part-1" / "feat.npy").unlink()
    with pytest.raises(PartitionFormatError, match="feat.npy is missing"):
        load_partition(out, 1)
    load_partition(out, 0)


# ---------------------------------------------------------------------------------------
# CLI


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "partition.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines, "no stdout"
    return json.loads(lines[-1])


@needs_cora
@pytest.mark.timeout(120)
def test_cli_cora(cora, cora_dir, tmp_path):
    out = tmp_path / "cora2"
    r = _cli("--dataset-dir", str(cora_dir), "--num-parts", "2", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    summary = _last_json(r.stdout)
    assert summary["num_parts"] == 2 and summary["num_nodes"] == 2708
    assert summary["out"] == str(out) and 0 < summary["edge_cut_frac"] < 0.3
    assert "edge cut" in r.stderr and "peak memory" in r.stderr
    assert summary["node_order"] == "degree" and "nodes by degree" in r.stderr
    check_partition_set(cora, out)
    again = _cli("--dataset-dir", str(cora_dir), "--num-parts", "2", "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr
    by_id = tmp_path / "cora2id"
    r = _cli("--dataset-dir", str(cora_dir), "--num-parts", "2", "--node-order", "id",
             "--out", str(by_id), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert _last_json(r.stdout)["node_order"] == "id"
    check_partition_set(cora, by_id)  # by original id within each part
    bad = _cli("--dataset-dir", str(cora_dir), "--node-order", "hot",
               "--out", str(tmp_path / "b"))
    assert bad.returncode == 2 and "--node-order" in bad.stderr and "degree" in bad.stderr


@pytest.mark.timeout(120)
def test_cli_synthetic(tmp_path):
    out, raw = tmp_path / "syn", tmp_path / "raw"
    r = _cli(
        "--dataset",
        "synthetic",
        "--num-nodes",
        "3000",
        "--avg-degree",
        "6",
        "--feat-dim",
        "8",
        "--num-classes",
        "3",
        "--num-parts",
        "3",
        "--method",
        "random",
        "--out",
        str(out),
        "--raw-out",
        str(raw),
        "--seed",
        "5",
    )
    assert r.returncode == 0, r.stderr
    summary = _last_json(r.stdout)
    assert summary["num_edges"] == 2 * 9000 and summary["num_parts"] == 3
    assert (raw / "meta.json").is_file() and (raw / "raw" / "edge.csv.gz").is_file()
    g = generate(3000, avg_degree=6, feat_dim=8, num_classes=3, seed=5, progress=False)
    check_partition_set(g, out)
    r = _cli(
        "--dataset",
        "synthetic",
        "--num-nodes",
        "3000",
        "--out",
        str(out),
        "--force",
        "--num-parts",
        "2",
        "--method",
        "random",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    assert PartitionSetMeta.load(out).num_parts == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--dataset-dir", "{tmp}/missing", "--out", "{tmp}/o"], "does not exist"),
        (["--dataset-dir", "{tmp}/empty", "--out", "{tmp}/o"], "no meta.json"),
        (["--dataset", "synthetic", "--num-parts", "0", "--out", "{tmp}/o"], "--num-parts 0"),
        (
            ["--dataset", "synthetic", "--dataset-dir", "{tmp}/empty", "--out", "{tmp}/o"],
            "not allowed with",
        ),
        (["--out", "{tmp}/o"], "one of the arguments --dataset --dataset-dir is required"),
        (["--dataset", "synthetic"], "--out DIR is required"),
        (["--dataset", "synthetic", "--out", "{tmp}/full"], "not a partition set"),
        (["--dataset", "cora", "--out", "{tmp}/o"], "--dataset-dir"),
        (
            ["--dataset", "ogbn-arxiv", "--num-nodes", "5", "--out", "{tmp}/o"],
            "only apply to --dataset synthetic",
        ),
        (["--dataset", "synthetic", "--homophily", "1.5", "--out", "{tmp}/o"], "--homophily"),
        (["--dataset", "synthetic", "--method", "kmeans", "--out", "{tmp}/o"], "invalid choice"),
    ],
)
def test_cli_bad_input(tmp_path, args, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "data.txt").write_text("keep me")
    r = _cli(*[a.format(tmp=tmp_path) for a in args], timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert (tmp_path / "full" / "data.txt").read_text() == "keep me"
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(60)
def test_cli_unknown_ogb_name(tmp_path):
    r = _cli("--dataset", "ogbn-nonexistent", "--root", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "unknown OGB dataset" in r.stderr and "ogbn-arxiv" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(30)
def test_cli_help_documents_every_option():
    from partition.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"option {action.option_strings} has no help"
