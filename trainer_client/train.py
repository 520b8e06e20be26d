"""One trainer process: DDP over the servers' mini-batches, evaluation, and the JSON summary.

The summary (a dict; rank 0 prints it as one JSON line) reports the dataset's eval metric
(``eval_metric``: ``test_acc`` at the epoch of best ``valid_acc``; for multi-label datasets
such as ogbn-proteins ``test_rocauc`` / ``valid_rocauc``, ROC-AUC as ogb computes it, see
trainer_client/metrics.py), throughput (``seeds_per_s`` over all ranks' training time) and
per-stage seconds summed over the run (``stages``: server sample / gather / remote / encode,
trainer wait / decode-to-MFG / host-to-device / forward-backward), and names the run
directory and its files (``run_dir``, ``files``).

Every epoch: torch's RNG is reseeded from (seed, epoch, rank); the epoch trains (gradients
checked for NaN/inf, then clipped with ``--grad-clip``); valid/test accuracy is measured when
due (``--eval sampled|full``), best_model.pt saved when it improves and ``--patience``
updated; the learning-rate schedule steps; rank 0 appends the epoch's line to metrics.jsonl;
a checkpoint is written when due. With ``--resume`` the newest checkpoint is loaded first
(trainer_client/run_dir.py says where it is looked for, trainer_client/checkpoint.py what it
holds), and the run continues exactly where the interrupted one was: the same seeds shuffled,
the same MFGs sampled (``--deterministic-sampling``), the same dropout masks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.alloc import HeapPrefault, prefault_step_heap, retain_freed_memory, step_heap_mb
from common.cluster import ClusterSpec
from common.config import (
    GPU_TRAINER_THREADS,
    HETERO_MODEL_NAMES,
    InferConfig,
    TrainerConfig,
    to_dict,
    wants_cuda,
)
from common.errors import ConfigError, MfgServeError
from common.jsonout import dumps_strict
from common.logs import bars_allowed
from common.messages import FEAT_TRANSFER_DTYPES
from common.mfg import HeteroMFG, SourceRows
from common.shm_ring import ShmRing, max_input_rows
from common.sockets import CurveKeys
from trainer_client.checkpoint import FORMAT as CHECKPOINT_FORMAT
from trainer_client.checkpoint import (
    Checkpointer,
    check_compatible,
    list_checkpoints,
    load_bytes,
    model_state,
    result_config,
    resumed_best,
    save_best_model,
)
from trainer_client.controls import EarlyStopping, clip_gradients, epoch_seed, make_scheduler
from trainer_client.core_turns import CoreTurns
from trainer_client.feature_cache import FeatureCache
from trainer_client.inference import full_graph_eval
from trainer_client.loader import DistNodeDataLoader, hidden_share
from trainer_client.local_features import LocalFeatures, open_local_features
from trainer_client.metrics import (
    Task,
    check_shared_score,
    gather_rows,
    loss_fn,
    rank0_rocauc,
    task_of,
)
from trainer_client.model import (
    PRODUCTS_RUN,
    bf16_products,
    cpu_gemm_summary,
    gemm_buckets,
    set_cpu_gemm,
)
from trainer_client.models import (
    build_model,
    build_optimizer,
    guarded_step,
    sums_non_finite,
    supports_guard,
)
from trainer_client.node_embedding import NodeEmbedding
from trainer_client.profiling import StepProfiler
from trainer_client.run_dir import (
    RunFiles,
    broadcast_bytes,
    checkpoint_dir_of,
    new_run_name,
    resume_location,
)
from trainer_client.server_pool import ServerPool
from trainer_client.typed import (
    check_typed_run,
    featureless,
    loader_args,
    model_name,
    ring_fanouts,
    seed_labels,
    typed_inputs,
    typed_spec,
)

log = logging.getLogger("mfgserve.trainer")


@dataclass
class DDPSetup:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 300.0
    launcher_tty: bool = False  # bars on although stderr is a pipe (see DDPConfig)


def pick_device(cfg: TrainerConfig | InferConfig, local_rank: int) -> torch.device:
    """The torch device for ``--device`` (auto: this rank's GPU when CUDA is present)."""
    if wants_cuda(cfg.device):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device; "
                               "use --device cpu or auto")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _batches(loader, enabled: bool, **kw):
    """``loader``'s batches, with a progress bar if ``enabled``. Neither this generator nor
    the bar keeps a batch once the caller asks for the next one (the callers drop theirs at
    the end of each step), so its shared-memory ring slot is free again before the loader
    sends its next requests: a run touches ``--max-inflight`` + 1 slots, not + 2
    (``shm_ring.slots_used`` in the summary; each slot's pages cost a first touch)."""
    bar = None
    if enabled:
        from tqdm import tqdm

        bar = tqdm(total=len(loader), leave=False, dynamic_ncols=True, **kw)
    try:
        for batch in loader:
            yield batch
            del batch
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()


def _all_sum(values: list[float], ddp: DDPSetup, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if ddp.world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


class DDPPeerError(MfgServeError):
    """A DDP collective failed: another rank died, hung, or the network between ranks broke."""


class NonFiniteLossError(MfgServeError):
    """The training loss (or the gradients averaged over the ranks) became NaN or infinite."""


def run_trainer(cfg: TrainerConfig, ddp: DDPSetup,
                deliver: Callable[[dict], None] | None = None, done_file: str = "") -> dict:
    """Train and evaluate; returns the summary dict (identical on every rank).

    At the end every rank calls ``deliver(summary)`` (rank 0 prints / writes it), then all
    ranks meet in a final barrier, so that no rank leaves while another still delivers; then
    ``done_file`` (if given) is written: from then on this rank has nothing left to do but
    tear down, and a launcher may count it as finished even if it dies in that teardown.

    A failed DDP collective (a peer rank died: the connection closes at once; or hung: after
    ``ddp.timeout_s``) is raised as :class:`DDPPeerError` naming this rank and the setting.
    A non-finite loss stops every rank at the same batch with :class:`NonFiniteLossError`.
    """
    try:
        return _run_trainer(cfg, ddp, deliver, done_file)
    except RuntimeError as e:
        if ddp.world_size > 1 and _is_collective_failure(e):
            raise DDPPeerError(
                f"rank {ddp.rank}: a DDP collective with the other {ddp.world_size - 1} "
                f"rank(s) failed ({str(e).splitlines()[0]}); another trainer died, hung for "
                f"more than --ddp-timeout-s ({ddp.timeout_s:.0f}s), or became unreachable. "
                "Check the other ranks' logs; restart the job") from e
        raise


def _is_collective_failure(e: RuntimeError) -> bool:
    text = str(e)
    return isinstance(e, getattr(dist, "DistBackendError", ())) or any(
        k in text for k in ("gloo", "NCCL", "Connection closed by peer", "Timed out",
                            "Connection reset"))


def make_ring(cfg: TrainerConfig, info, device: torch.device) -> ShmRing | None:
    """The shared-memory receive ring (common.shm_ring), sized for the largest batch."""
    if not cfg.shm_ring:
        return None
    slots = cfg.max_inflight + 2  # in flight, plus the batch being trained and the next one
    dtype = FEAT_TRANSFER_DTYPES.get(cfg.feat_transfer) or getattr(torch, info.feat_dtype)
    row_bytes = info.feat_dim * dtype.itemsize
    rows = max(max_input_rows(cfg.batch_size, ring_fanouts(cfg, info, cfg.fanouts),
                              info.num_nodes),
               max_input_rows(cfg.eval_batch_size,
                              ring_fanouts(cfg, info, cfg.eval_fanouts or cfg.fanouts),
                              info.num_nodes))
    slot_bytes = max(rows * row_bytes, 1)
    total = (cfg.shm_ring_mb << 20) if cfg.shm_ring_mb else min(slots * slot_bytes, 4096 << 20)
    slot_bytes = max(total // slots, 1)
    try:
        return ShmRing(slots, slot_bytes, pin=device.type == "cuda")
    except (OSError, MfgServeError) as e:
        log.warning("no shared-memory ring (%s); features come over the socket", e)
        return None


_RETAINED_MB = 0  # --malloc-retain-mb as it took effect in this process (0: not at all)


def _init_ddp(cfg: TrainerConfig, ddp: DDPSetup) -> torch.device:
    global _RETAINED_MB
    torch.manual_seed(cfg.seed)
    _RETAINED_MB = cfg.malloc_retain_mb if retain_freed_memory(
        cfg.malloc_retain_mb, f"trainer rank {ddp.rank}") else 0
    device = pick_device(cfg, ddp.local_rank)
    if cfg.num_threads or device.type == "cuda":
        torch.set_num_threads(cfg.num_threads or GPU_TRAINER_THREADS)
    torch.set_float32_matmul_precision(cfg.matmul_precision)
    set_cpu_gemm(cfg.cpu_gemm)
    if ddp.world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=f"tcp://{ddp.master_addr}:{ddp.master_port}", rank=ddp.rank,
            world_size=ddp.world_size, timeout=timedelta(seconds=ddp.timeout_s))
    return device


def make_pool(cfg: TrainerConfig | InferConfig) -> ServerPool:
    """The trainer's server pool from the cluster file and the connection options."""
    cluster = ClusterSpec.load(cfg.cluster)
    curve = None
    if cfg.curve_secret_key:
        if not cluster.curve_server_key:
            raise ConfigError(f"--curve-secret-key is set but cluster file {cfg.cluster} has no "
                              "curve_server_key (the servers' public key file); add it")
        curve = CurveKeys.load(cfg.curve_secret_key, cluster.curve_server_key)
    elif cluster.curve_server_key:
        raise ConfigError(f"cluster file {cfg.cluster} names curve_server_key: its servers "
                          "require CurveZMQ; pass this trainer's key with --curve-secret-key")
    return ServerPool(cluster, timeout_s=cfg.request_timeout_s,
                      max_message_bytes=cfg.max_message_mb << 20, curve=curve,
                      heartbeat_s=cfg.heartbeat_s, heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                      suspect_s=cfg.replica_suspect_s)


def _grads_finite(net) -> bool:
    """Whether every gradient entry is finite (``sums_non_finite``: ~0.1 ms per step for
    200k parameters)."""
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    return not grads or not bool(sums_non_finite(grads))


def check_finite(loss: float, net, ddp: DDPSetup, epoch: int, batch: int,
                 num_batches: int) -> None:
    """Stop (on every rank at the same batch) when this rank's loss or the gradients are not
    finite. Under DDP the gradients checked are the ones all-reduced over the ranks, identical
    everywhere, and NaN/inf in any rank's loss makes them non-finite: every rank sees it at the
    same batch and raises, so no rank is left waiting in a collective for the others. (Were
    a rank's loss non-finite with finite gradients, not seen with cross-entropy, only that rank
    would stop here; the others fail at their next collective with :class:`DDPPeerError`.)"""
    if math.isfinite(loss) and _grads_finite(net):
        return
    raise_non_finite(loss, ddp, epoch, batch, num_batches)


def raise_non_finite(loss: float, ddp: DDPSetup, epoch: int, batch: int,
                     num_batches: int) -> None:
    """Raise :class:`NonFiniteLossError` for the step of ``batch``: the loss (this rank's,
    ``loss``) is not finite, or else the gradients are (on another rank, under DDP)."""
    where = f"at epoch {epoch}, batch {batch} of {num_batches} (both counted from 0)"
    hint = ("Check the input features and labels for NaN/inf (numpy.isfinite on each part's "
            "feat.npy), or lower the learning rate (--lr)")
    if not math.isfinite(loss):
        what = f"the training loss is not finite ({loss})"
    else:
        what = (f"the training loss is not finite on another rank (the gradients averaged over "
                f"the {ddp.world_size} ranks are not finite; this rank's loss is {loss:.4g})"
                if ddp.world_size > 1 else
                f"the gradients are not finite (the loss is {loss:.4g}: the backward pass "
                "overflowed)")
    raise NonFiniteLossError(f"{what} {where}; training stopped on every rank. {hint}")


def _finish(summary: dict, ddp: DDPSetup, deliver, done_file: str) -> None:
    """Deliver the result, wait for every rank to have delivered, then mark this rank done."""
    if deliver is not None:
        deliver(summary)
    if ddp.world_size > 1:
        try:
            dist.barrier()
        except RuntimeError as e:  # a peer died after its last collective: our result stands
            log.warning("rank %d: the final barrier with the other ranks failed (%s); this "
                        "rank's result is complete, exiting anyway", ddp.rank,
                        str(e).splitlines()[0])
    if done_file:
        tmp = f"{done_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"rank {ddp.rank} pid {os.getpid()}\n")
        os.replace(tmp, done_file)


@dataclass
class Run:
    """Everything one trainer's epochs use (built once; resumed state is loaded into it)."""

    cfg: TrainerConfig
    ddp: DDPSetup
    device: torch.device
    info: Any
    pool: ServerPool
    spec: dict
    model: nn.Module
    net: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    train_loader: DistNodeDataLoader
    eval_loaders: dict
    splits: dict  # split name -> seed ids (--eval full reads valid and test)
    cache: FeatureCache | None
    files: RunFiles  # names on every rank; rank 0 writes
    ckpt: Checkpointer
    emb: NodeEmbedding | None = None  # --node-emb-dim > 0
    best_state: dict | None = None  # rank 0: the best model's tensors (for checkpoints)
    show: bool = False
    task: Task = field(default_factory=Task)  # the set's task: loss and metric (metrics.py)
    profiler: StepProfiler | None = None  # --profile-steps, rank 0 (profiling.py)
    local: LocalFeatures | None = None  # --local-features as decided (local_features.py)
    # the first steps' heap faulted in beforehand (common/alloc.py HeapPrefault), or why not
    prefault: HeapPrefault | dict | None = None

    @property
    def metric(self) -> str:
        """The dataset's eval metric ("acc" or "rocauc"): valid_<metric> / test_<metric>."""
        return self.task.eval_metric

    @property
    def writer(self) -> bool:
        return self.ddp.rank == 0


@dataclass
class FitState:
    """Training progress: what a checkpoint saves and a resumed run continues from."""

    history: list = field(default_factory=list)
    best: dict = field(default_factory=lambda: {"valid_acc": -1.0, "test_acc": 0.0,
                                                "epoch": -1})
    early: EarlyStopping = field(default_factory=lambda: EarlyStopping(0))
    start_epoch: int = 0
    train_s: float = 0.0
    compute_s: float = 0.0
    loss_read_s: float = 0.0


@dataclass
class EpochResult:
    loss_sum: float = 0.0
    batches: int = 0
    compute_s: float = 0.0
    loss_read_s: float = 0.0  # part of compute_s: reading the losses (on a GPU, waiting)
    grad_norm_max: float = 0.0  # before clipping (--grad-clip only)
    clipped_steps: int = 0


HISTORY_KEYS = ("epoch", "loss", "lr", "valid_acc", "test_acc", "valid_rocauc",
                "test_rocauc", "eval")


def empty_best(metric: str) -> dict:
    """FitState.best before any evaluation, keyed by the dataset's metric."""
    return {f"valid_{metric}": -1.0, f"test_{metric}": 0.0, "epoch": -1}


def _inputs(run: Run, mfg) -> Tensor:
    """The first layer's input rows: features, then the learnable node embedding if any."""
    if isinstance(mfg, HeteroMFG):  # typed batches (rsage): a dict of inputs per node type
        return typed_inputs(mfg, run.emb, run.info)  # type: ignore[return-value]
    x = mfg[0].srcdata["feat"]
    if isinstance(x, SourceRows) and not (run.emb is None
                                          and getattr(run.model, "takes_source_rows", False)):
        x = x.gather()  # (a model that does not read SourceRows in place)
    x = x.float()
    if run.emb is None:
        return x
    return torch.cat([x, run.emb.lookup(mfg.input_nodes, device=x.device)], dim=1)


@torch.no_grad()
def evaluate(run: Run, loader: DistNodeDataLoader, desc: str) -> float:
    """Sampled-MFG accuracy over ``loader``'s seeds (all ranks together); for binary tasks
    ROC-AUC as ogb computes it over every rank's predictions of the split."""
    run.model.eval()
    if run.task.binary:
        return _evaluate_rocauc(run, loader, desc)
    correct = total = 0
    for _, _, mfg in _batches(loader, run.show, desc=desc):
        logits = run.model(mfg, _inputs(run, mfg))
        labels = seed_labels(mfg)
        correct += int((logits.argmax(1) == labels).sum())
        total += labels.numel()
        del mfg, logits  # the batch's ring slot is free before the next requests go out
    c, t = _all_sum([correct, total], run.ddp, run.device)
    return c / max(t, 1.0)


def _evaluate_rocauc(run: Run, loader: DistNodeDataLoader, desc: str) -> float:
    """ROC-AUC of the whole split: every rank's logits and labels gathered, then scored once
    (rank 0 scores, the others get the value with the sum collective)."""
    preds, labels = [], []
    for _, _, mfg in _batches(loader, run.show, desc=desc):
        preds.append(run.model(mfg, _inputs(run, mfg)).float())
        labels.append(seed_labels(mfg).float())
        del mfg
    t = run.task.num_tasks
    pred = torch.cat(preds) if preds else torch.empty((0, t), device=run.device)
    label = torch.cat(labels).to(pred.device) if labels else torch.empty((0, t),
                                                                          device=run.device)
    pred, label = gather_rows(pred, run.ddp.world_size), gather_rows(label, run.ddp.world_size)
    score, error = rank0_rocauc(label.cpu().numpy(), pred.cpu().numpy(), run.ddp.rank)
    return check_shared_score(_all_sum([score], run.ddp, run.device)[0], error, desc)


@dataclass
class PendingStep:
    """A queued training step whose loss and finite flag are not read yet (``_step``)."""

    loss: Tensor  # detached, on the device
    bad: Tensor  # 0-dim float on the device: 1.0 where the loss or a gradient was not finite
    batch: int


def defers_loss_read(run: Run) -> bool:
    """Whether each step's loss is read one batch late (after the next batch is fetched):
    where the optimizer can skip a step on a device-side flag (``models.supports_guard``:
    the fused Adam) and no other part of the step needs a value from it (``--grad-clip``
    reads the gradient norm; ``--node-emb-dim``'s sparse update runs on the host)."""
    return supports_guard(run.opt) and run.cfg.grad_clip <= 0 and run.emb is None


def settle(pending: PendingStep, ddp: DDPSetup, epoch: int, num_batches: int) -> float:
    """Read a queued step's loss and flag (one read back; on a GPU the host waits here for
    that step to finish) and raise as ``check_finite`` does, naming that step's batch. The
    step itself changed nothing where the flag is set (``models.guarded_step``)."""
    value, bad = torch.stack([pending.loss.float().reshape(()), pending.bad]).tolist()
    if bad:
        raise_non_finite(value, ddp, epoch, pending.batch, num_batches)
    return value


def _settle_into(res: EpochResult, pending: PendingStep, ddp: DDPSetup, epoch: int,
                 num_batches: int) -> float:
    """``settle`` a queued step into ``res``: its loss, and the read's time (returned)."""
    t0 = time.perf_counter()
    res.loss_sum += settle(pending, ddp, epoch, num_batches)
    took = time.perf_counter() - t0
    res.loss_read_s += took
    return took


def _step(run: Run, mfg, res: EpochResult, epoch: int, num_batches: int,
          pending: PendingStep | None = None) -> PendingStep | None:
    """One mini-batch: forward, backward (DDP averages the gradients), checks, clip, step.

    Where ``defers_loss_read(run)``, the step is only queued: the finite check rides on the
    device (the fused Adam skips a non-finite step), and this step's loss is returned
    unread, to be settled at the start of the next step, after the loader has fetched and
    staged the next batch while the device computed this one (on a GPU the host reading the
    loss here would leave the device idle during that fetch; DGL's loop reads it late too).
    A non-finite step still stops training at that batch's number, one fetch later."""
    t0 = time.perf_counter()
    if pending is not None:
        _settle_into(res, pending, run.ddp, epoch, num_batches)
    logits = run.net(mfg, _inputs(run, mfg))
    loss = loss_fn(run.task, logits, seed_labels(mfg))
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    queued = None
    if defers_loss_read(run):
        bad = guarded_step(run.opt, run.net.parameters(), loss)
        queued = PendingStep(loss.detach(), bad, res.batches)
    else:
        t1 = time.perf_counter()
        value = float(loss.detach())
        res.loss_read_s += time.perf_counter() - t1
        check_finite(value, run.net, run.ddp, epoch, res.batches, num_batches)
        if run.cfg.grad_clip > 0:
            norm = clip_gradients(run.net, run.cfg.grad_clip)
            res.grad_norm_max = max(res.grad_norm_max, norm)
            res.clipped_steps += norm > run.cfg.grad_clip
        run.opt.step()
        if run.emb is not None:
            run.emb.step()
        res.loss_sum += value
    res.batches += 1
    res.compute_s += time.perf_counter() - t0
    return queued


def train_epoch(run: Run, epoch: int) -> EpochResult:
    """One epoch over this rank's shard of the training seeds."""
    run.net.train()
    loader = run.train_loader
    loader.set_epoch(epoch)
    res = EpochResult()
    num_batches = len(loader)
    pending = None
    prof = run.profiler  # does nothing once its profile is written
    if prof is not None:
        prof.epoch_start(num_batches)
    # (no enumerate: its reused result tuple would keep the last batch, and its ring slot,
    # alive while the loader sends the next requests)
    for _, _, mfg in _batches(loader, run.show, desc=f"epoch {epoch}"):
        if prof is not None:
            prof.before(res.batches)
        pending = _step(run, mfg, res, epoch, num_batches, pending)
        del mfg  # its ring slot is free again before the loader sends the next requests
        if prof is not None:
            prof.after()
    if pending is not None:  # the last step's loss
        res.compute_s += _settle_into(res, pending, run.ddp, epoch, num_batches)
    if prof is not None:
        prof.finish()  # a window that ran to the epoch's end
    return res


def _counters(run: Run, fit: FitState) -> list[float]:
    """Cumulative counters whose per-epoch deltas metrics.jsonl records (stages last)."""
    st = run.train_loader.stats
    cache_rows = run.cache.rows_served if run.cache is not None else 0
    return [st.seeds, run.pool.bytes_received, cache_rows,
            *st.stage_seconds(fit.compute_s, fit.loss_read_s).values()]


def _epoch_totals(run: Run, fit: FitState, before: list[float], epoch_s: float,
                  res: EpochResult) -> dict:
    """This epoch's training numbers over all ranks (one collective): loss, throughput,
    stage seconds, bytes received and cache rows (training batches only)."""
    delta = [a - b for a, b in zip(_counters(run, fit), before)]
    sums = _all_sum([res.loss_sum, res.batches, epoch_s, *delta], run.ddp, run.device)
    loss_sum, batches, epoch_s_sum, seeds, nbytes, cache_rows, *stages = sums
    mean_s = epoch_s_sum / run.ddp.world_size
    names = run.train_loader.stats.stage_seconds(0.0)
    out = {"loss": loss_sum / max(batches, 1.0), "epoch_s": round(mean_s, 4),
           "seeds_per_s": round(seeds / max(mean_s, 1e-9), 1),
           "stages_s": {n: round(v, 4) for n, v in zip(names, stages)},
           "bytes_received": int(nbytes), "cache_rows_from_cache": int(cache_rows)}
    if run.cfg.grad_clip > 0:  # gradients are all-reduced: the same norms on every rank
        out.update(grad_norm_max=round(res.grad_norm_max, 6), clipped_steps=res.clipped_steps)
    return out


def _evaluate_epoch(run: Run, fit: FitState, epoch: int, record: dict) -> None:
    """Validation/test metric (the dataset's: valid_acc / valid_rocauc, ...) into
    ``record``; best model and early-stopping state."""
    cfg, m = run.cfg, run.metric
    if cfg.eval == "full":
        record.update(_full_eval(run))
    else:
        for split, loader in run.eval_loaders.items():
            record[f"{split}_{m}"] = evaluate(run, loader, split)
    record["eval"] = cfg.eval
    valid = record.get(f"valid_{m}", 0.0)
    improved = valid > fit.best[f"valid_{m}"]
    if improved:
        fit.best = {f"valid_{m}": valid, f"test_{m}": record.get(f"test_{m}", 0.0),
                    "epoch": epoch}
        if run.writer:
            run.best_state = model_state(run.model)
            _write_best(run, fit)
    if fit.early.update(improved) and epoch < cfg.epochs - 1:
        log.info("rank %d: early stopping after epoch %d: no better valid_%s in %d "
                 "evaluations (best %.4f at epoch %d)", run.ddp.rank, epoch, m, cfg.patience,
                 fit.best[f"valid_{m}"], fit.best["epoch"])


def _write_best(run: Run, fit: FitState) -> None:
    save_best_model(run.files.best_model, run.best_state or {}, run.spec, fit.best["epoch"],
                    fit.best[f"valid_{run.metric}"], run.info.set_id, run.info.dataset,
                    metric=run.metric)


def _full_eval(run: Run) -> dict:
    """``--eval full``: layer-wise full-neighbour inference over the graph (every rank);
    keys ``valid_<metric>`` / ``test_<metric>`` as sampled evaluation's."""
    return full_graph_eval(run.model, run.pool, run.info, run.splits,
                           batch_size=run.cfg.eval_batch_size, device=run.device,
                           rank=run.ddp.rank, world_size=run.ddp.world_size, progress=run.show,
                           max_message_bytes=run.cfg.max_message_mb << 20, emb=run.emb)


def _run_epoch(run: Run, fit: FitState, epoch: int) -> dict:
    """Train one epoch (torch's RNG reseeded from (seed, epoch, rank): a resumed run draws
    the same dropout masks), evaluate when due; returns the epoch's metrics record."""
    cfg = run.cfg
    torch.manual_seed(epoch_seed(cfg.seed, epoch, run.ddp.rank))
    before = _counters(run, fit)
    record: dict = {"epoch": epoch, "time": 0.0, "lr": run.opt.param_groups[0]["lr"]}
    t0 = time.perf_counter()
    res = train_epoch(run, epoch)
    epoch_s = time.perf_counter() - t0
    fit.train_s += epoch_s
    fit.compute_s += res.compute_s
    fit.loss_read_s += res.loss_read_s
    record.update(_epoch_totals(run, fit, before, epoch_s, res))
    if epoch == cfg.epochs - 1 or (cfg.eval_every and (epoch + 1) % cfg.eval_every == 0):
        _evaluate_epoch(run, fit, epoch, record)
    record["time"] = time.time()
    return record


def _fit(run: Run, fit: FitState) -> FitState:
    """The epochs from ``fit.start_epoch``: train, evaluate, record, schedule, checkpoint;
    early stopping ends them at the same epoch on every rank."""
    cfg = run.cfg
    for epoch in range(fit.start_epoch, cfg.epochs):
        if fit.early.stopped:
            break
        record = _run_epoch(run, fit, epoch)
        fit.history.append({k: record[k] for k in HISTORY_KEYS if k in record})
        if run.sched is not None:
            run.sched.step()
        if run.writer:
            run.files.append_metrics(record)
            log.info("epoch %s", dumps_strict(fit.history[-1]))
        done = epoch + 1
        if run.ckpt.due(done, done == cfg.epochs or fit.early.stopped):
            _save_checkpoint(run, fit, done)
    return fit


def _identity(cfg: TrainerConfig, info, ddp: DDPSetup) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    return {"config": result_config(cfg), "set_id": info.set_id, "dataset": info.dataset,
            "world_size": ddp.world_size}


def _save_checkpoint(run: Run, fit: FitState, done: int) -> None:
    """Write the checkpoint of ``done`` epochs (rank 0). Server-held tensors are read between
    two barriers: after every rank's last update of the epoch, before anyone's next lookup."""
    sync = run.emb is not None and run.ddp.world_size > 1
    if sync:
        dist.barrier()
    state = None
    if run.writer:
        state = {"format": CHECKPOINT_FORMAT, "epoch": done, "model": model_state(run.model),
                 "optimizer": run.opt.state_dict(),
                 "scheduler": run.sched.state_dict() if run.sched is not None else {},
                 "rng": {"torch": torch.get_rng_state()}, **_identity(run.cfg, run.info, run.ddp),
                 "run_dir": str(run.files.dir), "best": dict(fit.best),
                 "best_state": run.best_state or {},
                 "history": list(fit.history), "early_stop": fit.early.state(),
                 "node_tensors": ({"node_emb": run.emb.state_dict()}
                                  if run.emb is not None else {})}
    path = run.ckpt.save(state or {}, done)
    if run.writer:
        log.info("checkpoint %s", path)
    if sync:
        dist.barrier()


def _resolve_plan(cfg: TrainerConfig) -> dict:
    """Rank 0: the run directory and, with --resume, the checkpoint to continue from."""
    if not cfg.resume:
        run_dir = cfg.run_dir or str(Path("runs") / new_run_name())
        ckdir = checkpoint_dir_of(run_dir, cfg.checkpoint_dir)
        taken = [p for p in (Path(run_dir) / "metrics.jsonl", *list_checkpoints(ckdir))
                 if p.exists()]
        if taken:  # appending to its metrics or pruning its checkpoints would spoil it
            return {"error": f"{taken[0]} exists: another run used this directory; continue "
                             "it with --resume, or give this run another --run-dir / "
                             "--checkpoint-dir"}
        return {"run_dir": run_dir, "checkpoint_dir": str(ckdir)}
    ckdir = resume_location(cfg.run_dir, cfg.checkpoint_dir)
    if ckdir is None:
        return {"error": "--resume: no run under ./runs has a checkpoint; name the run to "
                         "continue with --run-dir DIR (or its checkpoints with "
                         "--checkpoint-dir DIR)"}
    found = list_checkpoints(ckdir)
    if not found:
        return {"error": f"--resume: no checkpoint (epoch-*.pt) in {ckdir}; check --run-dir / "
                         "--checkpoint-dir, or start the run without --resume"}
    # Found by --run-dir or the ./runs search: the run is the checkpoints' parent; by
    # --checkpoint-dir alone: the run directory recorded in the checkpoint.
    run_dir = cfg.run_dir or ("" if cfg.checkpoint_dir else str(ckdir.parent))
    return {"run_dir": run_dir, "checkpoint_dir": str(ckdir), "checkpoint": str(found[-1])}


def _plan_run(cfg: TrainerConfig, ddp: DDPSetup, device, info) -> tuple[dict, dict | None]:
    """Rank 0 decides the run directory and reads the checkpoint to resume; every rank gets
    both (bytes broadcast: other hosts need no shared filesystem) and checks the checkpoint
    against its own configuration and partition set."""
    plan, data = {}, None
    if ddp.rank == 0:
        plan = _resolve_plan(cfg)
        try:
            data = Path(plan["checkpoint"]).read_bytes() if "checkpoint" in plan else None
        except OSError as e:
            plan = {"error": f"--resume: cannot read {plan['checkpoint']}: {e}"}
    plan = json.loads(broadcast_bytes(json.dumps(plan).encode(), ddp.rank, ddp.world_size,
                                      device))
    if "error" in plan:
        raise ConfigError(plan["error"])
    if "checkpoint" not in plan:
        return plan, None
    ckpt = load_bytes(broadcast_bytes(data, ddp.rank, ddp.world_size, device),
                      plan["checkpoint"])
    check_compatible(ckpt, _identity(cfg, info, ddp), plan["checkpoint"])
    plan["run_dir"] = plan["run_dir"] or str(ckpt.get("run_dir") or "")
    if not plan["run_dir"]:
        raise ConfigError(f"checkpoint {plan['checkpoint']} names no run directory; pass "
                          "--run-dir DIR")
    return plan, ckpt


def _model_spec(cfg: TrainerConfig, info, task: Task | None = None) -> dict:
    """The model: its output width is the number of classes, or of tasks (one logit per
    binary task)."""
    out = task.num_tasks if task is not None and task.binary else info.num_classes
    name = model_name(cfg, info)  # --model auto; a homogeneous model on a typed set: refused
    if name in HETERO_MODEL_NAMES:
        return typed_spec(cfg, info, out)
    spec = {"name": name, "in_feats": info.feat_dim + cfg.node_emb_dim, "hidden": cfg.hidden,
            "num_classes": out, "num_layers": len(cfg.fanouts),
            "dropout": cfg.dropout}
    if name == "gat":
        spec["heads"] = cfg.gat_heads
    return spec


def _make_cache(cfg: TrainerConfig, pool: ServerPool, info, device) -> FeatureCache | None:
    if cfg.cache_ratio <= 0:
        return None
    cache = FeatureCache.fill(pool, info.num_parts, info.num_nodes, cfg.cache_ratio,
                              cfg.feat_transfer, device)
    log.info("feature cache: %d nodes, %.1f MB on %s", cache.num_cached, cache.nbytes / 1e6,
             device)
    return cache


def threads_cover_cores(device: torch.device) -> bool:
    """Whether this trainer computes on the CPU with more than one torch thread and at least
    as many threads as the cores it may run on: a server on this host then shares cores with
    those threads (``--prefetch auto`` alternates, see common/config.py's PREFETCH_HELP)."""
    threads = torch.get_num_threads()
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return device.type == "cpu" and threads > 1 and threads >= cores


def decide_local_features(cfg: TrainerConfig, info, device: torch.device) -> LocalFeatures:
    """``--local-features`` for this run (trainer_client/local_features.py)."""
    check_typed_run(cfg, info)  # (a typed set's model and options, named first)
    name = model_name(cfg, info)
    reads = name == "sage" and cfg.node_emb_dim == 0  # GraphSAGE reads SourceRows in place
    return open_local_features(cfg.local_features, cfg.parts_on_host, info, device,
                               cache_ratio=cfg.cache_ratio, feat_transfer=cfg.feat_transfer,
                               hetero=name in HETERO_MODEL_NAMES, model_reads_rows=reads)


def _make_loaders(cfg: TrainerConfig, ddp: DDPSetup, device, pool: ServerPool, info, cache,
                  ring, splits: dict, local: LocalFeatures | None = None
                  ) -> tuple[DistNodeDataLoader, dict]:
    """The training loader and the valid/test loaders (splits too small for every rank to get
    a seed are not evaluated)."""
    covered = threads_cover_cores(device)
    # --yield-cores: for a trainer that may take turns with servers on this host
    # (servers on this host: the ring's, or the set's files read here)
    on_host = ring is not None or (local is not None and local.used)
    alternates = covered and (cfg.prefetch == "alternate"
                              or (cfg.prefetch == "auto" and on_host))
    turns = CoreTurns.start(cfg.yield_cores, alternates)
    # Deterministic sampling: the same MFGs in a resumed run as in an uninterrupted one.
    common = dict(rank=ddp.rank, world_size=ddp.world_size, seed=cfg.seed,
                  max_inflight=cfg.max_inflight, prefetch=cfg.prefetch,
                  alternate_if_local=covered, device=device,
                  feat_transfer=cfg.feat_transfer, cache=cache, cache_ratio=cfg.cache_ratio,
                  ring=ring, deterministic=cfg.deterministic_sampling, turns=turns,
                  local_features=local.matrices if local is not None else None,
                  local_joined=local.joined if local is not None else None)
    train = DistNodeDataLoader(pool, splits["train"], info.node_offsets, fanouts=cfg.fanouts,
                               batch_size=cfg.batch_size, shuffle=True,
                               batch_locality=cfg.batch_locality,
                               **loader_args(cfg, info, cfg.fanouts, cfg.rel_fanouts), **common)
    eval_fanouts = cfg.eval_fanouts or cfg.fanouts
    # typed sets: --rel-fanouts applies to evaluation too, unless --eval-fanouts is given
    eval_typed = loader_args(cfg, info, eval_fanouts, "" if cfg.eval_fanouts else cfg.rel_fanouts)
    evals = {s: DistNodeDataLoader(pool, splits[s], info.node_offsets, fanouts=eval_fanouts,
                                   batch_size=cfg.eval_batch_size, shuffle=False,
                                   **eval_typed, **common)
             for s in ("valid", "test") if splits[s].numel() >= ddp.world_size}
    return train, evals


def _make_embedding(cfg: TrainerConfig, pool: ServerPool, info, run_dir: str):
    """The server-held learnable node embedding (``--node-emb-dim``), or None. Its table is
    named after the run directory: a new run starts from fresh rows even on servers that
    outlived an earlier run, a resumed run finds (and overwrites) its own."""
    if cfg.node_emb_dim <= 0:
        return None
    name = "node_emb-" + hashlib.sha1(run_dir.encode()).hexdigest()[:16]
    return NodeEmbedding(pool, name, info.num_nodes, cfg.node_emb_dim, lr=cfg.node_emb_lr,
                         seed=cfg.seed, node_offsets=info.node_offsets,
                         max_message_bytes=cfg.max_message_mb << 20)


def _build_run(cfg: TrainerConfig, ddp: DDPSetup, device, pool: ServerPool, info, plan: dict,
               ring, local: LocalFeatures | None = None) -> Run:
    check_typed_run(cfg, info)  # typed sets: model, options (trainer_client/typed.py)
    task = task_of(info)
    spec = _model_spec(cfg, info, task)
    model = build_model(spec).to(device)
    # typed models: relations / node types without destinations or edges in a batch (and the
    # last layer's non-seed types) leave parameters unused; DDP must look for them every step
    typed = spec["name"] in HETERO_MODEL_NAMES
    net = DDP(model, find_unused_parameters=typed) if ddp.world_size > 1 else model
    opt = build_optimizer(net.parameters(), cfg.lr, cfg.weight_decay)
    cache = _make_cache(cfg, pool, info, device)
    splits = {s: pool.seeds(s) for s in ("train", "valid", "test")}
    train, evals = _make_loaders(cfg, ddp, device, pool, info, cache, ring, splits, local)
    files = RunFiles(plan["run_dir"])
    return Run(cfg=cfg, ddp=ddp, device=device, info=info, pool=pool, spec=spec, model=model,
               net=net, opt=opt, sched=make_scheduler(opt, cfg), train_loader=train,
               eval_loaders=evals, splits=splits, cache=cache, files=files,
               ckpt=Checkpointer(plan["checkpoint_dir"], cfg.checkpoint_every, ddp.rank == 0),
               emb=_make_embedding(cfg, pool, info, plan["run_dir"]),
               show=bars_allowed(cfg.progress, ddp.launcher_tty) and ddp.rank == 0, task=task,
               profiler=(StepProfiler(cfg.profile_steps, device, files.profile)
                         if cfg.profile_steps > 0 and ddp.rank == 0 else None),
               local=local)


def _start(run: Run, plan: dict, ckpt: dict | None) -> FitState:
    """A fresh FitState, or the checkpoint's state loaded into the run; rank 0 prepares the
    run directory (config.json; on resume, metrics.jsonl cut back to the checkpoint)."""
    fit = FitState(early=EarlyStopping(run.cfg.patience), best=empty_best(run.metric))
    if ckpt is not None:
        run.model.load_state_dict(ckpt["model"])
        run.opt.load_state_dict(ckpt["optimizer"])
        if run.sched is not None:
            run.sched.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        fit.history, fit.best = list(ckpt["history"]), resumed_best(ckpt["best"], run.metric)
        fit.early.load(ckpt["early_stop"])
        fit.start_epoch = int(ckpt["epoch"])
        run.ckpt.kept = [plan["checkpoint"]]
        if run.emb is not None:
            if run.writer:
                run.emb.load_state_dict(ckpt["node_tensors"]["node_emb"])
            if run.ddp.world_size > 1:
                dist.barrier()  # the servers hold the saved rows before anyone looks up
    if run.writer:
        run.files.create()
        run.files.write_config({"trainer": to_dict(run.cfg), "dataset": run.info.dataset,
                                "set_id": run.info.set_id, "world_size": run.ddp.world_size,
                                "model_spec": run.spec})
        if ckpt is not None:
            run.files.truncate_metrics(fit.start_epoch - 1)
            run.best_state = ckpt.get("best_state") or None
            if run.best_state is not None:
                _write_best(run, fit)  # the checkpoint's best, not a later one of the killed run
            log.info("resuming from %s after epoch %d", plan["checkpoint"], fit.start_epoch)
            if not run.cfg.deterministic_sampling:
                log.warning("--no-deterministic-sampling: the servers sample other MFGs than "
                            "the interrupted run would have; the result will differ from an "
                            "uninterrupted run's")
        log.info("run directory: %s", run.files.dir)
    return fit


def _round_or_none(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _summarize(run: Run, t_start: float, ring, fit: FitState, resumed: str | None) -> dict:
    """The run's summary (collectives: every rank calls it)."""
    cfg, ddp, device, pool, st = run.cfg, run.ddp, run.device, run.pool, run.train_loader.stats
    seeds_total, train_s_sum = _all_sum([st.seeds, fit.train_s], ddp, device)
    mean_train_s = train_s_sum / ddp.world_size
    local = st.stage_seconds(fit.compute_s, fit.loss_read_s)
    stages = {name: round(v, 4)
              for name, v in zip(local, _all_sum(list(local.values()), ddp, device))}
    remote_requests, remote_bytes = _all_sum(
        [st.server.remote_requests, st.server.remote_bytes], ddp, device)
    emb_bytes = _release_embedding(run)
    pool.close()
    bytes_rx = _all_sum([pool.bytes_received], ddp, device)[0]
    epochs_done = fit.history[-1]["epoch"] + 1 if fit.history else 0
    m = run.metric
    return {
        f"test_{m}": round(fit.best[f"test_{m}"], 4),
        f"valid_{m}": round(fit.best[f"valid_{m}"], 4),
        "eval_metric": m,
        "task_type": run.task.task_type,
        "num_tasks": run.task.num_tasks,
        "best_epoch": fit.best["epoch"],
        "epochs": cfg.epochs,
        "epochs_done": epochs_done,
        "stopped_early": fit.early.stopped and epochs_done < cfg.epochs,
        "resumed_from": resumed,
        "seeds_per_s": round(seeds_total / max(mean_train_s, 1e-9), 1),
        "train_s": round(mean_train_s, 3),
        "wall_s": round(time.perf_counter() - t_start, 3),
        "num_trainers": ddp.world_size,
        "num_parts": run.info.num_parts,
        "dataset": run.info.dataset,
        "model": run.spec["name"],
        "batches_per_epoch_per_trainer": len(run.train_loader),
        "bytes_received": int(bytes_rx),
        "server_to_server_requests": int(remote_requests),
        "server_to_server_bytes": int(remote_bytes),
        "failovers": pool.failovers,
        "cache": _cache_summary(run),
        "local_features": run.local.summary() if run.local is not None else None,
        "device": str(device),
        "stages_s": stages,
        # the share of the host-to-device copy time hidden behind compute (CUDA; None on CPU)
        "h2d_hidden_share": _round_or_none(hidden_share(
            stages["h2d_s"], stages["h2d_wait_s"], stages["h2d_copy_s"])),
        "malloc_retain_mb": _RETAINED_MB,  # 0: the allocator's defaults (see common/alloc.py)
        # the first steps' heap faulted in during setup (common/alloc.py HeapPrefault): MiB,
        # the thread's seconds, whether it was done when training started; or why not
        "heap_prefault": _prefault_summary(run),
        # OpenMP's wait policy for this rank's torch threads (worker mode chooses it per
        # role, deploy/worker_mode.py's child_env); "default": not set, libgomp's own
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
        # --matmul-precision as it took effect: how SAGEConv's products got bfloat16
        # ("onednn": torch's medium, "cast": its own casts, None: float32; model.py's
        # bf16_products), and whether the layers' rows were bucketed for it (gemm_rows)
        "matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_products": bf16_products(device),
        "gemm_row_buckets": gemm_buckets(device),
        # how many of this rank's model products (training and evaluation) took each of
        # those routes in this run: what the model did, not only what the device offers
        "bf16_products_run": dict(PRODUCTS_RUN),
        # --cpu-gemm: which library multiplied the float32 products (model.py)
        "cpu_gemm": cpu_gemm_summary(device),
        "shm_ring": _ring_summary(run, ring),
        "prefetch": {"mode": cfg.prefetch, "alternated": run.train_loader.alternating(),
                     "bursts": run.train_loader.stats.bursts},
        "core_turns": (run.train_loader.turns.summary() if run.train_loader.turns is not None
                       else None),
        "node_embedding": ({"dim": cfg.node_emb_dim, "bytes_per_server": emb_bytes,
                            "ntypes": featureless(run.info)}  # typed: the types it feeds
                           if emb_bytes is not None else None),
        "final_loss": round(fit.history[-1]["loss"], 4) if fit.history else None,
        "config": {k: v for k, v in to_dict(cfg).items()
                   if k in ("fanouts", "batch_size", "hidden", "lr", "dropout", "model",
                            "eval")},
        "run_dir": str(run.files.dir),
        "files": run.files.files(run.ckpt.kept, fit.best["epoch"] >= 0,
                                 run.profiler is not None and run.profiler.written),
    }


def _release_embedding(run: Run) -> dict | None:
    """Bytes per server of the node embedding, which rank 0 then frees on the servers (every
    rank is past its last update: this follows a collective after the last epoch). Its rows
    live on in the checkpoints."""
    if run.emb is None:
        return None
    nbytes = {str(part): n for part, n in run.emb.nbytes_per_server().items()}
    if run.writer:
        run.emb.tensor.drop()
    return nbytes


def _cache_summary(run: Run) -> dict | None:
    cache = run.cache
    if cache is None:
        return None
    return {"ratio": run.cfg.cache_ratio, "nodes": cache.num_cached,
            "rows_from_cache": int(_all_sum([cache.rows_served], run.ddp, run.device)[0]),
            "bytes_saved": int(_all_sum([cache.bytes_saved], run.ddp, run.device)[0])}


def _ring_summary(run: Run, ring) -> dict | None:
    if ring is None:
        return None
    st = run.train_loader.stats
    return {"slots": ring.num_slots, "slot_mb": round(ring.slot_bytes / 2**20, 1),
            "slots_used": len(ring.touched), "pinned": ring.pinned, "used": st.ring_hits > 0,
            "servers_without_ring": sorted(run.train_loader.no_ring),
            "replies_in_ring": st.ring_hits, "requests_without_slot": st.ring_misses}


def _wait_warm(local: LocalFeatures) -> None:
    """Before the first step: the set's feature files read into the page cache in order
    (trainer_client/local_features.py), where the trainer reads them in place."""
    if local.warmer is None:
        return
    if not local.warmer.done:
        log.info("reading the partition set's features into the page cache (%.0f MB)",
                 sum(os.path.getsize(p) for p in local.warmer.paths) / 1e6)
    s = local.wait_warm()
    log.info("page cache: %s", dumps_strict(s))


def _prefault_heap(cfg: TrainerConfig, info, device: torch.device) -> HeapPrefault | dict:
    """On a CPU trainer, fault in the heap its first steps will use while the rest of its
    setup runs (common/alloc.py :class:`HeapPrefault`, sized by :func:`step_heap_mb`);
    a GPU trainer's step lives in device memory."""
    if device.type != "cpu":
        return {"mb": 0, "reason": f"the step runs on {device.type}"}
    estimate = step_heap_mb(max_input_rows(cfg.batch_size, cfg.fanouts[1:], info.num_nodes),
                            info.feat_dim + cfg.node_emb_dim, cfg.hidden)
    return prefault_step_heap(_RETAINED_MB, estimate)


def _prefault_summary(run: Run) -> dict | None:
    p = run.prefault
    return p.summary() if isinstance(p, HeapPrefault) else p


def _run_trainer(cfg: TrainerConfig, ddp: DDPSetup, deliver, done_file: str) -> dict:
    t_start = time.perf_counter()
    PRODUCTS_RUN.clear()  # the summary counts this run's products only
    device = _init_ddp(cfg, ddp)
    ring = pool = None
    try:
        pool = make_pool(cfg)
        info = pool.info()
        prefault = _prefault_heap(cfg, info, device)
        plan, ckpt = _plan_run(cfg, ddp, device, info)
        local = decide_local_features(cfg, info, device)
        # no ring where the servers send no features
        ring = None if local.used else make_ring(cfg, info, device)
        run = _build_run(cfg, ddp, device, pool, info, plan, ring, local)
        _wait_warm(local)
        run.prefault = prefault
        if isinstance(prefault, HeapPrefault):
            prefault.training_starts()
        fit = _fit(run, _start(run, plan, ckpt))
        del ckpt
        summary = _summarize(run, t_start, ring, fit, plan.get("checkpoint"))
        if run.writer:
            run.files.write_summary(summary)
        _finish(summary, ddp, deliver, done_file)
        return summary
    finally:
        try:
            if pool is not None:
                pool.close()
        except Exception:
            pass
        if ring is not None:
            ring.close()
        if ddp.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def write_summary(summary: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(dumps_strict(summary))
    os.replace(tmp, path)
