"""Issue 11, multi-label (ogbn-proteins-shaped) datasets, partition side: the generator writes
ogbn-proteins' raw layout, partition-ogbn reads it back through ogb (labels [N, T] with NaN
unknown, node features = reduction of the incoming edges' features), writes 2-D labels into
every part (halo too), and refuses a wrong layout with exit code 2."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from procs import REPO, clean_env

from partition.graph_data import DatasetError, GraphData
from partition.layout import PartitionSetMeta, load_partition
from partition.ogbn import META_KEYS, load_ogb
from partition.proteins import SPECIES, generate_proteins, write_proteins_raw

pytestmark = pytest.mark.timeout(180)


def _read(path: Path) -> np.ndarray:
    return pd.read_csv(path, compression="gzip", header=None).to_numpy()


@pytest.fixture(scope="module")
def prot_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prot") / "raw_proteins"
    write_proteins_raw(generate_proteins(600, avg_degree=10, num_tasks=5, seed=3), out)
    return out


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partition.cli", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=150, cwd=REPO,
                          env=clean_env(), stdin=subprocess.DEVNULL)


def test_layout_matches_ogbn_proteins(prot_dir):
    raw = prot_dir / "raw"
    names = sorted(p.name for p in raw.iterdir())
    assert names == ["edge-feat.csv.gz", "edge.csv.gz", "node-label.csv.gz",
                     "node_species.csv.gz", "num-edge-list.csv.gz", "num-node-list.csv.gz"]
    assert sorted(p.name for p in (prot_dir / "split" / "species").iterdir()) == [
        "test.csv.gz", "train.csv.gz", "valid.csv.gz"]
    meta = json.loads((prot_dir / "meta.json").read_text())
    # every key ogb's master.csv gives ogbn-proteins, with its values (num tasks: ours)
    spec = importlib.util.find_spec("ogb")
    master = Path(next(iter(spec.submodule_search_locations))) / "nodeproppred" / "master.csv"
    rows = list(csv.reader(open(master, newline="")))
    col = rows[0].index("ogbn-proteins")
    ogb_meta = {r[0]: r[col] for r in rows[1:]}
    assert set(META_KEYS) <= set(meta)
    for k, v in ogb_meta.items():
        if k not in ("num tasks", "download_name", "url"):
            assert str(meta[k]) == v, k
    assert meta["num tasks"] == 5
    edges, ef = _read(raw / "edge.csv.gz"), _read(raw / "edge-feat.csv.gz")
    assert edges.shape[1] == 2 and ef.shape == (edges.shape[0], 8)
    assert ef.min() >= 0.001 and ef.max() <= 1.0
    labels = _read(raw / "node-label.csv.gz")
    assert labels.shape == (600, 5) and set(np.unique(labels)) <= {0, 1}
    species = _read(raw / "node_species.csv.gz").reshape(-1)
    assert set(species) <= set(SPECIES)
    split = {s: _read(prot_dir / "split" / "species" / f"{s}.csv.gz").reshape(-1)
             for s in ("train", "valid", "test")}
    # the split is by species: no species in two splits
    sp = {s: set(species[ids]) for s, ids in split.items()}
    assert not (sp["train"] & sp["valid"]) and not (sp["train"] & sp["test"])
    assert not (sp["valid"] & sp["test"])
    assert sum(len(v) for v in split.values()) == 600


def test_round_trip_through_ogb(prot_dir):
    g = load_ogb(dataset_dir=str(prot_dir))
    raw = prot_dir / "raw"
    edges, ef = _read(raw / "edge.csv.gz"), _read(raw / "edge-feat.csv.gz")
    labels = _read(raw / "node-label.csv.gz").astype(np.float32)
    assert (g.task_type, g.num_tasks, g.eval_metric) == ("binary", 5, "rocauc")
    assert g.label.dtype == np.float32 and np.array_equal(g.label, labels)
    assert g.is_interleaved_undirected() and g.num_edges == 2 * edges.shape[0]
    # node feature = mean of the incoming edges' features (numpy reference from the files)
    n = g.num_nodes
    dst = np.concatenate([edges[:, 1], edges[:, 0]])
    both = np.concatenate([ef, ef]).astype(np.float64)
    ref = np.zeros((n, 8))
    np.add.at(ref, dst, both)
    deg = np.bincount(dst, minlength=n)
    ref /= np.maximum(deg, 1)[:, None]
    np.testing.assert_allclose(g.feat, ref, rtol=1e-5, atol=1e-6)
    g_sum = load_ogb(dataset_dir=str(prot_dir), edge_feat_to_node="sum",
                     node_species="onehot")
    np.testing.assert_allclose(g_sum.feat[:, :8], ref * np.maximum(deg, 1)[:, None],
                               rtol=1e-5, atol=1e-5)
    species = _read(raw / "node_species.csv.gz").reshape(-1)
    onehot = g_sum.feat[:, 8:]
    assert onehot.shape[1] == len(np.unique(species))
    assert np.array_equal(np.unique(species)[onehot.argmax(1)], species)
    assert np.array_equal(g.test, np.sort(_read(prot_dir / "split/species/test.csv.gz")[:, 0]))


def test_validate_checks_multilabels():
    n = 4
    kw = dict(name="t", num_nodes=n, src=np.array([0, 1]), dst=np.array([1, 0]),
              feat=np.zeros((n, 2), np.float32), train=np.array([0]), valid=np.array([1]),
              test=np.array([2]), num_classes=2, task_type="binary", num_tasks=3,
              eval_metric="rocauc")
    lab = np.zeros((n, 3), np.float32)
    lab[0, 1] = np.nan
    GraphData(label=lab, **kw).validate()
    with pytest.raises(DatasetError, match="0, 1 or NaN"):
        GraphData(label=lab + 2, **kw).validate()
    with pytest.raises(DatasetError, match="float32"):
        GraphData(label=lab[:, :2].copy(), **kw).validate()
    with pytest.raises(DatasetError, match="rocauc"):
        GraphData(label=lab, **dict(kw, eval_metric="acc")).validate()


@pytest.mark.parametrize("method,parts,halo", [("metis", 2, 1), ("random", 3, 0)])
def test_partition_writes_2d_labels(prot_dir, tmp_path, method, parts, halo):
    out = tmp_path / "parts"
    proc = _cli(["--dataset-dir", str(prot_dir), "--num-parts", str(parts), "--method", method,
                 "--halo-hops", str(halo), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["task_type"], summary["num_tasks"], summary["eval_metric"]) == (
        "binary", 5, "rocauc")
    meta = PartitionSetMeta.load(out)
    assert (meta.task_type, meta.num_tasks, meta.eval_metric, meta.feat_dim) == (
        "binary", 5, "rocauc", 8)
    g = load_ogb(dataset_dir=str(prot_dir))
    orig_to_new = np.load(out / "orig_to_new.npy")
    new_to_orig = np.argsort(orig_to_new)
    for p in range(parts):
        part = load_partition(out, p)
        assert part.label.dtype == np.float32 and part.label.shape == (part.num_nodes, 5)
        np.testing.assert_array_equal(part.label, g.label[part.orig_ids])
        np.testing.assert_array_equal(part.feat, g.feat[part.orig_ids])
        if halo:
            assert part.halo_label.shape == (part.halo_nodes.shape[0], 5)
            np.testing.assert_array_equal(part.halo_label,
                                          g.label[new_to_orig[part.halo_nodes]])


def test_generated_directly(tmp_path):
    """--dataset synthetic-proteins: generated, written (--raw-out) and partitioned."""
    raw, out = tmp_path / "raw", tmp_path / "parts"
    proc = _cli(["--dataset", "synthetic-proteins", "--num-nodes", "300", "--avg-degree", "6",
                 "--num-tasks", "4", "--raw-out", str(raw), "--num-parts", "2", "--method",
                 "random", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["num_tasks"] == 4 and summary["num_nodes"] == 300
    assert (raw / "raw" / "edge-feat.csv.gz").is_file()
    assert PartitionSetMeta.load(out).num_tasks == 4


@pytest.mark.parametrize("case", ["no-edge-feat", "no-species", "no-features-at-all",
                                  "none-without-node-feat", "streaming", "label-width"])
def test_wrong_layout_exits_2(prot_dir, tmp_path, case):
    bad = tmp_path / "bad"
    shutil.copytree(prot_dir, bad)
    args = ["--dataset-dir", str(bad), "--out", str(tmp_path / "o")]
    if case == "no-edge-feat":
        (bad / "raw" / "edge-feat.csv.gz").unlink()
        words = ["edge-feat.csv.gz", "synthetic-proteins"]
    elif case == "no-species":
        (bad / "raw" / "node_species.csv.gz").unlink()
        words = ["node_species.csv.gz", "missing"]
    elif case == "no-features-at-all":
        (bad / "raw" / "edge-feat.csv.gz").unlink()
        meta = json.loads((bad / "meta.json").read_text())
        meta["has_edge_attr"] = "False"
        (bad / "meta.json").write_text(json.dumps(meta))
        words = ["--edge-feat-to-node mean|sum", "has neither node features"]
    elif case == "none-without-node-feat":
        args += ["--edge-feat-to-node", "none"]
        words = ["--edge-feat-to-node mean", "no node features"]
    elif case == "streaming":
        args += ["--method", "fennel", "--num-parts", "2"]
        words = ["multi-label", "--method metis or random"]
    else:
        meta = json.loads((bad / "meta.json").read_text())
        meta["num tasks"] = 7
        (bad / "meta.json").write_text(json.dumps(meta))
        words = ["labels have shape", "num tasks"]
    proc = _cli(args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr[-2000:])
    assert not (tmp_path / "o").exists()


def test_generator_is_learnable_and_deterministic():
    a = generate_proteins(2000, avg_degree=20, num_tasks=6, seed=1)
    b = generate_proteins(2000, avg_degree=20, num_tasks=6, seed=1)
    assert np.array_equal(a.edge_feat, b.edge_feat) and np.array_equal(a.label, b.label)
    # a linear probe on the mean incident edge features already beats chance on every task
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    from partition.proteins import mean_incident

    src = np.concatenate([a.src, a.dst])
    dst = np.concatenate([a.dst, a.src])
    h = mean_incident(src, dst, np.concatenate([a.edge_feat, a.edge_feat]), a.num_nodes)
    aucs = []
    for t in range(a.num_tasks):
        clf = LogisticRegression(max_iter=200).fit(h[a.train], a.label[a.train, t])
        aucs.append(roc_auc_score(a.label[a.test, t], clf.predict_proba(h[a.test])[:, 1]))
    assert min(aucs) > 0.6, aucs


def test_csv_is_gzip_text(prot_dir):
    with gzip.open(prot_dir / "raw" / "node-label.csv.gz", "rt") as f:
        first = f.readline().strip().split(",")
    assert len(first) == 5 and set(first) <= {"0", "1"}


def test_ogbn_proteins_by_name_offline(tmp_path):
    """--dataset ogbn-proteins with the raw files already under --root (as its zip unpacks:
    the species file is raw/species.csv.gz, which ogb renames): read with ogb's own meta."""
    src = tmp_path / "gen"
    write_proteins_raw(generate_proteins(300, avg_degree=6, num_tasks=112, seed=4), src)
    dst = tmp_path / "root" / "ogbn_proteins"
    shutil.copytree(src / "raw", dst / "raw")
    shutil.copytree(src / "split", dst / "split")
    (dst / "raw" / "node_species.csv.gz").rename(dst / "raw" / "species.csv.gz")
    (dst / "RELEASE_v1.txt").write_text("v1")
    g = load_ogb(name="ogbn-proteins", root=str(tmp_path / "root"))
    assert (g.task_type, g.num_tasks, g.eval_metric, g.feat_dim) == ("binary", 112, "rocauc", 8)
    assert np.array_equal(g.label, _read(src / "raw" / "node-label.csv.gz").astype(np.float32))
    assert (dst / "raw" / "species.csv.gz").is_file()  # the source is never written
