"""DGL's own heterogeneous pipeline, the reference for mfgserve on typed graphs (issue 11).

``python -m benchmarks.dgl_hetero --parts PARTS [--epochs E] [--fanouts 15,10]``

:func:`load_full_heterograph` rebuilds the whole typed graph from an mfgserve partition set
(set-level ``node_type.npy``, every part's CSC and ``etype.npy``; see partition/layout.py), so
both systems see exactly the same nodes, relations, features, labels and splits. The model is
the one the issue names: a stack of ``dgl.nn.HeteroGraphConv({relation: dgl.nn.SAGEConv(..,
"mean")}, aggregate="sum")``, ReLU between layers, trained by DGL's ``DataLoader`` with a
``NeighborSampler`` (one fanout per layer for every relation, or a per-relation map) over the
seed type's training nodes; Adam (lr 3e-3, weight decay 5e-4, mfgserve's trainer defaults).

Featureless node types (those not in the set's ``feat_ntypes``): ``--featureless embed`` (the
default) gives each a learnable embedding of the feature width; ``zeros`` uses the set's zero
rows. The embeddings train as DGL trains them (and as mfgserve's server-held embeddings do):
``--emb-optimizer sparse-adam`` (the default) is ``dgl.nn.NodeEmbedding`` rows initialised
U(-``--emb-init``, ``--emb-init``) (1.0) and updated by ``dgl.optim.SparseAdam`` with
``--emb-lr`` (0.01), only the rows a batch used, no weight decay (DistDGL's RGCN example;
mfgserve's ``--node-emb-dim`` / ``--node-emb-lr`` defaults); ``adam`` is a dense
``nn.Embedding`` in the model's Adam (weight decay included), U(-0.1, 0.1). A set partitioned with
``--derive-features mean`` has every type in ``feat_ntypes``: the derived rows are used.

``--mfgserve`` also trains mfgserve (``deploy.worker_mode``, 1 trainer, the ring on) on the
same set with the same settings and ``--mfgserve-model`` (``hetero-sage``, the default: the
same HeteroGraphConv(SAGEConv) model, parameters and initialisation, in plain torch; or
``rsage``); featureless types then get server-held embeddings of the feature width, U(-1, 1),
sparse Adam with ``--emb-lr`` (``--node-emb-dim``), as DGL's NodeEmbedding + SparseAdam here.

Measured (2 busy cores; synthetic-mag, 20,000 papers = 52,683 nodes, 1.09M directed edges with
reverse relations, 2 METIS parts; 5 epochs, fanouts 15,10, hidden 256, batch 1024, dropout 0,
Adam 3e-3 / 5e-4; test accuracy at the best valid epoch, seeds 0/1/2, mean)::

    partition-ogbn --dataset synthetic-mag --num-nodes 20000 --raw-out RAW --num-parts 2 \
        --out P --add-reverse-edges             # featureless types: embeddings
    partition-ogbn --dataset-dir RAW --num-parts 2 --out PM --add-reverse-edges \
        --derive-features mean                  # every type featured
    python -m benchmarks.dgl_hetero --parts P --epochs 5 --fanouts 15,10 --seed S --mfgserve
    python -m benchmarks.dgl_hetero --parts PM --epochs 5 --fanouts 15,10 --seed S --mfgserve

    featureless types    mfgserve hetero-sage   DGL HeteroGraphConv   difference
    embeddings (128)     0.8958                 0.9003                -0.45
    derive mean          0.9120                 0.9131                -0.11

Earlier, mfgserve's ``--model rsage`` (worker-mode with ``--model rsage``; ``--node-emb-dim
128`` on P) read 0.9192 / 0.9281, 1.64 / 0.92 points above HeteroGraphConv (0.9028 / 0.9189)
and 0.53 / 0.78 below DGL's pipeline running RelGraphSAGE (``--model rsage`` here: 0.9245 /
0.9358): the same function as HeteroGraphConv with other parameters (one self loop and bias
per node type instead of per relation, summed), initialisation and Adam dynamics.

The last stdout line is a JSON summary (``test_acc`` at the epoch of best ``valid_acc``,
``seeds_per_s`` over the training loops only, as benchmarks.dgl_pipeline counts them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.dgl_compat import import_dgl
from partition.layout import PartitionSetMeta, load_partition

_REPO = Path(__file__).resolve().parents[1]


@dataclass
class HeteroGraph:
    """The whole typed graph of a partition set, per-type ids, ready for DGL."""

    g: object  # dgl.DGLHeteroGraph with ndata "feat" per type and "label" on predict_ntype
    predict_ntype: str
    train: Tensor  # per-type ids of predict_ntype
    valid: Tensor
    test: Tensor
    num_classes: int
    feat_dim: int
    feat_ntypes: list[str]
    dataset: str
    load_s: float


def _feat_float32(arr: np.ndarray, feat_dtype: str) -> np.ndarray:
    a = np.asarray(arr)
    if feat_dtype == "bfloat16":
        return torch.from_numpy(np.array(a)).view(torch.int16).view(torch.bfloat16).float().numpy()
    return a.astype(np.float32)


def load_full_heterograph(parts_dir: str | Path) -> HeteroGraph:
    """Every part's in-edges (with their relation ids) joined into one DGL heterograph.

    Global ids are one contiguous range per part; ``node_type.npy`` gives each global id's
    type, and a type's per-type id is the global id's rank among the nodes of that type (the
    partition keeps each part's nodes grouped by type, in per-type order)."""
    t0 = time.perf_counter()
    dgl = import_dgl()
    meta = PartitionSetMeta.load(parts_dir)
    if not meta.ntypes:
        raise SystemExit(f"{parts_dir} is a homogeneous partition set (no ntypes in its "
                         "metadata); use benchmarks.dgl_pipeline for it")
    ntype = np.load(Path(parts_dir) / "node_type.npy", mmap_mode="r").astype(np.int64)
    counts = np.bincount(ntype, minlength=len(meta.ntypes))
    local = np.empty(meta.num_nodes, dtype=np.int64)  # global id -> per-type id
    for t in range(len(meta.ntypes)):
        mask = ntype == t
        local[mask] = np.arange(int(counts[t]), dtype=np.int64)
    src_l, dst_l, et_l, feats, labels = [], [], [], [], []
    splits: dict[str, list[np.ndarray]] = {"train": [], "valid": [], "test": []}
    for p in range(meta.num_parts):
        part = load_partition(parts_dir, p, mmap=True)
        ip = np.asarray(part.indptr, dtype=np.int64)
        deg = np.diff(ip)
        start = meta.node_offsets[p]
        dst_l.append(np.repeat(np.arange(start, start + len(deg), dtype=np.int64), deg))
        src_l.append(np.asarray(part.indices, dtype=np.int64))
        et_l.append(np.load(Path(parts_dir) / meta.parts[p].dir / "etype.npy").astype(np.int64))
        feats.append(_feat_float32(part.feat, meta.feat_dtype))
        labels.append(np.asarray(part.label, dtype=np.int64))
        for s in splits:
            splits[s].append(np.asarray(getattr(part, s), dtype=np.int64))
    src, dst, et = np.concatenate(src_l), np.concatenate(dst_l), np.concatenate(et_l)
    data = {}
    for r, (s_t, rel, d_t) in enumerate(meta.etypes):
        m = et == r
        data[(s_t, rel, d_t)] = (torch.from_numpy(local[src[m]]),
                                 torch.from_numpy(local[dst[m]]))
    g = dgl.heterograph(data, num_nodes_dict={t: int(counts[i])
                                              for i, t in enumerate(meta.ntypes)},
                        idtype=torch.int64)
    feat = np.concatenate(feats)
    label = np.concatenate(labels)
    for i, t in enumerate(meta.ntypes):
        rows = ntype == i  # global ids of type t, in per-type id order (ascending gid)
        g.nodes[t].data["feat"] = torch.from_numpy(np.ascontiguousarray(feat[rows]))
        if t == meta.predict_ntype:
            g.nodes[t].data["label"] = torch.from_numpy(label[rows])
    sp = {s: torch.from_numpy(local[np.concatenate(v)]) for s, v in splits.items()}
    return HeteroGraph(g=g, predict_ntype=meta.predict_ntype, train=sp["train"],
                       valid=sp["valid"], test=sp["test"], num_classes=meta.num_classes,
                       feat_dim=meta.feat_dim, feat_ntypes=list(meta.feat_ntypes),
                       dataset=meta.dataset, load_s=time.perf_counter() - t0)


class DGLRelSAGE(nn.Module):
    """HeteroGraphConv of SAGEConv("mean") per relation, summed across relations; ReLU (and
    dropout) between layers; the seed type's logits out."""

    def __init__(self, etypes: list[tuple[str, str, str]], in_feats: int, hidden: int,
                 num_classes: int, num_layers: int, dropout: float = 0.0):
        super().__init__()
        dglnn = import_dgl().nn
        dims = [in_feats] + [hidden] * (num_layers - 1) + [num_classes]
        self.layers = nn.ModuleList(
            dglnn.HeteroGraphConv({rel: dglnn.SAGEConv(a, b, "mean") for _, rel, _ in etypes},
                                  aggregate="sum")
            for a, b in zip(dims[:-1], dims[1:], strict=True))
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, x: dict[str, Tensor]) -> dict[str, Tensor]:
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks, strict=True)):
            h = layer(block, h)
            if i != len(self.layers) - 1:
                h = {k: self.dropout(F.relu(v)) for k, v in h.items()}
        return h


class MfgServeRelSAGE(nn.Module):
    """``--model rsage``: mfgserve's own RelGraphSAGE (trainer_client.hetero_model) on DGL's
    sampled blocks (each turned into a common.mfg.HeteroBlock): DGL's pipeline with
    mfgserve's model, to tell a difference of the systems from one of the models (one self
    loop and bias per node type vs HeteroGraphConv's one SAGEConv fc_self and bias per
    relation, summed)."""

    def __init__(self, ntypes, etypes, in_feats: int, hidden: int, num_classes: int,
                 num_layers: int, predict_ntype: str, dropout: float = 0.0):
        super().__init__()
        from trainer_client.hetero_model import RelGraphSAGE

        self.net = RelGraphSAGE(list(ntypes), list(etypes), {t: in_feats for t in ntypes},
                                hidden, num_classes, num_layers, predict_ntype,
                                dropout=dropout)
        self.predict_ntype = predict_ntype

    @staticmethod
    def hetero_block(block):
        from common.mfg import Block, HeteroBlock

        rels = {}
        for rel in block.canonical_etypes:
            indptr, indices, _ = block.adj_tensors("csc", rel)
            rels[rel] = Block(indptr, indices, block.num_src_nodes(rel[0]),
                              block.num_dst_nodes(rel[2]))
        return HeteroBlock(list(block.srctypes),
                           {t: block.num_src_nodes(t) for t in block.srctypes},
                           {t: block.num_dst_nodes(t) for t in block.dsttypes}, rels)

    def forward(self, blocks, x: dict[str, Tensor]) -> dict[str, Tensor]:
        return {self.predict_ntype: self.net([self.hetero_block(b) for b in blocks], x)}


def _fanout_arg(fanouts: list, etypes) -> list:
    """Per layer an int (every relation) or a {relation: int} map, as NeighborSampler takes."""
    out = []
    for f in fanouts:
        out.append({(s, r, d): int(f.get(r, f.get("*", -1))) for s, r, d in etypes}
                   if isinstance(f, dict) else int(f))
    return out


def train_dgl_hetero(graph: str | Path | HeteroGraph, fanouts: list, batch_size: int,
                     epochs: int, hidden: int = 256, dropout: float = 0.0,
                     featureless: str = "embed", seed: int = 0, lr: float = 3e-3,
                     weight_decay: float = 5e-4, num_workers: int = 0,
                     max_batches: int | None = None, emb_optimizer: str = "sparse-adam",
                     emb_lr: float = 0.01, emb_init: float = 1.0,
                     model_name: str = "hetero-sage") -> dict:
    dgl = import_dgl()
    hg = graph if isinstance(graph, HeteroGraph) else load_full_heterograph(graph)
    g, pt = hg.g, hg.predict_ntype
    torch.manual_seed(seed)
    dgl.seed(seed)
    etypes = list(g.canonical_etypes)
    model: nn.Module
    if model_name == "rsage":
        model = MfgServeRelSAGE(g.ntypes, etypes, hg.feat_dim, hidden, hg.num_classes,
                                len(fanouts), pt, dropout)
    else:
        model = DGLRelSAGE(etypes, hg.feat_dim, hidden, hg.num_classes, len(fanouts), dropout)
    embeds: dict = {}
    sparse_opt = None
    if featureless == "embed":
        for t in g.ntypes:
            if t in hg.feat_ntypes:
                continue
            if emb_optimizer == "sparse-adam":
                embeds[t] = dgl.nn.NodeEmbedding(
                    g.num_nodes(t), hg.feat_dim, f"dgl_hetero_emb_{t}",
                    init_func=lambda a: a.uniform_(-emb_init, emb_init))
            else:
                e = nn.Embedding(g.num_nodes(t), hg.feat_dim)
                nn.init.uniform_(e.weight, -0.1, 0.1)
                embeds[t] = e
        if emb_optimizer == "sparse-adam" and embeds:
            sparse_opt = dgl.optim.SparseAdam(list(embeds.values()), lr=emb_lr)
    dense = [] if emb_optimizer == "sparse-adam" else [p for e in embeds.values()
                                                       for p in e.parameters()]
    opt = torch.optim.Adam(list(model.parameters()) + dense, lr=lr,
                           weight_decay=weight_decay)
    sampler = dgl.dataloading.NeighborSampler(_fanout_arg(fanouts, etypes))

    def loader(ids: Tensor, shuffle: bool):
        return dgl.dataloading.DataLoader(g, {pt: ids}, sampler, batch_size=batch_size,
                                          shuffle=shuffle, drop_last=False,
                                          num_workers=num_workers)

    def inputs(blocks) -> dict[str, Tensor]:
        x = {}
        for t in blocks[0].srctypes:
            ids = blocks[0].srcnodes[t].data[dgl.NID]
            x[t] = embeds[t](ids) if t in embeds else g.nodes[t].data["feat"][ids]
        return x

    @torch.no_grad()
    def evaluate(ids: Tensor) -> float:
        model.eval()
        correct = total = 0
        for i, (_, out, blocks) in enumerate(loader(ids, False)):
            if max_batches is not None and i >= max_batches:
                break
            logits = model(blocks, inputs(blocks))[pt]
            lab = g.nodes[pt].data["label"][out[pt]]
            correct += int((logits.argmax(1) == lab).sum())
            total += lab.numel()
        return correct / max(total, 1)

    best = {"valid_acc": -1.0, "test_acc": 0.0, "epoch": -1}
    train_s, seeds, batches, loss = 0.0, 0, 0, None
    for epoch in range(epochs):
        model.train()
        t0 = time.perf_counter()
        for i, (_, out, blocks) in enumerate(loader(hg.train, True)):
            if max_batches is not None and i >= max_batches:
                break
            logits = model(blocks, inputs(blocks))[pt]
            lv = F.cross_entropy(logits, g.nodes[pt].data["label"][out[pt]])
            opt.zero_grad(set_to_none=True)
            lv.backward()
            opt.step()
            if sparse_opt is not None:
                sparse_opt.step()
                # forget this batch's lookups: DGL's NodeEmbedding keeps every lookup in its
                # trace until zero_grad, and a later step() would apply them again
                sparse_opt.zero_grad()
            loss = float(lv.detach())
            seeds += out[pt].numel()
            batches += 1
        train_s += time.perf_counter() - t0
        valid, test = evaluate(hg.valid), evaluate(hg.test)
        if valid > best["valid_acc"]:
            best = {"valid_acc": valid, "test_acc": test, "epoch": epoch}
    return {"system": "dgl-hetero", "dataset": hg.dataset, "model": ("mfgserve RelGraphSAGE" if model_name == "rsage"
                                                    else "HeteroGraphConv(SAGEConv)"),
            "featureless": featureless, "feat_ntypes": hg.feat_ntypes,
            "emb_optimizer": emb_optimizer if embeds else None,
            "fanouts": fanouts, "batch_size": batch_size, "hidden": hidden, "epochs": epochs,
            "dropout": dropout, "batches": batches, "seeds": seeds,
            "train_s": round(train_s, 3), "seeds_per_s": round(seeds / max(train_s, 1e-9), 1),
            "valid_acc": round(best["valid_acc"], 4), "test_acc": round(best["test_acc"], 4),
            "best_epoch": best["epoch"],
            "final_loss": round(loss, 4) if loss is not None else None,
            "load_s": round(hg.load_s, 3), "threads": torch.get_num_threads()}


def worker_mode_argv(parts: str | Path, args: argparse.Namespace, run_dir: str | Path) -> list:
    """``deploy.worker_mode`` on ``parts`` with the DGL run's settings (epochs, fanouts,
    batch, hidden, dropout, Adam lr / weight decay, seed; featureless types with ``--featureless
    embed``: server-held embeddings of the feature width, U(-1, 1), sparse Adam with
    ``--emb-lr``, as DGL's NodeEmbedding + SparseAdam here) and ``--model
    args.mfgserve_model``."""
    meta = PartitionSetMeta.load(parts)
    fan, rel = [], []
    for f in args.fanouts:  # a per-relation map: '*' (else all) plus --rel-fanouts
        fan.append(int(f.get("*", -1)) if isinstance(f, dict) else int(f))
        rel.append(":".join(f"{k}={v}" for k, v in f.items() if k != "*")
                   if isinstance(f, dict) else "")
    argv = [sys.executable, "-m", "deploy.worker_mode", "--parts", str(parts),
            "--num-trainers", "1", "--model", args.mfgserve_model,
            "--epochs", str(args.epochs), "--fanouts", ",".join(map(str, fan)),
            "--batch-size", str(args.batch_size), "--hidden", str(args.hidden),
            "--dropout", str(args.dropout), "--lr", str(args.lr),
            "--weight-decay", str(args.weight_decay), "--seed", str(args.seed),
            "--run-dir", str(run_dir), "--no-progress"]
    if any(rel):
        argv += ["--rel-fanouts", "/".join(rel)]
    if args.featureless == "embed" and set(meta.ntypes) - set(meta.feat_ntypes):
        if args.emb_optimizer != "sparse-adam" or args.emb_init != 1.0:
            raise SystemExit("--mfgserve: mfgserve's embeddings are U(-1, 1) rows trained by "
                             "sparse Adam: use --emb-optimizer sparse-adam --emb-init 1")
        argv += ["--node-emb-dim", str(meta.feat_dim), "--node-emb-lr", str(args.emb_lr)]
    return argv


def run_mfgserve(args: argparse.Namespace) -> dict:
    """The worker-mode run of :func:`worker_mode_argv`: its summary's accuracy figures."""
    run_dir = Path(args.work_dir) / f"{args.mfgserve_model}-s{args.seed}-{int(time.time())}"
    argv = worker_mode_argv(args.parts, args, run_dir)
    print("worker-mode: " + " ".join(argv[3:]), file=sys.stderr, flush=True)
    proc = subprocess.run(argv, cwd=_REPO, stdout=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker-mode exited with {proc.returncode}")
    s = json.loads(lines[-1])
    return {k: s.get(k) for k in ("model", "test_acc", "valid_acc", "best_epoch", "final_loss",
                                  "seeds_per_s", "train_s", "num_parts", "run_dir")}


def _fanouts(text: str) -> list:
    """``15,10`` (every relation) or ``writes=10:cites=5,...`` per layer separated by '/'."""
    if "=" not in text:
        return [int(x) for x in text.split(",") if x]
    layers = []
    for layer in text.split("/"):
        layers.append({k: int(v) for k, v in (kv.split("=") for kv in layer.split(":") if kv)})
    return layers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dgl_hetero",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", required=True, help="a typed mfgserve partition set")
    p.add_argument("--fanouts", type=_fanouts, default=[15, 10],
                   help="input layer first: '15,10' for every relation, or per layer "
                        "'rel=N:rel2=M/...' (default 15,10)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--featureless", choices=("embed", "zeros"), default="embed",
                   help="node types without features: learnable embeddings (default) or the "
                        "set's zero rows")
    p.add_argument("--model", choices=("hetero-sage", "rsage"), default="hetero-sage",
                   help="hetero-sage: dgl.nn.HeteroGraphConv of SAGEConv (the reference); "
                        "rsage: mfgserve's RelGraphSAGE on DGL's blocks (same function, one "
                        "self loop per node type instead of one per relation)")
    p.add_argument("--emb-optimizer", choices=("sparse-adam", "adam"), default="sparse-adam",
                   help="featureless types' embeddings: dgl.nn.NodeEmbedding + "
                        "dgl.optim.SparseAdam (default, as DGL / mfgserve train them) or a "
                        "dense nn.Embedding in the model's Adam")
    p.add_argument("--emb-lr", type=float, default=0.01,
                   help="--emb-optimizer sparse-adam: its learning rate (mfgserve's "
                        "--node-emb-lr default)")
    p.add_argument("--emb-init", type=float, default=1.0,
                   help="--emb-optimizer sparse-adam: rows start U(-x, x) (mfgserve's "
                        "server-held embeddings: 1.0)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--max-batches", type=int, default=None,
                   help="cap the batches of each training and evaluation pass")
    p.add_argument("--mfgserve", action="store_true",
                   help="also train mfgserve (deploy.worker_mode, 1 trainer) on the same set "
                        "with the same settings and --model MFGSERVE_MODEL; the JSON line "
                        "then has dgl, mfgserve and test_acc_diff (mfgserve - DGL)")
    p.add_argument("--mfgserve-model", choices=("hetero-sage", "rsage"),
                   default="hetero-sage",
                   help="--mfgserve: the worker mode's --model (hetero-sage: DGL's "
                        "HeteroGraphConv of SAGEConv in mfgserve, the default)")
    p.add_argument("--work-dir", default="runs/dgl_hetero",
                   help="--mfgserve: the worker-mode run directories go below it")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (Path(args.parts) / "metadata.json").is_file():
        print(f"benchmarks.dgl_hetero: error: --parts {args.parts} is not a partition set "
              "(no metadata.json); write one with partition-ogbn", file=sys.stderr)
        return 2
    res = train_dgl_hetero(args.parts, args.fanouts, args.batch_size, args.epochs,
                           hidden=args.hidden, dropout=args.dropout,
                           featureless=args.featureless, seed=args.seed, lr=args.lr,
                           weight_decay=args.weight_decay, num_workers=args.num_workers,
                           max_batches=args.max_batches, emb_optimizer=args.emb_optimizer,
                           emb_lr=args.emb_lr, emb_init=args.emb_init,
                           model_name=args.model)
    if args.mfgserve:
        mfg = run_mfgserve(args)
        res = {"dgl": res, "mfgserve": mfg,
               "test_acc_diff": round(mfg["test_acc"] - res["test_acc"], 4)}
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
