"""``mfgserve-infer``: layer-wise full-neighbour inference of a trained model over every node.

Loads a ``best_model.pt`` (``torch.load(weights_only=True)``), checks it against the running
servers (feature dim, classes, partition set), runs :class:`trainer_client.inference.
LayerwiseInference` through them and writes, under ``--out`` (default RUN_DIR/inference)::

    part-K/pred.npy      int64   [n_K]        argmax class of each node the part owns
    part-K/logits.npy    float32 [n_K, C]     the final layer's output
    part-K/emb.npy       float32 [n_K, H]     the last hidden layer's output (the final
                                              layer's input); absent for a 1-layer model
    part-K/orig_ids.npy  int64   [n_K]        original dataset id of each row (with --parts;
                                              otherwise the global id: index.json says which)
    index.json           parts, global id ranges, files with shapes and dtypes, the model
                         spec, full-graph valid/test accuracy, and the sampled accuracy of the
                         training run (RUN_DIR/summary.json) to compare

Row i of part K's files is global node ``node_offsets[K] + i``: every node once. The last
stdout line is a JSON summary (files, accuracies, seconds per layer, nodes/s). Exit codes
(common/cli.py): 0 done, 2 bad input (a missing or incompatible model file, a cluster file
with replicas, unreachable servers, ...), 1 unexpected.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common.cli import run_main
from common.config import InferConfig, add_config_args, load_config
from common.errors import ConfigError
from common.jsonout import dumps_strict
from partition.layout import PartitionFormatError, PartitionSetMeta

PROG = "mfgserve-infer"
INDEX_FORMAT = "mfgserve-inference/1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Layer-wise full-neighbour inference of a trained model through the "
                    "running sampler servers (DistDGL-style, layer outputs held by the "
                    "servers): writes pred/logits/emb/orig_ids .npy per part and index.json, "
                    "and prints a JSON summary as the last stdout line.")
    p.add_argument("--config", help="YAML file with these options (command-line options "
                   "override it)")
    add_config_args(p, InferConfig)
    return p


def resolve_paths(cfg: InferConfig) -> tuple[Path, Path]:
    """(model file, output directory) from --model/--out or the run directory."""
    run = Path(cfg.run_dir) if cfg.run_dir else None
    model = Path(cfg.model) if cfg.model else run / "best_model.pt"  # type: ignore[operator]
    out = Path(cfg.out) if cfg.out else run / "inference"  # type: ignore[operator]
    return model, out


def check_cluster(pool) -> None:
    replicated = sorted(p for p, eps in pool.cluster.partitions.items() if len(eps) > 1)
    if replicated:
        raise ConfigError(f"the cluster file lists several servers for parts {replicated}; "
                          "inference keeps each layer's outputs on the servers, one copy per "
                          "part: pass a cluster file with exactly one server per part")


def original_ids(parts: str, info) -> tuple[dict[int, np.ndarray] | None, str]:
    """Each part's original dataset ids from the partition set at ``parts`` (checked to be
    the servers' set), and what ``orig_ids.npy`` holds: "dataset" or "global"."""
    if not parts:
        return None, "global"
    try:
        meta = PartitionSetMeta.load(parts)
    except PartitionFormatError as e:
        raise ConfigError(f"--parts: {e}") from e
    if meta.set_id != info.set_id:
        raise ConfigError(f"--parts {parts} is partition set {meta.set_id}, but the servers "
                          f"serve {info.set_id}: pass the directory the servers were started on")
    out = {}
    for p in range(meta.num_parts):
        out[p] = np.load(Path(parts) / meta.parts[p].dir / "orig_ids.npy", mmap_mode="r")
    return out, "dataset"


def sampled_accuracy(run_dir: str) -> dict | None:
    """The training run's own evaluation of its best model (summary.json), if any, with
    ``eval`` naming how it evaluated (``sampled`` unless the run used ``--eval full``)."""
    path = Path(run_dir) / "summary.json" if run_dir else None
    if path is None or not path.is_file():
        return None
    try:
        s = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    keys = ("valid_acc", "test_acc", "best_epoch")
    found = {k: s[k] for k in keys if k in s}
    if found:  # how the run evaluated (--eval): sampled, or full-graph as here
        found["eval"] = s.get("config", {}).get("eval", "sampled")
    return found or None


def _index(cfg: InferConfig, info, saved: dict, model_path: Path, result, entries: list,
           ids_kind: str) -> dict:
    return {
        "format": INDEX_FORMAT, "dataset": info.dataset, "set_id": info.set_id,
        "num_nodes": int(info.num_nodes), "num_parts": int(info.num_parts),
        "node_offsets": [int(x) for x in info.node_offsets],
        "orig_ids": ids_kind, "parts": entries,
        "model_file": str(model_path), "model_spec": saved["model_spec"],
        "model_epoch": saved.get("epoch"),
        "full_graph": {"valid_acc": result.valid_acc, "test_acc": result.test_acc},
        "sampled": sampled_accuracy(cfg.run_dir),
        "layer_s": [round(s, 4) for s in result.layer_s],
    }


def _infer(cfg: InferConfig, pool, saved: dict, model_path: Path, out: Path,
           device: torch.device) -> tuple:
    """Check the model against the servers, run every layer, write the files; returns
    (index, export seconds)."""
    from trainer_client.inference import (
        LayerwiseInference,
        check_model,
        export_part,
        model_from_file,
    )

    check_cluster(pool)
    info = pool.info()
    check_model(saved, info, str(model_path), pool)
    ids, ids_kind = original_ids(cfg.parts, info)
    model = model_from_file(saved, device)
    splits = {s: pool.seeds(s) for s in ("valid", "test")}
    job = LayerwiseInference(model, pool, info, batch_size=cfg.batch_size, device=device,
                             max_inflight=cfg.max_inflight,
                             max_message_bytes=cfg.max_message_mb << 20, progress=cfg.progress)
    result = job.run(splits, keep_outputs=True)
    t0 = time.perf_counter()
    try:
        offsets = info.node_offsets
        entries = [export_part(result, out, p, offsets[p], offsets[p + 1],
                               None if ids is None else ids[p], cfg.max_message_mb << 20)
                   for p in range(info.num_parts)]
    finally:
        job.drop()
    index = _index(cfg, info, saved, model_path, result, entries, ids_kind)
    _write_json(out / "index.json", index)
    return index, time.perf_counter() - t0


def run(cfg: InferConfig) -> dict:
    """Inference end to end; returns the summary (also printed by :func:`main`)."""
    from trainer_client.inference import load_model_file
    from trainer_client.train import make_pool, pick_device

    t0 = time.perf_counter()
    model_path, out = resolve_paths(cfg)
    saved = load_model_file(model_path)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.set_float32_matmul_precision(cfg.matmul_precision)
    from trainer_client.model import set_cpu_gemm

    set_cpu_gemm(cfg.cpu_gemm)
    device = pick_device(cfg, 0)
    pool = make_pool(cfg)
    try:
        index, export_s = _infer(cfg, pool, saved, model_path, out, device)
    finally:
        pool.close()
    full, layer_s = index["full_graph"], index["layer_s"]
    from trainer_client.model import PRODUCTS_RUN, bf16_products, cpu_gemm_summary

    return {
        "out": str(out), "index": str(out / "index.json"),
        "files": [f["path"] for e in index["parts"] for f in e["files"].values()],
        "valid_acc": round(full["valid_acc"], 4), "test_acc": round(full["test_acc"], 4),
        "sampled": index["sampled"], "orig_ids": index["orig_ids"],
        "num_nodes": index["num_nodes"], "num_layers": len(layer_s), "layer_s": layer_s,
        "nodes_per_s": round(index["num_nodes"] / max(sum(layer_s), 1e-9), 1),
        "export_s": round(export_s, 3), "wall_s": round(time.perf_counter() - t0, 3),
        "device": str(device), "matmul_precision": torch.get_float32_matmul_precision(),
        # the route the device offers (trainer_client/model.py), and how many of the model's
        # products took each route in this process
        "bf16_products": bf16_products(device),
        "bf16_products_run": dict(PRODUCTS_RUN),
        "cpu_gemm": cpu_gemm_summary(device),
    }


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps_strict(obj, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mfgserve-infer`` (exit codes: see the module docstring)."""
    def body() -> int:
        from common.logs import setup_logging

        args = build_parser().parse_args(argv)
        setup_logging("infer")
        summary = run(load_config(InferConfig, args.config, args))
        print(dumps_strict(summary), flush=True)
        return 0

    return run_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
