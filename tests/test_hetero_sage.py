"""``--model hetero-sage`` (DGL's HeteroGraphConv of SAGEConv, trainer_client.hetero_model.
HeteroSAGE) end to end: worker mode on a small generated ogbn-mag-shaped set (reverse
relations, featureless types from server-held embeddings), 2 parts and 2 trainers (DDP: the
relations without sampled edges leave parameters unused); the saved best model rebuilds as
hetero-sage; and ``benchmarks.dgl_hetero --mfgserve`` trains DGL's HeteroGraphConv and
mfgserve's hetero-sage on one set in one command.

The model's agreement with DGL (init, outputs, gradients) is tests/test_hetero_model.py's.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_hetero_train import BAR, TRAIN, _partition, _run, _summary


@pytest.fixture(scope="module")
def mag2(tmp_path_factory):
    """The generated mag-shaped set (2,000 papers) in 2 parts."""
    tmp = tmp_path_factory.mktemp("mag_hs")
    return _partition(tmp, tmp / "p2", 2)


@pytest.mark.timeout(300)
def test_worker_mode_two_parts_two_trainers(mag2, tmp_path):
    from trainer_client.hetero_model import HeteroSAGE
    from trainer_client.inference import load_model_file
    from trainer_client.models import build_model

    run = tmp_path / "run"
    s = _summary(_run("deploy.worker_mode",
                      ["--parts", mag2, *TRAIN, "--model", "hetero-sage", "--epochs", 2,
                       "--num-trainers", 2, "--node-emb-dim", 16, "--run-dir", run],
                      tmp_path, timeout=240))
    assert s["model"] == "hetero-sage" and s["config"]["model"] == "hetero-sage"
    assert s["num_parts"] == 2 and s["num_trainers"] == 2 and s["epochs_done"] == 2
    assert s["test_acc"] > BAR, s
    assert s["shm_ring"]["used"] and s["node_embedding"]["dim"] == 16
    saved = load_model_file(run / "best_model.pt")
    spec = saved["model_spec"]
    assert spec["name"] == "hetero-sage" and spec["in_feats"]["author"] == 16
    model = build_model(spec)
    assert isinstance(model, HeteroSAGE)
    model.load_state_dict(saved["state_dict"])  # strict: the same keys and shapes
    assert any(".mods." in k for k in saved["state_dict"])
    assert all(torch.isfinite(v).all() for v in saved["state_dict"].values())


@pytest.mark.timeout(300)
def test_dgl_hetero_mfgserve_compares_in_one_command(mag2, tmp_path):
    proc = _run("benchmarks.dgl_hetero",
                ["--parts", mag2, "--epochs", 1, "--fanouts", "10,5", "--hidden", 32,
                 "--batch-size", 128, "--mfgserve", "--work-dir", tmp_path / "w"],
                tmp_path, timeout=240)
    out = _summary(proc)
    assert out["dgl"]["model"] == "HeteroGraphConv(SAGEConv)"
    assert out["dgl"]["emb_optimizer"] == "sparse-adam"
    m = out["mfgserve"]
    assert m["model"] == "hetero-sage" and m["num_parts"] == 2
    assert out["test_acc_diff"] == pytest.approx(m["test_acc"] - out["dgl"]["test_acc"],
                                                 abs=1e-4)
    # the same settings on the mfgserve side (worker mode's config.json)
    cfg = json.loads((tmp_path / "w" / next((tmp_path / "w").iterdir()).name
                      / "config.json").read_text())
    cfg = cfg.get("trainer", cfg)
    for key, want in [("model", "hetero-sage"), ("fanouts", [10, 5]), ("hidden", 32),
                      ("batch_size", 128), ("epochs", 1), ("dropout", 0.0),
                      ("node_emb_dim", 128), ("lr", 3e-3), ("weight_decay", 5e-4)]:
        assert cfg[key] == want, (key, cfg[key])
