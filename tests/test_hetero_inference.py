"""Layer-wise full-neighbour inference (trainer_client/inference.py) on typed partition sets
and typed models, and on multi-label sets, through real sampler servers.

The reference is computed in this process without the code under test: the partition files
read back as one typed graph in global ids (every stored in-edge, per relation one CSC over
the destination type's nodes, node types from ``node_type.npy``) and the model's layers, each
over that one full-neighbour block. Layer-wise inference through two servers (2 parts) must
give the same predict-type logits, the same last hidden layer for every node type, and the
same accuracy; on a multi-label (ogbn-proteins-shaped) set the same ROC-AUC (also with a
server-held node embedding concatenated to the features). Worker-mode ``--eval full`` runs
typed models (with server-held embeddings and with derived features) and multi-label sets
end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.cluster import ClusterSpec
from common.mfg import Block, HeteroBlock
from partition.layout import PartitionSetMeta

REPO = Path(__file__).resolve().parents[1]
PAPERS = 600
CHANCE = 1 / 16

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------- the reference
def _csc(dst: np.ndarray, src: np.ndarray, num_dst: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(num_dst + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_dst), out=indptr[1:])
    return torch.from_numpy(indptr), torch.from_numpy(src[order].astype(np.int64))


class WholeTypedGraph:
    """A partition set read back as one graph: one typed block with every stored edge (or,
    for a homogeneous set, the one-type case), features, labels and splits in global ids."""

    def __init__(self, parts: Path):
        self.meta = meta = PartitionSetMeta.load(parts)
        indptr, indices, etype, feat, label = [], [], [], [], []
        for p in meta.parts:
            d = parts / p.dir
            indptr.append(np.diff(np.load(d / "indptr.npy")))
            indices.append(np.load(d / "indices.npy"))
            if meta.ntypes:
                etype.append(np.load(d / "etype.npy").astype(np.int64))
            feat.append(np.load(d / "feat.npy"))
            label.append(np.load(d / "label.npy"))
        n = meta.num_nodes
        deg = np.concatenate(indptr)
        dst = np.repeat(np.arange(n), deg)
        src = np.concatenate(indices)
        rel = np.concatenate(etype) if meta.ntypes else np.zeros(src.size, dtype=np.int64)
        node_type = (np.load(parts / "node_type.npy").astype(np.int64) if meta.ntypes
                     else np.zeros(n, dtype=np.int64))
        self.node_type = node_type
        self.ntypes = list(meta.ntypes) or [""]
        etypes = [tuple(e) for e in meta.etypes] if meta.ntypes else [("", "", "")]
        self.ids = {t: np.flatnonzero(node_type == k) for k, t in enumerate(self.ntypes)}
        pos = np.empty(n, dtype=np.int64)
        for ids in self.ids.values():
            pos[ids] = np.arange(ids.size)
        counts = {t: int(ids.size) for t, ids in self.ids.items()}
        rels = {}
        for r, (s, e, t) in enumerate(etypes):
            m = rel == r
            k_s, k_t = self.ntypes.index(s), self.ntypes.index(t)
            assert (node_type[src[m]] == k_s).all() and (node_type[dst[m]] == k_t).all()
            ip, ix = _csc(pos[dst[m]], pos[src[m]], counts[t])
            rels[(s, e, t)] = Block(ip, ix, counts[s], counts[t])
        self.block = HeteroBlock(self.ntypes, counts, counts, rels)
        self.feat = torch.from_numpy(np.concatenate(feat)).float()
        self.label = torch.from_numpy(np.concatenate(label))
        self.splits = {s: torch.from_numpy(np.concatenate(
            [np.load(parts / p.dir / f"{s}.npy") for p in meta.parts])) for s in
            ("train", "valid", "test")}
        self.predict = meta.predict_ntype if meta.ntypes else ""

    def layers(self, model, x: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every layer's output per node type (rows in type order), the model in eval mode,
        each layer over the one full-neighbour block."""
        model.eval()
        outs, h = [], x
        with torch.no_grad():
            for i in range(model.num_layers):
                h = model.forward_layer(i, self.block, h)
                outs.append(h)
        return outs

    def rows(self, h: dict[str, torch.Tensor], gids: torch.Tensor) -> torch.Tensor:
        """The rows of global ids ``gids`` (all of one type) of a per-type output."""
        k = int(self.node_type[int(gids[0])])
        t = self.ntypes[k]
        assert (self.node_type[gids.numpy()] == k).all()
        pos = np.searchsorted(self.ids[t], gids.numpy())
        return h[t][torch.from_numpy(pos)]


# ---------------------------------------------------------------------------- sets, servers
def _env(tmp: Path) -> dict:
    (tmp / "t").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp / "t"),
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(module: str, args: list, tmp: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO,
                          env=_env(tmp), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _mag(tmp: Path, out: Path, *extra) -> Path:
    raw = tmp / "raw"
    src = (["--dataset-dir", raw] if raw.exists() else
           ["--dataset", "synthetic-mag", "--num-nodes", PAPERS, "--raw-out", raw])
    r = _run("partition.cli", [*src, "--num-parts", 2, "--out", out, "--add-reverse-edges",
                               "--presample-batches", 0, "--no-progress", *extra], tmp, 240)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _proteins(tmp: Path, tasks: int = 6) -> Path:
    from partition.ogbn import load_ogb
    from partition.partitioner import partition_graph
    from partition.proteins import generate_proteins, write_proteins_raw

    raw, out = tmp / "raw-proteins", tmp / "proteins"
    write_proteins_raw(generate_proteins(400, avg_degree=8, num_tasks=tasks, seed=2), raw)
    partition_graph(load_ogb(dataset_dir=str(raw)), 2, out, "random", progress=False,
                    presample_batches=2)
    return out


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("hetinf")
    return {"mag": _mag(tmp, tmp / "mag"),
            "mag_mean": _mag(tmp, tmp / "mag-mean", "--derive-features", "mean"),
            "proteins": _proteins(tmp)}


def _servers(server_factory, parts: Path, tmp: Path) -> Path:
    """Two real servers (one per part) on ipc sockets; returns the cluster file."""
    spec = ClusterSpec({p: [f"ipc://{tmp}/h{p}.sock"] for p in range(2)})
    cluster = tmp / "cluster.yaml"
    spec.write(cluster)
    for p, ep in spec.all_endpoints():
        server_factory(parts, p, cluster=cluster, endpoint=ep)
    return cluster


def _pool(cluster: Path):
    from trainer_client.server_pool import ServerPool

    return ServerPool(ClusterSpec.load(cluster), timeout_s=60.0, max_message_bytes=64 << 20)


# ---------------------------------------------------------------------------- typed, in-process
@pytest.mark.parametrize("name,which,emb_dim", [
    ("rsage", "mag_mean", 0), ("hetero-sage", "mag_mean", 0), ("rsage", "mag", 8),
    ("hetero-sage", "mag", 8)])
def test_typed_layerwise_matches_full_graph_forward(sets, server_factory, tmp_path, name,
                                                    which, emb_dim):
    from trainer_client.hetero_model import build_hetero_model, hetero_spec
    from trainer_client.inference import LayerwiseInference, type_ranges
    from trainer_client.node_embedding import NodeEmbedding

    parts = sets[which]
    g = WholeTypedGraph(parts)
    meta = g.meta
    featureless = [t for t in meta.ntypes if t not in meta.feat_ntypes]
    assert bool(featureless) == (emb_dim > 0)
    pool = _pool(_servers(server_factory, parts, tmp_path))
    try:
        info = pool.info()
        # every part's nodes grouped by type, found through the servers
        groups = type_ranges(pool, info)
        for p, part_groups in enumerate(groups):
            lo, hi = meta.node_offsets[p], meta.node_offsets[p + 1]
            want = [(t, int(lo + np.searchsorted(g.node_type[lo:hi], k)),
                     int(lo + np.searchsorted(g.node_type[lo:hi], k, side="right")))
                    for k, t in enumerate(g.ntypes)]
            assert part_groups == [w for w in want if w[1] < w[2]]
        emb = (NodeEmbedding(pool, "test-emb", info.num_nodes, emb_dim, lr=0.01, seed=3,
                             node_offsets=info.node_offsets) if emb_dim else None)
        in_feats = {t: emb_dim if t in featureless else meta.feat_dim for t in meta.ntypes}
        torch.manual_seed(0)
        model = build_hetero_model(hetero_spec(meta, in_feats, 16, meta.num_classes, 2,
                                               dropout=0.5, name=name))
        x = {t: (emb.tensor.read(torch.from_numpy(ids)) if t in featureless
                 else g.feat[torch.from_numpy(ids)]) for t, ids in g.ids.items()}
        ref = g.layers(model, x)
        model.train()
        splits = {s: pool.seeds(s) for s in ("valid", "test")}
        job = LayerwiseInference(model, pool, info, batch_size=97, emb=emb)
        res = job.run(splits, keep_outputs=True)
        try:
            pred_ids = torch.from_numpy(g.ids[g.predict])
            logits = res.kept["logits"].read(pred_ids)
            torch.testing.assert_close(logits, ref[-1][g.predict], rtol=1e-4, atol=1e-4)
            for t, ids in g.ids.items():  # the hidden layer, every type that has one
                if t in ref[0] and ids.size:
                    torch.testing.assert_close(res.kept["emb"].read(torch.from_numpy(ids)),
                                               ref[0][t], rtol=1e-4, atol=1e-4)
        finally:
            job.drop()
        assert model.training, "inference must leave the model in its mode"
        assert res.metric == "acc" and len(res.layer_s) == 2
        for split, got in (("valid", res.valid), ("test", res.test)):
            ids = g.splits[split]
            want = int((g.rows(ref[-1], ids).argmax(1) == g.label[ids]).sum()) / ids.numel()
            assert got == pytest.approx(want, abs=1e-9)
    finally:
        pool.close()


# ---------------------------------------------------------------------------- multi-label
@pytest.mark.parametrize("emb_dim", [0, 4])
def test_multilabel_full_graph_eval_is_the_full_graph_rocauc(sets, server_factory, tmp_path,
                                                             emb_dim):
    """A homogeneous multi-label set: ROC-AUC of the full-graph output; with a server-held
    node embedding (--node-emb-dim), its rows concatenated to the features as in training."""
    from trainer_client.inference import full_graph_eval
    from trainer_client.metrics import rocauc
    from trainer_client.models import build_model
    from trainer_client.node_embedding import NodeEmbedding

    parts = sets["proteins"]
    g = WholeTypedGraph(parts)
    meta = g.meta
    assert meta.task_type == "binary"
    torch.manual_seed(0)
    model = build_model({"name": "sage", "in_feats": meta.feat_dim + emb_dim, "hidden": 16,
                         "num_classes": meta.num_tasks, "num_layers": 2, "dropout": 0.5})
    pool = _pool(_servers(server_factory, parts, tmp_path))
    try:
        info = pool.info()
        emb = (NodeEmbedding(pool, "test-emb", info.num_nodes, emb_dim, lr=0.01, seed=3,
                             node_offsets=info.node_offsets) if emb_dim else None)
        x = g.feat if emb is None else torch.cat(
            [g.feat, emb.tensor.read(torch.arange(info.num_nodes))], dim=1)
        model.eval()
        with torch.no_grad():  # the whole graph, one block with every edge, the model's forward
            ref = model([g.block.rels[("", "", "")]] * 2, x)
        splits = {s: pool.seeds(s) for s in ("valid", "test")}
        got = full_graph_eval(model, pool, info, splits, batch_size=64, device="cpu", rank=0,
                              world_size=1, progress=False, emb=emb)
    finally:
        pool.close()
    assert set(got) == {"valid_rocauc", "test_rocauc"}
    for split in ("valid", "test"):
        ids = g.splits[split]
        want = rocauc(g.label[ids].numpy(), ref[ids].numpy())
        assert got[f"{split}_rocauc"] == pytest.approx(want, abs=1e-6)


# ---------------------------------------------------------------------------- worker-mode
def _summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("which,args", [
    ("mag", ["--model", "rsage", "--node-emb-dim", 8, "--num-trainers", 2]),
    ("mag_mean", ["--model", "hetero-sage", "--num-trainers", 1])])
def test_worker_mode_eval_full_on_typed_sets(sets, tmp_path, which, args):
    s = _summary(_run("deploy.worker_mode", [
        "--parts", sets[which], "--epochs", 2, "--eval", "full", "--fanouts", "10,5",
        "--batch-size", 128, "--hidden", 32, "--dropout", 0, "--lr", 0.01, "--no-progress",
        "--work-dir", tmp_path / "w", *args], tmp_path, 380))
    assert s["model"] == args[1] and s["dataset"] == "synthetic-mag"
    assert 0.0 <= s["test_acc"] <= 1.0 and 0.0 <= s["valid_acc"] <= 1.0
    assert s["test_acc"] > CHANCE, s
    metrics = [json.loads(ln) for ln in
               Path(s["files"]["metrics"]).read_text().splitlines()]
    assert metrics[-1]["eval"] == "full" and "test_acc" in metrics[-1]


@pytest.mark.timeout(300)
def test_worker_mode_eval_full_on_a_multilabel_set(sets, tmp_path):
    s = _summary(_run("deploy.worker_mode", [
        "--parts", sets["proteins"], "--epochs", 1, "--eval", "full", "--fanouts", "5,5",
        "--batch-size", 64, "--hidden", 16, "--num-trainers", 2, "--no-progress",
        "--work-dir", tmp_path / "w"], tmp_path, 280))
    assert s["eval_metric"] == "rocauc" and "test_acc" not in s
    assert 0.0 <= s["test_rocauc"] <= 1.0 and 0.0 <= s["valid_rocauc"] <= 1.0
    metrics = [json.loads(ln) for ln in
               Path(s["files"]["metrics"]).read_text().splitlines()]
    assert metrics[-1]["eval"] == "full" and "test_rocauc" in metrics[-1]
