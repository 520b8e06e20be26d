"""The RMAT graph family (partition/rmat.py): OGB's binary raw layout read back by ogb's own
reader and by ``partition-ogbn --dataset-dir``, skewed degrees, learnable labels, clear
errors for a malformed ``data.npz``, and ``benchmarks.graphs.family_parts``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import REPO, clean_env
from rpc_helpers import call
from test_partition import check_partition_set

from common.messages import MFGReply, SampleRequest
from partition.cli import main as partition_main
from partition.graph_data import DatasetError
from partition.layout import PartitionSetMeta
from partition.ogbn import load_ogb
from partition.rmat import generate_rmat, neighbour_mean, write_ogb_binary
from partition.synthetic import generate

N = 20_000
SMALL = dict(avg_degree=20, feat_dim=16, num_classes=8, seed=3, progress=False)


@pytest.fixture(scope="module")
def rmat_graph():
    return generate_rmat(N, **SMALL)


@pytest.fixture(scope="module")
def rmat_dir(tmp_path_factory, rmat_graph) -> Path:
    return write_ogb_binary(rmat_graph, tmp_path_factory.mktemp("rmat") / "ogb",
                            progress=False)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _same_graph(a, b) -> None:
    assert a.num_nodes == b.num_nodes and a.num_classes == b.num_classes
    for f in ("src", "dst", "feat", "label", "train", "valid", "test"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


# ------------------------------------------------------------------------------ generator


def test_rmat_graph_properties(rmat_graph):
    g = rmat_graph
    n, e = g.num_nodes, g.num_edges
    assert e == 2 * round(N * SMALL["avg_degree"] / 2)  # duplicates removed and topped up
    assert g.src.dtype == g.dst.dtype == np.int64 and g.feat.dtype == np.float32
    assert g.is_interleaved_undirected() and not np.any(g.src == g.dst)
    keys = g.src[0::2] * n + g.dst[0::2]
    assert np.unique(np.minimum(keys, g.dst[0::2] * n + g.src[0::2])).size == e // 2
    g.validate()
    again = generate_rmat(N, **SMALL)
    _same_graph(g, again)
    other = generate_rmat(N, **{**SMALL, "seed": 4})
    assert not np.array_equal(g.src, other.src)
    # splits: disjoint, 10% / 5% / rest by default, train and valid nodes have neighbours
    deg = np.bincount(g.dst, minlength=n)
    assert (g.train.size, g.valid.size, g.test.size) == (2000, 1000, 17000)
    assert np.unique(np.concatenate([g.train, g.valid, g.test])).size == n
    assert deg[g.train].min() > 0 and deg[g.valid].min() > 0


def test_rmat_degrees_are_skewed_and_not_tied_to_ids(rmat_graph):
    g = rmat_graph
    deg = np.bincount(g.dst, minlength=N).astype(np.float64)
    syn = generate(N, avg_degree=20, feat_dim=4, num_classes=8, seed=3, progress=False)
    sdeg = np.bincount(syn.dst, minlength=N).astype(np.float64)
    skew, syn_skew = deg.max() / deg.mean(), sdeg.max() / sdeg.mean()
    assert skew > 3 * syn_skew, (skew, syn_skew)
    # the top 1% of nodes hold far more edge endpoints than in the synthetic graph
    top = np.sort(deg)[-N // 100:].sum() / deg.sum()
    stop = np.sort(sdeg)[-N // 100:].sum() / sdeg.sum()
    assert top > 0.15 and top > 1.5 * stop, (top, stop)
    assert np.median(deg[deg > 0]) >= 2  # skewed, not degenerate (a star)
    # ids permuted: degree does not fall with id as in plain RMAT (node 0 the largest)
    from scipy.stats import spearmanr

    corr = spearmanr(deg, np.arange(N)).statistic  # ties ranked by their mean
    assert abs(corr) < 0.05, corr
    # noise 0 (plain RMAT) oscillates; the noisy graph is still as skewed
    plain = generate_rmat(N, **{**SMALL, "seed": 3}, noise=0.0)
    pdeg = np.bincount(plain.dst, minlength=N)
    assert pdeg.max() / pdeg.mean() > 3 * syn_skew


def _ridge_acc(z: np.ndarray, g, train, test) -> float:
    z = np.hstack([z, np.ones((z.shape[0], 1), np.float32)])
    y = np.eye(g.num_classes, dtype=np.float32)[g.label]
    w = np.linalg.solve(z[train].T @ z[train] + 1e-2 * np.eye(z.shape[1]), z[train].T @ y[train])
    return float((np.argmax(z[test] @ w, 1) == g.label[test]).mean())


def test_rmat_labels_need_the_graph():
    g = generate_rmat(N, **SMALL, train_frac=0.3)
    deg = np.bincount(g.dst, minlength=N)
    test = g.test[deg[g.test] > 0]
    mean = neighbour_mean(g.src, g.dst, g.feat, N)
    own = _ridge_acc(g.feat, g, g.train, test)
    both = _ridge_acc(np.hstack([g.feat, mean]), g, g.train, test)
    majority = np.bincount(g.label[test]).max() / test.size
    assert both > own + 0.1 and both > 3 * majority, (own, both, majority)
    assert np.bincount(g.label, minlength=8).min() > N / 8 / 4  # no empty / tiny class


def test_rmat_argument_errors():
    for kw, word in [(dict(a=0.7, b=0.2, c=0.2), r"a \+ b \+ c"), (dict(noise=0.3), "noise"),
                     (dict(train_frac=0.9, valid_frac=0.2), "train_frac"),
                     (dict(num_nodes=1), "num_nodes")]:
        args = {**SMALL, **kw}
        with pytest.raises(DatasetError, match=word):
            generate_rmat(args.pop("num_nodes", 100), **args)


# ------------------------------------------------------------------------------ OGB binary layout


@pytest.mark.timeout(60)
def test_binary_layout_round_trips_through_ogb(rmat_graph, rmat_dir, tmp_path):
    from ogb.io.read_graph_raw import read_binary_graph_raw
    from ogb.nodeproppred import NodePropPredDataset

    g = rmat_graph
    meta = json.loads((rmat_dir / "meta.json").read_text())
    assert meta["binary"] == "True" and meta["add_inverse_edge"] == "False"
    assert (rmat_dir / "RELEASE_v1.txt").is_file()
    raw = read_binary_graph_raw(str(rmat_dir / "raw"))[0]
    assert raw["edge_index"].shape == (2, g.num_edges) and raw["num_nodes"] == N
    assert np.array_equal(raw["edge_index"][0], g.src)
    assert np.array_equal(raw["node_feat"], g.feat)
    # ogb's dataset class itself, offline, on a copy it may write processed/ into
    work = _copy(rmat_dir, tmp_path / "work")
    (work / "processed").mkdir()
    ds = NodePropPredDataset(name=meta["name"], meta_dict={**meta, "dir_path": str(work)})
    graph, labels = ds[0]
    assert np.array_equal(graph["edge_index"][1], g.dst)
    assert np.array_equal(labels.reshape(-1), g.label)
    split = ds.get_idx_split()
    for s in ("train", "valid", "test"):
        assert np.array_equal(np.sort(np.asarray(split[s])), g.split(s))
    # and partition-ogbn's loader returns the very same graph
    _same_graph(load_ogb(dataset_dir=str(rmat_dir)), g)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partition.cli", *args], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=150,
                          stdin=subprocess.DEVNULL)


def _last_json(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.strip()][-1])


@pytest.mark.timeout(180)
def test_partition_ogbn_rmat_and_dataset_dir(rmat_graph, rmat_dir, tmp_path):
    # --dataset rmat with --raw-out and --out: generated, written, read back through ogb
    raw, out2 = tmp_path / "raw", tmp_path / "p2"
    r = _cli("--dataset", "rmat", "--num-nodes", str(N), "--avg-degree", "20", "--feat-dim",
             "16", "--num-classes", "8", "--seed", "3", "--raw-out", str(raw), "--out",
             str(out2), "--num-parts", "2", "--presample-batches", "0", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = _last_json(r.stdout)
    assert summary["num_parts"] == 2 and summary["num_edges"] == rmat_graph.num_edges
    assert summary["raw_out"] == str(raw) and "Traceback" not in r.stderr
    assert (raw / "raw" / "data.npz").is_file()
    check_partition_set(rmat_graph, out2)
    # --dataset-dir on the binary layout, 1 part (in process: the same main)
    out1 = tmp_path / "p1"
    assert partition_main(["--dataset-dir", str(rmat_dir), "--out", str(out1),
                           "--presample-batches", "0", "--no-progress"]) == 0
    meta = check_partition_set(rmat_graph, out1)
    assert meta.num_parts == 1 and meta.dataset == rmat_graph.name


def _rewrite_npz(d: Path, **members) -> None:
    with np.load(d / "raw" / "data.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(members)
    np.savez(d / "raw" / "data.npz", **{k: v for k, v in arrays.items() if v is not None})


@pytest.mark.timeout(60)
def test_malformed_data_npz_exits_2_naming_the_member(rmat_dir, tmp_path, capfd):
    e = int(np.load(rmat_dir / "raw" / "data.npz")["num_edges_list"][0])
    cases = [
        ("missing", dict(num_nodes_list=None, num_nodes=np.array([N])), "num_nodes_list"),
        ("stray", dict(label=np.zeros(3)), "'label'"),
        ("shape", dict(edge_index=np.zeros((3, e), np.int64)), "edge_index has shape"),
        ("count", dict(num_edges_list=np.array([e - 1])), "num_edges_list says"),
        ("feat", dict(node_feat=np.zeros((N - 1, 4), np.float32)), "node_feat has shape"),
    ]
    for name, members, words in cases:
        d = _copy(rmat_dir, tmp_path / name)
        _rewrite_npz(d, **members)
        code = partition_main(["--dataset-dir", str(d), "--out", str(tmp_path / f"o-{name}"),
                               "--no-progress"])
        err = capfd.readouterr().err
        assert code == 2, (name, err)
        assert words in err and "data.npz" in err and "Traceback" not in err, (name, err)
        assert not (tmp_path / f"o-{name}").exists()
    d = _copy(rmat_dir, tmp_path / "nolabel")
    np.savez(d / "raw" / "node-label.npz", labels=np.zeros((N, 1)))
    with pytest.raises(DatasetError, match="node_label"):
        load_ogb(dataset_dir=str(d))
    d = _copy(rmat_dir, tmp_path / "gone")
    (d / "raw" / "data.npz").unlink()
    with pytest.raises(DatasetError, match="binary=True.*--dataset rmat --raw-out"):
        load_ogb(dataset_dir=str(d))
    (d / "raw" / "data.npz").write_bytes(b"not a zip")
    with pytest.raises(DatasetError, match="cannot read .*npz"):
        load_ogb(dataset_dir=str(d))


@pytest.mark.parametrize("argv, words", [
    (["--dataset", "rmat", "--homophily", "0.5"], "--homophily only apply to --dataset synthetic"),
    (["--dataset", "synthetic", "--rmat-a", "0.5"], "--rmat-a only apply to --dataset rmat"),
    (["--dataset", "rmat", "--rmat-a", "0.7", "--rmat-b", "0.2", "--rmat-c", "0.2"], "a + b + c"),
    (["--dataset", "rmat", "--rmat-noise", "0.5"], "--rmat-noise 0.5 must be within"),
    (["--dataset", "rmat", "--train-frac", "0.9", "--valid-frac", "0.1"], "--train-frac"),
    (["--dataset", "rmat", "--add-reverse-edges"], "--add-reverse-edges does not apply"),
    (["--dataset-dir", "/nonexistent", "--rmat-noise", "0"], "only apply to --dataset"),
])
def test_rmat_option_errors(argv, words, tmp_path, capfd):
    assert partition_main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capfd.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_rmat_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as ex:
        partition_main(["--help"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--rmat-a", "--rmat-b", "--rmat-c", "--rmat-noise", "--train-frac",
                 "--valid-frac", "'rmat'"):
        assert flag in out, flag


# ------------------------------------------------------------------------------ benchmarks


@pytest.mark.timeout(120)
def test_family_parts_rmat_serves_batches(tmp_path, server_factory):
    from benchmarks.graphs import family_parts, rmat_tag

    args = argparse.Namespace(synthetic_nodes=3000, avg_degree=12.0, feat_dim=8,
                              num_classes=5, train_frac=0.1, eval_frac=0.05, seed=1,
                              cache_dir=str(tmp_path / "cache"))
    parts = family_parts("rmat", args)
    meta = PartitionSetMeta.load(parts)
    assert meta.num_parts == 1 and meta.num_nodes == 3000 and meta.num_edges == 2 * 18000
    assert meta.feat_dim == 8 and meta.parts[0].num_train == 300
    assert meta.parts[0].num_valid == meta.parts[0].num_test == 150
    raw = [p for p in (tmp_path / "cache").iterdir() if p.name.endswith("-ogb")]
    assert len(raw) == 1 and json.loads((raw[0] / "meta.json").read_text())["binary"] == "True"
    stamp = os.stat(parts / "metadata.json").st_mtime_ns
    assert family_parts("rmat", args) == parts  # cached
    assert os.stat(parts / "metadata.json").st_mtime_ns == stamp
    # every setting that changes the graph names a different cache entry
    tags = {rmat_tag(argparse.Namespace(**{**vars(args), k: v}), 3000) for k, v in
            [("rmat_noise", 0.0), ("rmat_a", 0.5), ("seed", 2), ("avg_degree", 10.0),
             ("feat_dim", 4), ("num_classes", 3), ("train_frac", 0.2), ("eval_frac", 0.1)]}
    assert len(tags) == 8 and rmat_tag(args, 3000) not in tags
    products = family_parts("products", args)
    assert products != parts and PartitionSetMeta.load(products).num_nodes == 3000
    with pytest.raises(ValueError, match="unknown graph family"):
        family_parts("kronecker", args)
    # a sampler server loads the set and serves a batch
    server = server_factory(parts)
    seeds = torch.arange(0, 64, dtype=torch.int64)
    reply = call(server.endpoint, SampleRequest(seeds=seeds, fanouts=[5, 5]), MFGReply)
    assert reply.mfg is not None
    server.stop_and_check()
