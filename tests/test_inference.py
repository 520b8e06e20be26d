"""Layer-wise full-neighbour inference through real sampler servers (mfgserve-infer as a real
process): every node covered exactly once, logits / embeddings / predictions equal to one
process computing the same model on the whole graph (one block with every edge, the same
layer code), the same accuracy; full_graph_eval over two torch.distributed ranks gives that
accuracy too; bad model files and cluster files exit 2 with a message naming the problem.

Run as a script (``python tests/test_inference.py rank ...``) this file is one rank of the
two-rank full_graph_eval test.
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
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from common.cluster import ClusterSpec  # noqa: E402
from common.mfg import Block  # noqa: E402
from partition.layout import PartitionSetMeta  # noqa: E402
from trainer_client.checkpoint import save_best_model  # noqa: E402
from trainer_client.models import build_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------- the reference
class WholeGraph:
    """A partition set read back as one graph in global ids: one block with every edge."""

    def __init__(self, parts: Path):
        self.meta = meta = PartitionSetMeta.load(parts)
        arrays: dict[str, list[np.ndarray]] = {k: [] for k in
                                               ("indptr", "indices", "feat", "label", "orig")}
        edges = 0
        for p in meta.parts:
            d = parts / p.dir
            indptr = np.load(d / "indptr.npy")
            arrays["indptr"].append(indptr[1:] + edges)
            edges += int(indptr[-1])
            for key, name in (("indices", "indices"), ("feat", "feat"), ("label", "label"),
                              ("orig", "orig_ids")):
                arrays[key].append(np.load(d / f"{name}.npy"))
        n = meta.num_nodes
        indptr = np.concatenate([[0], *arrays["indptr"]]).astype(np.int64)
        self.block = Block(torch.from_numpy(indptr),
                           torch.from_numpy(np.concatenate(arrays["indices"])), n, n)
        self.feat = torch.from_numpy(np.concatenate(arrays["feat"])).float()
        self.label = torch.from_numpy(np.concatenate(arrays["label"]))
        self.orig_ids = np.concatenate(arrays["orig"])
        self.splits = {s: torch.from_numpy(np.concatenate(
            [np.load(parts / p.dir / f"{s}.npy") for p in meta.parts])) for s in
            ("train", "valid", "test")}

    def layers(self, model) -> list[torch.Tensor]:
        """Every layer's output over all nodes, in eval mode."""
        model.eval()
        outs, h = [], self.feat
        with torch.no_grad():
            for i in range(model.num_layers):
                h = model.forward_layer(i, self.block, h)
                outs.append(h)
        return outs

    def accuracy(self, logits: torch.Tensor, split: str) -> float:
        ids = self.splits[split]
        return int((logits[ids].argmax(1) == self.label[ids]).sum()) / ids.numel()


def train_model(graph: WholeGraph, spec: dict, epochs: int, seed: int = 0):
    """A model trained full-batch on the whole graph (fast on Cora/CiteSeer)."""
    torch.manual_seed(seed)
    model = build_model(spec)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    train = graph.splits["train"]
    for _ in range(epochs):
        model.train()
        logits = model([graph.block] * model.num_layers, graph.feat)
        loss = F.cross_entropy(logits[train], graph.label[train])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def save_model(path: Path, model, spec: dict, meta: PartitionSetMeta) -> None:
    """The model file as training writes it (trainer_client.checkpoint)."""
    save_best_model(path, model, spec, 0, 0.0, meta.set_id, meta.dataset)


# ---------------------------------------------------------------------------- fixtures
def _partition(data_dir: Path, out: Path) -> Path:
    from partition.ogbn import load_ogb
    from partition.partitioner import partition_graph

    partition_graph(load_ogb(dataset_dir=str(data_dir)), 2, str(out), method="metis", seed=0,
                    progress=False)
    return out


class Cluster:
    """Two real servers (one per part) on ipc sockets, stopped and checked at the end."""

    def __init__(self, parts: Path, tmp: Path):
        from procs import ServerProcess

        self.parts, self.graph = parts, WholeGraph(parts)
        spec = ClusterSpec({p: [f"ipc://{tmp}/s{p}.sock"] for p in range(2)})
        self.file = tmp / "cluster.yaml"
        spec.write(self.file)
        self.servers = [ServerProcess(parts, p, ep, self.file, tmp, [])
                        for p, ep in spec.all_endpoints()]
        for s in self.servers:
            s.wait_ready()

    def stop(self) -> None:
        from procs import stop_all

        stop_all(self.servers)


def _cluster(tmp_path_factory, data_dir: Path, name: str):
    tmp = tmp_path_factory.mktemp(name)
    cluster = Cluster(_partition(data_dir, tmp / "parts"), tmp)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def cora(tmp_path_factory, cora_dir):
    yield from _cluster(tmp_path_factory, cora_dir, "cora")


@pytest.fixture(scope="module")
def citeseer(tmp_path_factory, citeseer_dir):
    yield from _cluster(tmp_path_factory, citeseer_dir, "citeseer")


def infer(args: list, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.infer_cli", "--no-progress",
                           *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, stdin=subprocess.DEVNULL)


def _spec(graph: WholeGraph, name: str, layers: int, **extra) -> dict:
    return {"name": name, "in_feats": graph.meta.feat_dim, "hidden": 16,
            "num_classes": graph.meta.num_classes, "num_layers": layers, "dropout": 0.5,
            **extra}


# ---------------------------------------------------------------------------- outputs
def _load_outputs(out: Path) -> tuple[dict, dict[str, np.ndarray]]:
    index = json.loads((out / "index.json").read_text())
    arrays: dict[str, list] = {}
    for entry in index["parts"]:
        lo, hi = entry["global_ids"]
        for name, f in entry["files"].items():
            a = np.load(out / f["path"])
            assert list(a.shape) == f["shape"] and a.dtype.name == f["dtype"], (name, f)
            assert a.shape[0] == hi - lo
            arrays.setdefault(name, []).append(a)
    return index, {k: np.concatenate(v) for k, v in arrays.items()}


def _check_against_reference(cluster: Cluster, model, out: Path, summary: dict) -> None:
    g = cluster.graph
    index, got = _load_outputs(out)
    n = g.meta.num_nodes
    ranges = [e["global_ids"] for e in index["parts"]]
    assert ranges == [[g.meta.node_offsets[p], g.meta.node_offsets[p + 1]] for p in range(2)]
    # every node exactly once: the original ids are a permutation of the dataset's
    assert index["orig_ids"] == "dataset"
    assert np.array_equal(np.sort(got["orig_ids"]), np.arange(n))
    assert np.array_equal(got["orig_ids"], g.orig_ids)
    outs = g.layers(model)
    ref = outs[-1]
    np.testing.assert_allclose(got["logits"], ref.numpy(), rtol=1e-4, atol=1e-4)
    if model.num_layers > 1:
        np.testing.assert_allclose(got["emb"], outs[-2].numpy(), rtol=1e-4, atol=1e-4)
    assert np.array_equal(got["pred"], got["logits"].argmax(1))
    top2 = ref.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1] > 1e-3).numpy()  # no float near-tie
    assert np.array_equal(got["pred"][clear], ref.argmax(1).numpy()[clear])
    for split in ("valid", "test"):
        want = g.accuracy(ref, split)
        assert index["full_graph"][f"{split}_acc"] == pytest.approx(want, abs=1e-9)
        assert summary[f"{split}_acc"] == pytest.approx(want, abs=1e-4)


@pytest.mark.timeout(300)
def test_cora_sage_matches_whole_graph(cora, tmp_path):
    """A GraphSAGE trained on Cora: inference through two servers equals the whole-graph
    computation; the sampled accuracy of the run's summary.json is carried into the index."""
    g = cora.graph
    spec = _spec(g, "sage", 2)
    model = train_model(g, spec, epochs=25)
    run = tmp_path / "run"
    run.mkdir()
    save_model(run / "best_model.pt", model, spec, g.meta)
    (run / "summary.json").write_text(json.dumps({"valid_acc": 0.5, "test_acc": 0.25,
                                                  "best_epoch": 3}))
    proc = infer(["--cluster", cora.file, "--run-dir", run, "--parts", cora.parts,
                  "--batch-size", 300])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    out = run / "inference"
    assert summary["out"] == str(out) and summary["num_layers"] == 2
    assert len(summary["layer_s"]) == 2 and summary["nodes_per_s"] > 0
    assert sorted(summary["files"]) == sorted(
        f"part-{p}/{k}.npy" for p in range(2) for k in ("pred", "logits", "emb", "orig_ids"))
    _check_against_reference(cora, model, out, summary)
    index = json.loads((out / "index.json").read_text())
    assert index["sampled"] == {"valid_acc": 0.5, "test_acc": 0.25, "best_epoch": 3,
                                "eval": "sampled"}
    assert index["model_spec"] == spec
    assert g.accuracy(g.layers(model)[-1], "test") > 0.7  # a trained model, not noise


@pytest.mark.timeout(300)
def test_bfloat16_matmuls_match_whole_graph_within_their_error(cora, tmp_path):
    """``--matmul-precision medium`` (bfloat16 products where the CPU has them, the layers'
    rows bucketed): the same outputs as the float32 whole-graph computation within
    bfloat16's error, the same predictions where they are clear."""
    from trainer_client.model import medium_products

    g = cora.graph
    spec = _spec(g, "sage", 2)
    model = train_model(g, spec, epochs=25)
    path = tmp_path / "m.pt"
    save_model(path, model, spec, g.meta)
    out = tmp_path / "out"
    proc = infer(["--cluster", cora.file, "--model", path, "--out", out, "--parts",
                  cora.parts, "--batch-size", 300, "--matmul-precision", "medium"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["matmul_precision"] == "medium"
    assert summary["bf16_products"] == medium_products()
    route = medium_products()  # the model's products took it, or none did
    assert summary["bf16_products_run"] == ({} if route is None else
                                            {route: summary["bf16_products_run"][route]})
    assert route is None or summary["bf16_products_run"][route] > 0, summary
    _, got = _load_outputs(out)
    ref = g.layers(model)[-1]
    err = np.abs(got["logits"] - ref.numpy()).max() / np.abs(ref.numpy()).max()
    assert err < (3e-2 if medium_products() else 1e-4), err
    top2 = ref.topk(2, dim=1).values
    clear = ((top2[:, 0] - top2[:, 1]) > 0.1 * top2[:, 0].abs().clamp(min=1)).numpy()
    assert clear.mean() > 0.5
    assert np.array_equal(got["pred"][clear], ref.argmax(1).numpy()[clear])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,layers,message_mb", [("gat", 2, 1), ("sage", 3, 8)])
def test_citeseer_models_match_whole_graph(citeseer, tmp_path, name, layers, message_mb):
    """GAT (heads concatenated in the hidden layer) and a 3-layer GraphSAGE (one hidden
    layer's tensor freed, the last kept as the embeddings) on CiteSeer, with a small
    --max-message-mb: features and node tensor rows travel in many rounds (1 MiB: 35
    feature rows a round).

    (Not GCN: its normalisation uses each source's out-degree within the block, as
    dgl.nn.GraphConv does on blocks, so a batch's block gives another answer than the
    whole graph.)"""
    g = citeseer.graph
    spec = _spec(g, name, layers, **({"heads": 2} if name == "gat" else {}))
    model = train_model(g, spec, epochs=15)
    path = tmp_path / "m.pt"
    save_model(path, model, spec, g.meta)
    out = tmp_path / "out"
    proc = infer(["--cluster", citeseer.file, "--model", path, "--out", out, "--parts",
                  citeseer.parts, "--batch-size", 500, "--max-message-mb", message_mb])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["sampled"] is None
    _check_against_reference(citeseer, model, out, summary)


# ---------------------------------------------------------------------------- bad input
def _expect_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mfgserve-infer: error:"), proc.stderr[-3000:]
    for needle in needles:
        assert needle in last, last
    assert "Traceback" not in proc.stderr


def test_missing_model_file(cora, tmp_path):
    _expect_exit_2(infer(["--cluster", cora.file, "--run-dir", tmp_path / "no-run"]),
                   "best_model.pt", "does not exist")


def test_not_a_model_file(cora, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    _expect_exit_2(infer(["--cluster", cora.file, "--model", bad, "--out", tmp_path / "o"]),
                   "cannot read model file")
    torch.save({"format": "something-else"}, bad)
    _expect_exit_2(infer(["--cluster", cora.file, "--model", bad, "--out", tmp_path / "o"]),
                   "not an mfgserve model file")


def test_model_of_another_graph(cora, citeseer, tmp_path):
    """A CiteSeer model on the Cora servers: feature dim, classes and partition set named."""
    g = citeseer.graph
    spec = _spec(g, "sage", 2)
    path = tmp_path / "citeseer.pt"
    save_model(path, build_model(spec), spec, g.meta)
    _expect_exit_2(infer(["--cluster", cora.file, "--model", path, "--out", tmp_path / "o"]),
                   "input features 3703", "feature dim is 1433", "6 classes",
                   "has 7", "partition set")
    assert not (tmp_path / "o").exists()


def test_replicas_refused(cora, tmp_path):
    spec = _spec(cora.graph, "sage", 1)
    path = tmp_path / "m.pt"
    save_model(path, build_model(spec), spec, cora.graph.meta)
    eps = ClusterSpec.load(cora.file).partitions
    replicated = tmp_path / "replicated.yaml"
    ClusterSpec({0: [*eps[0], f"ipc://{tmp_path}/other.sock"], 1: eps[1]}).write(replicated)
    _expect_exit_2(infer(["--cluster", replicated, "--model", path, "--out", tmp_path / "o"]),
                   "exactly one server per part")


def test_wrong_parts_dir(cora, citeseer, tmp_path):
    spec = _spec(cora.graph, "sage", 1)
    path = tmp_path / "m.pt"
    save_model(path, build_model(spec), spec, cora.graph.meta)
    _expect_exit_2(infer(["--cluster", cora.file, "--model", path, "--out", tmp_path / "o",
                          "--parts", citeseer.parts]), "pass the directory the servers")


# ---------------------------------------------------------------------------- two ranks
def _rank_main(rank: int, port: int, cluster_file: str, model_file: str, out: str) -> None:
    """One rank of the two-rank test: full_graph_eval through the servers, result to out."""
    import torch.distributed as dist

    from trainer_client.inference import full_graph_eval, load_model_file, model_from_file
    from trainer_client.server_pool import ServerPool

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    pool = ServerPool(ClusterSpec.load(cluster_file), timeout_s=60.0,
                      max_message_bytes=64 << 20)
    info = pool.info()
    splits = {s: pool.seeds(s) for s in ("valid", "test")}
    model = model_from_file(load_model_file(model_file), torch.device("cpu"))
    model.train()
    acc = full_graph_eval(model, pool, info, splits, batch_size=200, device="cpu", rank=rank,
                          world_size=2, progress=False)
    assert model.training, "full_graph_eval must leave the model in its mode"
    Path(out).write_text(json.dumps(acc))
    pool.close()
    dist.destroy_process_group()


def test_full_graph_eval_two_ranks(cora, tmp_path):
    """Two torch.distributed ranks share every part's nodes: each returns the whole-graph
    valid/test accuracy."""
    from procs import clean_env, communicate_all, free_ports

    g = cora.graph
    spec = _spec(g, "sage", 2)
    model = train_model(g, spec, epochs=20)
    path = tmp_path / "m.pt"
    save_model(path, model, spec, g.meta)
    port = free_ports(1)[0]
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(port),
                               str(cora.file), str(path), str(outs[r])], cwd=REPO,
                              env=clean_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = communicate_all(procs, timeout=180)
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    ref = g.layers(model)[-1]
    for out in outs:
        acc = json.loads(out.read_text())
        assert acc["valid_acc"] == pytest.approx(g.accuracy(ref, "valid"), abs=1e-9)
        assert acc["test_acc"] == pytest.approx(g.accuracy(ref, "test"), abs=1e-9)


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    a = sys.argv[2:]
    _rank_main(int(a[0]), int(a[1]), a[2], a[3], a[4])


# ---------------------------------------------------------------------------- worker-mode
@pytest.mark.timeout(420)
def test_worker_mode_infer_stage(cora, tmp_path):
    """worker-mode --infer: after training, inference through the same servers writes the
    run directory's inference/ files, and the final JSON names them next to the sampled
    accuracy of the same best model."""
    work = tmp_path / "work"
    env_tmp = tmp_path / "t"
    env_tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.worker_mode", "--parts", str(cora.parts), "--work-dir",
         str(work), "--epochs", "2", "--batch-size", "256", "--hidden", "16", "--no-progress",
         "--infer"], capture_output=True, text=True, timeout=400, cwd=REPO,
        stdin=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(env_tmp)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    inf = summary["inference"]
    run_dir = Path(summary["run_dir"])
    assert Path(inf["out"]) == run_dir / "inference" or Path(inf["out"]).resolve() == (
        run_dir / "inference").resolve()
    index, got = _load_outputs(Path(inf["out"]))
    assert np.array_equal(np.sort(got["orig_ids"]), np.arange(cora.graph.meta.num_nodes))
    assert index["sampled"]["test_acc"] == summary["test_acc"]
    assert 0.0 <= inf["test_acc"] <= 1.0 and len(inf["layer_s"]) == 2
