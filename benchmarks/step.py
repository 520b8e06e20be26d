"""The trainer step alone, mfgserve's GraphSAGE against DGL's, on identical blocks.

``python -m benchmarks.step --parts DIR`` (or ``run_step(parts, args)`` from benchmarks.run):
DGL's NeighborSampler draws ``--batches`` mini-batches from the partition set's graph once;
each batch is then given to both sides exactly as their pipelines hand it to the model:

* DGL: the sampler's own blocks (fresh objects per batch, as its DataLoader yields them) and
  ``dgl.nn.SAGEConv`` layers (benchmarks.dgl_pipeline.DGLGraphSAGE);
* mfgserve: :class:`common.mfg.Block` s built from the same CSC arrays (what the trainer
  builds from a sampler reply) and trainer_client.model.GraphSAGE.

One step = forward + cross-entropy + backward + Adam step, the same widths, dropout, optimizer
(Adam, lr 3e-3, weight decay 5e-4; each side's as its pipeline builds it: the trainer's fused
kernel, the seed tutorial's ``torch.optim.Adam``) and thread count (``--num-threads``, default
torch's). Steps alternate between the sides batch by batch, so load drift hits both alike;
``--repeats`` passes over the batches, the first one untimed (warm-up). Figures: milliseconds
per step (median over timed steps) per side and their ratio mfgserve / DGL (< 1: mfgserve's
step is faster); the same for CPU seconds of this process (``*_cpu_ms``, ``cpu_ratio``: less
disturbed by other load). ``--profile`` adds a torch.profiler breakdown of one step per side
(self CPU time by operator, top rows).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.report import add_malloc_arg, apply_malloc, logger
from common.config import CPU_GEMMS, MATMUL_PRECISIONS
from trainer_client.metrics import TASK_METRICS, Task, loss_fn

log = logger("step")


def _sample_batches(fg, fanouts: list[int], batch_size: int, count: int, seed: int) -> list:
    """``count`` (dgl blocks, features, labels) triples of shuffled training seeds."""
    from common.dgl_compat import import_dgl

    dgl = import_dgl()
    dgl.seed(seed)
    gen = torch.Generator().manual_seed(seed)
    seeds = fg.train[torch.randperm(fg.train.numel(), generator=gen)]
    sampler = dgl.dataloading.NeighborSampler(list(fanouts))
    out = []
    for i in range(count):
        batch = seeds[(i * batch_size) % seeds.numel():][:batch_size]
        input_nodes, _, blocks = sampler.sample(fg.g, batch)
        out.append((blocks, fg.g.ndata["feat"][input_nodes],
                    fg.g.ndata["label"][blocks[-1].dstdata["_ID"]]))
    return out


def _our_blocks(dgl_blocks) -> list:
    """mfgserve Blocks with the DGL blocks' CSC (the trainer gets CSC off the wire)."""
    from common.mfg import Block

    out = []
    for b in dgl_blocks:
        indptr, indices, _ = b.adj_tensors("csc")
        out.append(Block(indptr.clone(), indices.clone(), b.num_src_nodes(), b.num_dst_nodes()))
    return out


def _fresh_dgl_blocks(dgl_blocks) -> list:
    """New DGL block objects over the same CSC (no sparse formats cached from an earlier
    step), as the DataLoader yields a fresh block per batch."""
    from common.dgl_compat import import_dgl

    dgl = import_dgl()
    out = []
    for b in dgl_blocks:
        indptr, indices, eids = b.adj_tensors("csc")
        out.append(dgl.create_block(("csc", (indptr, indices, eids)),
                                    num_src_nodes=b.num_src_nodes(),
                                    num_dst_nodes=b.num_dst_nodes()))
    return out


_MULTICLASS = Task()  # cross-entropy: the products and RMAT graphs' task


def _step(model, opt, blocks, x, y, autocast: bool = False,
          task: Task = _MULTICLASS) -> None:
    """One training step; ``autocast``: its forward under ``torch.autocast("cpu",
    bfloat16)``, a context per step as a training loop has it (DGL's own route to bfloat16
    products). The loss is the trainer's for ``task`` (:func:`trainer_client.metrics.loss_fn`:
    cross-entropy, or a multi-label set's binary cross-entropy over the labelled entries)."""
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
        logits = model(blocks, x)
        loss = loss_fn(task, logits, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _profile(fn, rows: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    avgs = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in avgs) or 1
    return [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1000, 2),
             "share": round(e.self_cpu_time_total / total, 3), "calls": e.count}
            for e in avgs[:rows]]


def measure_step(parts: Path, fanouts: list[int], batch_size: int, hidden: int,
                 dropout: float, batches: int = 8, repeats: int = 3, seed: int = 0,
                 num_threads: int | None = None, profile_rows: int = 0,
                 dgl_autocast: bool = False, cpu_gemm: str = "auto") -> dict:
    from benchmarks.dgl_pipeline import DGLGraphSAGE, load_full_graph
    from trainer_client.model import GraphSAGE, float32_library, set_cpu_gemm
    from trainer_client.models import build_optimizer

    set_cpu_gemm(cpu_gemm)

    if num_threads:
        torch.set_num_threads(num_threads)
    from partition.layout import PartitionSetMeta

    fg = load_full_graph(parts)
    meta = PartitionSetMeta.load(parts)
    # a multi-label set: one logit per task and the trainer's binary cross-entropy, both sides
    task = (Task("binary", meta.num_tasks, TASK_METRICS["binary"])
            if meta.task_type == "binary" else Task())
    outputs = meta.num_tasks if task.binary else fg.num_classes
    t0 = time.perf_counter()
    data = _sample_batches(fg, fanouts, batch_size, batches, seed)
    sample_s = time.perf_counter() - t0
    torch.manual_seed(seed)
    ours = GraphSAGE(fg.feat_dim, hidden, outputs, len(fanouts), dropout)
    torch.manual_seed(seed)
    theirs = DGLGraphSAGE(fg.feat_dim, hidden, outputs, len(fanouts), dropout)
    sides = {
        "mfgserve": (ours, build_optimizer(ours.parameters(), 3e-3, 5e-4), _our_blocks),
        "dgl": (theirs, torch.optim.Adam(theirs.parameters(), lr=3e-3, weight_decay=5e-4),
                _fresh_dgl_blocks),
    }
    cast = {"mfgserve": False, "dgl": dgl_autocast}
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(repeats):
        for blocks, x, y in data:
            for name, (model, opt, convert) in sides.items():
                model.train()
                mine = convert(blocks)
                t, c = time.perf_counter(), time.process_time()
                _step(model, opt, mine, x, y, cast[name], task)
                if rep > 0 or repeats == 1:
                    times[name].append(time.perf_counter() - t)
                    cpu[name].append(time.process_time() - c)
    res = {
        "batches": batches, "task_type": meta.task_type, "outputs": outputs,
        "timed_steps": len(times["dgl"]), "num_threads":
        torch.get_num_threads(), "dropout": dropout, "dgl_autocast": dgl_autocast,
        "sample_s": round(sample_s, 2),
        # --cpu-gemm for mfgserve's side, and the library its float32 products went to
        "cpu_gemm": cpu_gemm, "cpu_gemm_library": float32_library(torch.device("cpu")),
        "input_nodes_per_batch": round(sum(b[0].num_src_nodes() for b, _, _ in data)
                                       / len(data), 1),
        "edges_per_batch": round(sum(sum(bl.num_edges() for bl in b) for b, _, _ in data)
                                 / len(data), 1),
    }
    for name, ts in times.items():
        res[f"{name}_ms"] = round(1000 * statistics.median(ts), 2)
        res[f"{name}_ms_min"] = round(1000 * min(ts), 2)
        res[f"{name}_cpu_ms"] = round(1000 * statistics.median(cpu[name]), 2)
    res["ratio"] = round(res["mfgserve_ms"] / res["dgl_ms"], 3)
    res["cpu_ratio"] = round(res["mfgserve_cpu_ms"] / res["dgl_cpu_ms"], 3)
    if profile_rows:
        blocks, x, y = data[0]
        for name, (model, opt, convert) in sides.items():
            res[f"{name}_profile"] = _profile(
                lambda m=model, o=opt, c=convert, a=cast[name]: _step(m, o, c(blocks), x, y, a,
                                                                      task),
                profile_rows)
    return res


def run_step(parts: Path, args) -> dict[str, dict]:
    """benchmarks.run's "step" measurement: {"step_d{dropout}": figures}."""
    res = measure_step(parts, args.fanouts, args.batch_size, args.hidden, args.dropout,
                       batches=getattr(args, "step_batches", 8), seed=args.seed,
                       num_threads=getattr(args, "num_threads", None), profile_rows=12,
                       cpu_gemm=getattr(args, "cpu_gemm", "auto"))
    return {f"step_d{args.dropout:g}": res}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.step",
        description="Time one GraphSAGE training step (forward, loss, backward, Adam) of "
                    "mfgserve's model against dgl.nn.SAGEConv's on the same sampled blocks, "
                    "features and thread count. The last stdout line is JSON.")
    p.add_argument("--parts", required=True, help="partition set directory (all parts are "
                   "joined into one graph, as benchmarks.dgl_pipeline does)")
    p.add_argument("--fanouts", default="15,10,5",
                   help="neighbours per layer, input layer first (15,10,5)")
    p.add_argument("--batch-size", type=int, default=1024, help="seeds per batch (1024)")
    p.add_argument("--hidden", type=int, default=256, help="hidden width (256)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout between layers on both sides (0: the seed tutorial model)")
    p.add_argument("--batches", type=int, default=8, help="distinct batches sampled (8)")
    p.add_argument("--repeats", type=int, default=3,
                   help="passes over the batches; the first is an untimed warm-up (3)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads for both sides (default: torch's default)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="add a torch.profiler table of one step per side, ROWS rows (0: off)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--matmul-precision", choices=list(MATMUL_PRECISIONS),
                   default="highest", help="torch.set_float32_matmul_precision for both sides "
                   "(highest: float32; medium: bfloat16 products on a CPU with bfloat16 "
                   "instructions, docs/tuning.md; DGL's side gets torch's medium, not "
                   "autocast). The batches repeat, so DGL's shapes repeat too: oneDNN's "
                   "per-shape kernel builds, which a training run pays on every new batch "
                   "without mfgserve's row buckets, are not in DGL's figure")
    p.add_argument("--dgl-autocast", action="store_true",
                   help="DGL's step with its forward under torch.autocast(cpu, bfloat16), a "
                        "context per step: DGL's own route to bfloat16 products, which its "
                        "whole model (activations, GSpMM) then runs in; compare with "
                        "--matmul-precision medium")
    p.add_argument("--cpu-gemm", choices=list(CPU_GEMMS), default="auto",
                   help="the trainer's --cpu-gemm for mfgserve's side: the library of its "
                        "float32 products (auto: oneDNN on an AMD Zen 5 or later, cpu "
                        "family >= 26, with AVX-512, else MKL; docs/tuning.md). DGL's side "
                        "multiplies through torch's nn.Linear (MKL) as its pipeline does")
    add_malloc_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_malloc(args.malloc_retain_mb)
    torch.set_float32_matmul_precision(args.matmul_precision)
    try:
        fanouts = [int(x) for x in args.fanouts.split(",") if x.strip()]
    except ValueError:
        print(f"--fanouts: expected comma-separated integers, got {args.fanouts!r}",
              file=sys.stderr)
        return 2
    if not Path(args.parts).is_dir():
        print(f"--parts {args.parts}: no such partition set directory", file=sys.stderr)
        return 2
    res = measure_step(Path(args.parts), fanouts, args.batch_size, args.hidden, args.dropout,
                       args.batches, args.repeats, args.seed, args.num_threads, args.profile,
                       dgl_autocast=args.dgl_autocast, cpu_gemm=args.cpu_gemm)
    log(f"step ms (median): mfgserve {res['mfgserve_ms']:.1f}, dgl {res['dgl_ms']:.1f}, "
        f"ratio {res['ratio']:.3f}; cpu ms {res['mfgserve_cpu_ms']:.1f} / "
        f"{res['dgl_cpu_ms']:.1f}, ratio {res['cpu_ratio']:.3f} (threads {res['num_threads']})")
    for side in ("mfgserve", "dgl"):
        for row in res.get(f"{side}_profile", []):
            log(f"{side:9s} {row['op'][:40]:40s} {row['self_ms']:8.2f} ms "
                f"{100 * row['share']:5.1f}% x{row['calls']}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
