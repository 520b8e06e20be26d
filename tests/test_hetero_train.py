"""Typed (heterogeneous) training end to end (issue 11): a tiny ogbn-mag-shaped graph from the
generator (partition/maggen.py) partitioned by partition-ogbn, served by the sampler servers
(typed MFGs, per-relation fanouts) and trained by worker-mode with the relational GraphSAGE
(``--model rsage``, the default on a typed set).

The generated labels need the relations (a paper's own features name its class only half of
the time; authors, topics and citations carry the rest), 16 classes: chance is 0.0625.
Featureless types (author, institution, field_of_study) train with server-held learnable
embeddings (``--node-emb-dim``) or with features derived at partition time
(``--derive-features mean``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import clean_env, free_ports, tail

from common.cluster import ClusterSpec

REPO = Path(__file__).resolve().parents[1]
PAPERS = 2000
CHANCE = 1 / 16
BAR = 0.3  # clearly above chance after a couple of tiny epochs (measured 0.5-0.75)
TRAIN = ["--fanouts", "10,5", "--batch-size", "128", "--hidden", "32", "--dropout", "0",
         "--lr", "0.01", "--no-progress"]


def _env(tmp: Path) -> dict:
    run_tmp = tmp / "t"
    run_tmp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(run_tmp),
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(module: str, args: list, tmp: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO,
                          env=_env(tmp), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    assert lines, "nothing on stdout"
    return json.loads(lines[-1])


def _partition(tmp: Path, out: Path, num_parts: int, *extra) -> Path:
    raw = tmp / "raw"
    src = (["--dataset-dir", raw] if raw.exists() else
           ["--dataset", "synthetic-mag", "--num-nodes", PAPERS, "--raw-out", raw])
    r = _run("partition.cli", [*src, "--num-parts", num_parts, "--out", out,
                               "--add-reverse-edges", "--presample-batches", 0,
                               "--no-progress", *extra], tmp, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def mag(tmp_path_factory) -> dict[str, Path]:
    """One generated raw dataset, partitioned into 1, 2 and 4 parts (the last with derived
    features for every type)."""
    tmp = tmp_path_factory.mktemp("mag")
    return {"p1": _partition(tmp, tmp / "p1", 1),
            "p2": _partition(tmp, tmp / "p2", 2),
            "p4_mean": _partition(tmp, tmp / "p4m", 4, "--derive-features", "mean")}


def _worker(parts: Path, args: list, tmp: Path, timeout: float = 240) -> dict:
    proc = _run("deploy.worker_mode", ["--parts", parts, *TRAIN, *args], tmp, timeout)
    s = _summary(proc)
    assert s["model"] == "rsage" and s["dataset"] == "synthetic-mag"
    return s


@pytest.mark.timeout(400)
def test_one_part_embeddings_ring_checkpoint_and_resume(mag, tmp_path):
    """Featureless types from server-held embeddings, features through the ring; the run
    checkpoints (embedding rows and optimizer state included) and a resumed run continues."""
    run = tmp_path / "run"
    args = ["--num-trainers", 1, "--node-emb-dim", 16, "--run-dir", run,
            "--checkpoint-every", 1]
    s = _worker(mag["p1"], [*args, "--epochs", 2], tmp_path)
    assert s["test_acc"] > BAR, s
    assert s["shm_ring"]["used"] and s["shm_ring"]["replies_in_ring"] > 0
    emb = s["node_embedding"]
    assert emb["dim"] == 16 and emb["bytes_per_server"]["0"] > 0
    assert emb["ntypes"] == ["author", "field_of_study", "institution"]
    assert s["num_parts"] == 1 and s["epochs_done"] == 2
    # Without the ring the same batches are sampled (deterministic sampling) and their
    # features come in frames: the same training, so each type's rows were split right.
    w = _worker(mag["p1"], ["--num-trainers", 1, "--node-emb-dim", 16, "--epochs", 2,
                            "--no-shm-ring", "--run-dir", tmp_path / "wire"], tmp_path)
    assert w["shm_ring"] is None
    assert w["final_loss"] == pytest.approx(s["final_loss"], rel=1e-3, abs=1e-4)
    assert w["valid_acc"] == pytest.approx(s["valid_acc"], abs=0.002)
    r = _worker(mag["p1"], [*args, "--epochs", 3, "--resume"], tmp_path)
    assert r["resumed_from"].endswith("epoch-000002.pt"), r
    assert r["epochs_done"] == 3 and r["test_acc"] > BAR
    epochs = [json.loads(ln)["epoch"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1, 2]


@pytest.mark.timeout(300)
def test_two_parts_two_trainers_without_ring(mag, tmp_path):
    s = _worker(mag["p2"], ["--num-trainers", 2, "--epochs", 2, "--node-emb-dim", 16,
                            "--no-shm-ring", "--rel-fanouts", "cites=3/cites=2"], tmp_path)
    assert s["test_acc"] > BAR, s
    assert s["num_parts"] == 2 and s["num_trainers"] == 2
    assert s["shm_ring"] is None
    assert s["server_to_server_requests"] > 0  # sampled across the part boundary
    assert set(s["node_embedding"]["bytes_per_server"]) == {"0", "1"}


@pytest.mark.timeout(300)
def test_four_parts_derived_features(mag, tmp_path):
    """--derive-features mean: every type has features, so no embedding is needed (and
    --node-emb-dim is refused as pointless)."""
    s = _worker(mag["p4_mean"], ["--num-trainers", 2, "--epochs", 2], tmp_path)
    assert s["test_acc"] > BAR, s
    assert s["num_parts"] == 4 and s["node_embedding"] is None
    assert s["shm_ring"]["used"]
    proc = _run("deploy.worker_mode", ["--parts", mag["p4_mean"], *TRAIN, "--epochs", 1,
                                       "--node-emb-dim", 8], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "drop --node-emb-dim" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(300)
def test_typed_model_at_medium_precision(mag, tmp_path):
    """``--matmul-precision medium`` with a typed model (hetero-sage): each destination
    type's sum of products and the projections take this CPU's bfloat16 route (counted in
    ``bf16_products_run``; none where the CPU has neither route) and training still learns."""
    from trainer_client.model import medium_products

    s = _summary(_run("deploy.worker_mode", [
        "--parts", mag["p4_mean"], *TRAIN, "--num-trainers", 1, "--epochs", 2, "--model",
        "hetero-sage", "--matmul-precision", "medium"], tmp_path, timeout=240))
    assert s["model"] == "hetero-sage" and s["test_acc"] > BAR, s
    route = medium_products()
    assert s["matmul_precision"] == "medium" and s["bf16_products"] == route
    assert s["bf16_products_run"] == ({} if route is None else
                                      {route: s["bf16_products_run"][route]})
    assert route is None or s["bf16_products_run"][route] > 0, s


@pytest.mark.timeout(200)
@pytest.mark.parametrize("args,needle", [
    (["--model", "sage"], "use --model rsage"),
    (["--rel-fanouts", "nosuchrel=3/cites=2"], "does not have; its relations"),
])
def test_bad_options_on_a_typed_set_are_refused_clearly(mag, tmp_path, args, needle):
    proc = _run("deploy.worker_mode", ["--parts", mag["p1"], *TRAIN, "--epochs", 1, *args],
                tmp_path, timeout=150)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr.split("error")[-1]


@pytest.mark.timeout(300)
def test_server_client_mode_over_tcp(mag, server_factory, tmp_path):
    """The same trainer against long-lived sampler-server processes on TCP (2 parts)."""
    ports = free_ports(2)
    cluster = tmp_path / "cluster.yaml"
    ClusterSpec({p: [f"tcp://127.0.0.1:{ports[p]}"] for p in (0, 1)}).write(cluster)
    servers = [server_factory(mag["p2"], p, cluster=cluster,
                              endpoint=f"tcp://127.0.0.1:{ports[p]}") for p in (0, 1)]
    out, err = tmp_path / "t.out", tmp_path / "t.err"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(
            [str(a) for a in [sys.executable, "-m", "deploy.trainer_cli", "--cluster", cluster,
                              *TRAIN, "--epochs", 2, "--node-emb-dim", 16, "--world-size", 1,
                              "--num-threads", 1, "--run-dir", tmp_path / "run"]], stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
            cwd=REPO, env=clean_env())
        try:
            code = proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert code == 0, tail(err, 40)
    s = json.loads(out.read_text().strip().splitlines()[-1])
    assert s["model"] == "rsage" and s["num_parts"] == 2 and s["test_acc"] > BAR, s
    for p, srv in enumerate(servers):
        assert srv.proc.poll() is None, f"server {p} died:\n{tail(srv.log)}"


# --------------------------------------------------------------------------- no processes
class _Info:
    """A typed set's ping reply, as the trainer reads it."""

    def __init__(self, featured=("paper",)):
        from common.messages import NodeTypeInfo, RelationInfo

        self.dataset, self.feat_dim = "mag", 8
        self.ntypes = [NodeTypeInfo(t, t in featured) for t in ("author", "paper")]
        self.etypes = [RelationInfo("author", "writes", "paper"),
                       RelationInfo("paper", "cites", "paper"),
                       RelationInfo("paper", "rev_writes", "author")]
        self.predict_ntype = "paper"


def test_rel_fanouts_table_model_choice_and_widths():
    from common.config import TrainerConfig
    from common.errors import ConfigError
    from trainer_client.inference import refuse_typed
    from trainer_client.typed import in_feats, model_name, rel_fanout_table, ring_fanouts

    info = _Info()
    assert rel_fanout_table([10, 5], "", info) == [[10, 10, 10], [5, 5, 5]]
    assert rel_fanout_table([10, 5], "cites=3:writes=-1/rev_writes=0", info) == [
        [-1, 3, 10], [5, 5, 0]]
    cfg = TrainerConfig(cluster="/c", fanouts=[10, 5], rel_fanouts="cites=3/")
    assert ring_fanouts(cfg, info, cfg.fanouts) == [23, 15]
    assert model_name(cfg, info) == "rsage"
    with pytest.raises(ConfigError, match="its relations"):
        rel_fanout_table([10, 5], "nope=3/", info)
    for bad in ("cites=3", "cites=x/", "cites/", "cites=1:cites=2/"):
        with pytest.raises(ConfigError, match="--rel-fanouts"):
            TrainerConfig(cluster="/c", fanouts=[10, 5], rel_fanouts=bad).validate()
    with pytest.raises(ConfigError, match="use --model rsage"):
        model_name(TrainerConfig(cluster="/c", model="gcn"), info)
    emb = TrainerConfig(cluster="/c", node_emb_dim=4)
    assert in_feats(emb, info) == {"author": 4, "paper": 8}
    assert in_feats(TrainerConfig(cluster="/c"), info) == {"author": 8, "paper": 8}
    with pytest.raises(ConfigError, match="mfgserve-infer does not export typed"):
        refuse_typed("sage", info)  # --eval full runs typed sets (test_hetero_inference.py)
    TrainerConfig(cluster="/c", model="rsage", eval="full", node_emb_dim=8).validate()
