"""benchmarks.run (issue 14): per-dropout rows on both sides with the seed model as the
headline, per-family keys, the 2-trainer DDP comparison, bad options. No timings asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import run as bench_run

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    """One small run: products family, dropout 0 and 0.5 on both sides (DGL num_workers 0),
    two rounds of those end-to-end rows, and the ddp step; the heavy or unrelated steps
    skipped."""
    tmp = tmp_path_factory.mktemp("bench-run")
    argv = [sys.executable, "-m", "benchmarks.run", "--synthetic-nodes", "20000",
            "--max-batches", "3", "--family", "products", "--dropout", "0,0.5",
            "--dgl-workers", "0", "--rounds", "2",
            "--skip", "dgl-sample,server,wire,step,datapath,limits,hetero,multilabel",
            "--cache-dir", str(tmp / "cache"), "--worker-work-dir", str(tmp / "wm"),
            "--worker-timeout-s", "200", "--out", str(tmp / "out.json")]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    assert json.loads((tmp / "out.json").read_text()) == out
    out["_stderr"] = proc.stderr
    return out


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_dropout_rows_on_both_sides_and_seed_model_headline(summary):
    assert summary["families"] == ["products"]
    assert summary["errors"] == {}
    assert set(summary["graphs"]) == {"products"}
    assert summary["config"]["dropouts"] == [0.0, 0.5]
    assert summary["config"]["headline_dropout"] == 0.0
    assert summary["config"]["prefetch"] == "auto"  # worker-mode's default, recorded
    res = summary["results"]["products"]
    for d, p in (("d0", 0.0), ("d0.5", 0.5)):
        dgl, ours = res[f"dgl_train_w0_{d}"], res[f"worker_mode_{d}"]
        assert dgl["dropout"] == p and ours["dropout"] == p
        assert dgl["seeds_per_s"] > 0 and ours["seeds_per_s"] > 0
        assert ours["exit_code"] == 0
        assert ours["prefetch"]["mode"] == "auto"  # and what the trainer made of it
    ratios = summary["ratios"]["products"]
    for d in ("d0", "d0.5"):
        assert ratios[f"train_seeds_per_s_{d}"] > 0
        assert ratios[f"train_baseline_{d}"] == f"dgl_train_w0_{d}"
    head = summary["headline"]
    assert head["label"] == "seed model (no dropout)" and head["dropout"] == 0.0
    assert head["train_seeds_per_s"]["products"] == ratios["train_seeds_per_s_d0"]
    rows = summary["comparison"]
    assert [r["label"] for r in rows] == ["seed model (no dropout)", "dropout 0.5",
                                          "seed model (no dropout), 2 trainers"]
    assert all(r["family"] == "products" for r in rows)
    # the headline row leads the table too
    table = summary["_stderr"]
    assert table.index("products: seed model (no dropout)") < table.index("products: dropout 0.5")


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_every_row_records_the_load_and_the_cpu_time_other_guests_took(summary):
    """Each measurement keeps the evidence of what else ran: the load average and the share
    of the machine's CPU time stolen by its hypervisor (a share, not a ratio of the sides)."""
    assert 0.0 <= summary["machine"]["cpu_steal_share"] <= 1.0
    assert isinstance(summary["machine"]["cpu_flags"], list) and "cpu_family" in summary["machine"]
    for name, row in summary["results"]["products"].items():
        assert len(row["loadavg_1m"]) == 2, name
        assert 0.0 <= row["cpu_steal_share"] <= 1.0, name
    assert not any("steal" in k for k in summary["ratios"]["products"])
    assert "cpu steal" in summary["_stderr"]


def test_steal_share_is_steal_over_all_cpu_time_between_two_readings():
    from benchmarks.report import cpu_times, steal_share

    now = cpu_times()
    assert now is not None and "steal" in now._fields and all(x >= 0 for x in now)
    zero = now._replace(**{f: 0.0 for f in now._fields})
    before = zero._replace(user=1.0, system=0.5, idle=8.0, steal=0.5)
    # 7.5 s between them, 1 s stolen; guest time is within user, not counted again
    after = zero._replace(user=4.0, system=1.0, idle=11.0, steal=1.5, guest=2.0)
    assert steal_share(before, after) == round(100 / 750, 4)
    assert steal_share(before, before) is None  # no time between them
    assert steal_share(None, after) is None and steal_share(before, None) is None


def test_cpu_identity_names_family_model_and_the_gemm_flags():
    """A VM's model name may be only "AMD EPYC": the summary also keeps the first CPU's
    vendor, family, model and the instruction sets the products' library depends on."""
    from benchmarks.report import cpu_identity

    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2 sha_ni\n\n"
            "processor\t: 1\nvendor_id\t: Other\ncpu family\t: 26\nflags\t\t: avx512f\n")
    assert cpu_identity(text) == {"cpu": "AMD EPYC", "cpu_vendor": "AuthenticAMD",
                                  "cpu_family": 23, "cpu_model_number": 1,
                                  "cpu_flags": ["avx2", "fma"]}
    assert cpu_identity("") == {"cpu": "", "cpu_vendor": "", "cpu_family": None,
                                "cpu_model_number": None, "cpu_flags": []}
    here = cpu_identity()
    assert set(here["cpu_flags"]) <= {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_rounds_alternate_sides_and_ratio_is_the_median_of_paired_ratios(summary):
    assert summary["config"]["rounds"] == 2
    res, ratios = summary["results"]["products"], summary["ratios"]["products"]
    log = summary["_stderr"]
    for d in ("d0", "d0.5"):
        dgl = [res[f"dgl_train_w0_{d}"], res[f"dgl_train_w0_{d}_r2"]]
        ours = [res[f"worker_mode_{d}"], res[f"worker_mode_{d}_r2"]]
        assert all(x["seeds_per_s"] > 0 for x in dgl + ours)
        assert all(x["exit_code"] == 0 for x in ours)
        paired = [round(o["seeds_per_s"] / g["seeds_per_s"], 3) for g, o in zip(dgl, ours)]
        assert ratios[f"train_seeds_per_s_{d}_rounds"] == paired
        assert ratios[f"train_seeds_per_s_{d}"] == pytest.approx(sum(paired) / 2, abs=1e-3)
        # round 2 ran worker mode first, round 1 DGL first (the progress log's order)
        assert log.index(f"products/dgl_train_w0_{d}: start") < \
            log.index(f"products/worker_mode_{d}: start")
        assert log.index(f"products/worker_mode_{d}_r2: start") < \
            log.index(f"products/dgl_train_w0_{d}_r2: start")
    rows = {r["label"]: r for r in summary["comparison"]}
    head = rows["seed model (no dropout)"]
    assert head["rounds"] == ratios["train_seeds_per_s_d0_rounds"]
    assert head["mfgserve_seeds_per_s"] == pytest.approx(
        (res["worker_mode_d0"]["seeds_per_s"] + res["worker_mode_d0_r2"]["seeds_per_s"]) / 2,
        abs=0.1)
    assert "rounds' ratios" in log  # the table's extra column


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_ddp_step_two_processes_each_side_same_total_batch(summary):
    res = summary["results"]["products"]
    dgl, ours = res["dgl_ddp2_d0"], res["worker_mode_t2_d0"]
    assert dgl["num_procs"] == 2 and dgl["backend"] == "gloo"
    assert dgl["exit_codes"] == [0, 0] and [r["rank"] for r in dgl["ranks"]] == [0, 1]
    assert all(r["batches"] >= 1 for r in dgl["ranks"])
    assert dgl["per_process_batch_size"] == 512 and dgl["total_batch_size"] == 1024
    assert ours["num_trainers"] == 2 and ours["exit_code"] == 0
    assert ours["batch_size_per_trainer"] == 512 and ours["total_batch_size"] == 1024
    assert dgl["seeds_per_s"] > 0 and ours["seeds_per_s"] > 0
    assert summary["ratios"]["products"]["ddp_seeds_per_s_d0"] > 0
    assert summary["headline"]["ddp_seeds_per_s"]["products"] > 0


@pytest.mark.parametrize("argv, needle", [
    (["--dropout", "0,abc"], "--dropout"),
    (["--dropout", "1"], "[0, 1)"),
    (["--dropout", ","], "--dropout"),
    (["--family", "products,foo"], "unknown graph family 'foo'"),
    (["--parts", "/nonexistent", "--family", "rmat"], "--family"),
    (["--batch-size", "1023"], "--ddp-procs"),
    (["--num-threads", "0"], "--num-threads"),
    (["--rounds", "0"], "--rounds"),
    (["--multilabel-epochs", "0"], "--multilabel-epochs: expected an integer >= 1"),
    (["--multilabel-nodes", "x"], "--multilabel-nodes: expected an integer >= 8"),
    (["--multilabel-degree", "-1"], "--multilabel-degree: expected a number >= 0"),
])
def test_bad_values_exit_2_naming_the_option(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench_run.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_dgl_model_is_the_seed_model_with_mfgserve_init():
    """Same weights as mfgserve's GraphSAGE from the same seed; ReLU between layers, none
    after the last; at dropout 0 the dropout is the identity (no copy)."""
    from benchmarks.dgl_pipeline import DGLGraphSAGE
    from trainer_client.model import GraphSAGE

    torch.manual_seed(7)
    ours = GraphSAGE(12, 16, 5, 3, 0.0)
    after_ours = torch.rand(3)
    torch.manual_seed(7)
    theirs = DGLGraphSAGE(12, 16, 5, 3, 0.0)
    assert torch.equal(torch.rand(3), after_ours)  # the RNG ends where mfgserve's does
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert type(theirs.dropout) is type(ours.dropout)
    x = torch.randn(10, 16)
    theirs.train()
    assert theirs.dropout(x) is x
    assert all(layer._aggre_type == "mean" and layer.activation is None
               for layer in theirs.layers)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_hetero_step_both_sides_on_one_typed_graph(tmp_path):
    """The heterogeneous step alone: DGL's HeteroGraphConv(SAGEConv) and worker-mode rsage on
    the same generated mag-shaped set; both train, the ratio and accuracy difference are
    reported (no timing asserted)."""
    argv = [sys.executable, "-m", "benchmarks.run", "--synthetic-nodes", "2000",
            "--family", "products", "--dgl-workers", "0",
            "--skip", "dgl-train,dgl-sample,server,worker,ddp,wire,step,datapath,limits,"
            "multilabel",
            "--hetero-papers", "1500", "--hetero-epochs", "1", "--hetero-fanouts", "5,5",
            "--batch-size", "256", "--hidden", "32",
            "--cache-dir", str(tmp_path / "cache"), "--worker-timeout-s", "200"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    h = out["hetero"]
    assert out["errors"] == {}
    assert h["graph"]["papers"] == 1500 and len(h["graph"]["ntypes"]) == 4
    assert len(h["graph"]["relations"]) == 7  # 4 relations + 3 rev_* (cites symmetrised)
    assert h["dgl"]["seeds"] > 0 and h["dgl"]["seeds_per_s"] > 0
    assert h["dgl"]["model"] == "mfgserve RelGraphSAGE"  # the ratio's baseline: same model
    assert h["dgl_heteroconv"]["seeds_per_s"] > 0 and h["ratio_vs_heteroconv"] > 0
    assert h["mfgserve"]["seeds_per_s"] > 0 and h["mfgserve"]["model"] == "rsage"
    assert 0 <= h["dgl"]["test_acc"] <= 1 and 0 <= h["mfgserve"]["test_acc"] <= 1
    assert h["ratio"] > 0 and h["acc_diff"] is not None
    assert "heterogeneous (1,500-paper" in proc.stderr


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_multilabel_step_pairs_both_sides_on_one_proteins_shaped_graph(tmp_path):
    """The multi-label step alone: DGL's pipeline (its best over --dgl-workers) and worker
    mode train the seed model on the same generated proteins-shaped set (112 binary tasks),
    in two rounds with the first side alternating; the ratio is the median of the rounds'
    ratios and each side's test ROC-AUC is reported (no timing asserted)."""
    argv = [sys.executable, "-m", "benchmarks.run", "--synthetic-nodes", "2000",
            "--family", "products", "--dgl-workers", "0,1", "--rounds", "2",
            "--skip", "dgl-train,dgl-sample,server,worker,ddp,wire,step,datapath,limits,"
            "hetero",
            "--multilabel-nodes", "2000", "--multilabel-degree", "20",
            "--multilabel-epochs", "1", "--fanouts", "5,5", "--batch-size", "256",
            "--hidden", "32", "--cache-dir", str(tmp_path / "cache"),
            "--worker-timeout-s", "200"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errors"] == {}
    ml = out["multilabel"]
    g = ml["graph"]
    assert g["nodes"] == 2000 and g["num_tasks"] == 112 and g["feat_dim"] == 8
    assert ml["dropout"] == 0.0 and ml["fanouts"] == [5, 5] and ml["epochs"] == 1
    assert [r["first"] for r in ml["rounds"]] == ["DGL", "mfgserve"]
    for r in ml["rounds"]:
        assert set(r["dgl"]) == {"0", "1"}  # each --dgl-workers value (JSON keys)
        for w, d in r["dgl"].items():
            assert d["num_workers"] == int(w) and d["dropout"] == 0.0
            assert d["seeds_per_s"] > 0 and 0 <= d["test_rocauc"] <= 1
        best = max(r["dgl"].values(), key=lambda d: d["seeds_per_s"])
        m = r["mfgserve"]
        assert m["exit_code"] == 0 and m["dropout"] == 0.0 and m["seeds_per_s"] > 0
        assert 0 <= m["test_rocauc"] <= 1
        assert r["ratio"] == round(m["seeds_per_s"] / best["seeds_per_s"], 3)
    assert ml["round_ratios"] == [r["ratio"] for r in ml["rounds"]]
    assert ml["ratio"] == pytest.approx(sum(ml["round_ratios"]) / 2, abs=1e-3)  # median of two
    assert "DGL warm-up (2 batches, untimed)" in proc.stderr
    assert "multi-label (synthetic-proteins-2000: 2,000 nodes" in proc.stderr


def test_a_medium_row_takes_dgls_best_of_medium_autocast_and_float32():
    """A row at matmul precision medium is compared with DGL's best at that dropout over
    medium, medium under torch.autocast (bfloat16) and highest; a run not made (autocast
    is CPU-only) is skipped. Pure bookkeeping: no process is started."""
    args = bench_run.build_parser().parse_args(["--dgl-workers", "0,1", "--rounds", "2"])
    names = bench_run.dgl_names(args, "d0_medium", "_r2")
    assert names == ["dgl_train_w0_d0_medium_r2", "dgl_train_w1_d0_medium_r2",
                     "dgl_train_w0_d0_medium-autocast_r2",
                     "dgl_train_w1_d0_medium-autocast_r2",
                     "dgl_train_w0_d0_r2", "dgl_train_w1_d0_r2"]
    assert bench_run.dgl_names(args, "d0") == ["dgl_train_w0_d0", "dgl_train_w1_d0"]
    results = {"dgl_train_w0_d0_medium": {"seeds_per_s": 100.0},
               "dgl_train_w0_d0_medium-autocast": {"seeds_per_s": 150.0},
               "dgl_train_w0_d0": {"seeds_per_s": 120.0},
               "worker_mode_d0_medium": {"seeds_per_s": 180.0},
               "dgl_train_w0_d0_medium_r2": {"seeds_per_s": 100.0},
               "dgl_train_w0_d0_r2": {"seeds_per_s": 90.0},
               "worker_mode_d0_medium_r2": {"seeds_per_s": 200.0}}
    assert bench_run.round_ratios(results, args, "d0_medium") == [1.2, 2.0]
