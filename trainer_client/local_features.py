"""Input features read from the partition files on this host (``--local-features``).

A server gathers each batch's input rows (hundreds of thousands of rows, ~150 MB on the
products-shaped graph) into the trainer's ring slot, and a CPU trainer's first layer reads
that copy once, in its mean. When the trainer runs on the host that holds the partition set
(worker mode), the gather's copy is not needed: the trainer maps every part's ``feat.npy``
(the same page cache the servers read: nothing loaded twice), asks for no features
(``SampleRequest.with_feat=False``), and hands the model :class:`~common.mfg.SourceRows`,
which SAGEConv's mean reads row by row from the matrices (trainer_client/model.py,
``mean_and_self_rows``). Several parts' maps are joined into one matrix where the platform
allows (common/joined_rows.py: one address range, no copy), so the mean reads one matrix as
with a one-part set; else it reads them part by part. DGL's in-process pipeline reads its
feature tensor the same way.

The servers no longer read ``feat.npy``, so nothing keeps it in the page cache; a map's
random reads of a file the cache has lost fault it in a page at a time (the first step 20x
slower, common/page_cache.py). The files' missing blocks are read in order in a background
thread from the moment they are mapped (:class:`~common.page_cache.Warmer`), and the trainer
waits for that pass before its first step (:meth:`LocalFeatures.wait_warm`), as DGL's
pipeline loads its features before its first.

It applies (``auto``) to a CPU trainer of a homogeneous float32 set whose parts it can all
open here with the servers' ``set_id``, without a feature cache or ``--feat-transfer``,
whose model reads source rows (GraphSAGE); ``on`` insists (a clear error naming what is
missing), ``off`` keeps the servers' gather. A GPU trainer needs the copy anyway: its
features travel to the device from the ring slot.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.config import LOCAL_FEATURE_MODES
from common.errors import ConfigError
from common.joined_rows import JoinedRows, join
from common.page_cache import Warmer
from partition.layout import PartitionSetMeta, load_partition

WARM_WAIT_S = 300.0  # the longest a trainer waits for its files' pass into the page cache


@dataclass
class LocalFeatures:
    """The decision and, where it applies, each part's feature matrix (read-only maps, in
    part order: node ``gid`` of part ``p`` is row ``gid - node_offsets[p]`` of ``p``'s)."""

    mode: str
    matrices: list[Tensor] | None
    reason: str  # why not, where not used; "" where used
    # several parts' maps as one matrix (common/joined_rows.py), where they could be joined
    joined: JoinedRows | None = None
    joined_reason: str = ""  # why not joined, where used without
    # the files read into the page cache in order before the first step (where used)
    warmer: Warmer | None = None

    @property
    def used(self) -> bool:
        return self.matrices is not None

    def summary(self) -> dict:
        out: dict = {"mode": self.mode, "used": self.used}
        if self.reason:
            out["reason"] = self.reason
        if self.used and len(self.matrices) > 1:
            out["parts"] = len(self.matrices)
            out["joined"] = self.joined is not None
            if self.joined_reason:
                out["joined_reason"] = self.joined_reason
        if self.warmer is not None:
            out["page_cache"] = self.warmer.summary()
        return out

    def wait_warm(self, timeout: float | None = WARM_WAIT_S) -> dict | None:
        """Wait (at most ``timeout`` seconds; the pass goes on after) for the files' pass into
        the page cache; its summary, or None where the features are not read here."""
        return self.warmer.wait(timeout) if self.warmer is not None else None


def _why_not(parts: str, info, device: torch.device, *, cache_ratio: float,
             feat_transfer: str, hetero: bool, model_reads_rows: bool, mode: str) -> str:
    if not parts:
        return ("no partition set on this host was given (--parts-on-host; worker mode sets "
                "it)")
    if device.type != "cpu":
        return f"the trainer computes on {device.type}, which needs the features copied there"
    if hetero or info.ntypes:
        return "a typed (heterogeneous) set"
    if cache_ratio > 0:
        return "--cache-ratio is set (the cache serves the rows instead)"
    if feat_transfer:
        return f"--feat-transfer {feat_transfer} asks for the rows converted by the servers"
    if info.feat_dtype != "float32":
        return f"the set stores {info.feat_dtype} features; read in place: float32 only"
    if mode == "auto" and not model_reads_rows:
        return ("the model does not read source rows in place (GraphSAGE without "
                "--node-emb-dim does)")
    return ""


def open_local_features(mode: str, parts: str, info, device: torch.device, *,
                        cache_ratio: float = 0.0, feat_transfer: str = "",
                        hetero: bool = False, model_reads_rows: bool = True) -> LocalFeatures:
    """Decide ``--local-features`` (``mode``) for a trainer whose servers answered ``info``
    (their Pong) and, where it applies, map every part's features. A set on this host that
    lacks a part: not used under ``auto`` (the reason names the part). ``on`` where it cannot
    apply, or a set on this host that is not the servers' (another ``set_id``, partitioning,
    shape or dtype): :class:`ConfigError`."""
    if mode not in LOCAL_FEATURE_MODES:
        raise ConfigError(f"--local-features must be one of {LOCAL_FEATURE_MODES}, got "
                          f"{mode!r}")
    if mode == "off":
        return LocalFeatures(mode, None, "off")
    why = _why_not(parts, info, device, cache_ratio=cache_ratio, feat_transfer=feat_transfer,
                   hetero=hetero, model_reads_rows=model_reads_rows, mode=mode)
    if why:
        if mode == "on":
            raise ConfigError(f"--local-features on cannot apply: {why}; use --local-features "
                              "auto or off")
        return LocalFeatures(mode, None, why)
    try:
        meta = PartitionSetMeta.load(parts)
    except Exception as e:  # noqa: BLE001 - the reason is reported, the run goes on
        raise ConfigError(f"--parts-on-host {parts}: cannot read the partition set ({e}); "
                          "give the set the servers serve, or --local-features off") from e
    if (meta.set_id != info.set_id or meta.num_nodes != info.num_nodes
            or meta.num_parts != info.num_parts
            or list(meta.node_offsets) != list(info.node_offsets)):
        raise ConfigError(
            f"--parts-on-host {parts} is not the set the servers serve (set_id "
            f"{meta.set_id!r}, {meta.num_nodes} nodes in {meta.num_parts} parts; servers: "
            f"{info.set_id!r}, {info.num_nodes} nodes in {info.num_parts} parts); give their "
            "set or --local-features off")
    matrices, maps = [], []
    for p in range(meta.num_parts):
        try:
            feat = load_partition(parts, p, mmap=True).feat
        except Exception as e:  # noqa: BLE001 - a part held elsewhere: named, not fatal
            why = f"part {p} of {parts} cannot be read here ({e})"
            if mode == "on":
                raise ConfigError(f"--local-features on cannot apply: {why}; use "
                                  "--local-features auto or off") from e
            return LocalFeatures(mode, None, why)
        rows = info.node_offsets[p + 1] - info.node_offsets[p]
        if feat.dtype != np.float32 or feat.shape != (rows, info.feat_dim):
            raise ConfigError(f"--parts-on-host {parts}: part {p}'s feat.npy is {feat.dtype} "
                              f"{feat.shape}, the servers serve float32 ({rows}, "
                              f"{info.feat_dim}); give their set or --local-features off")
        maps.append(feat)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only map; never written
            matrices.append(torch.from_numpy(feat))
    warmer = Warmer([str(m.filename) for m in maps])
    joined, why_not_joined = join(maps, info.node_offsets) if len(maps) > 1 else (None, "")
    return LocalFeatures(mode, matrices, "", joined, why_not_joined, warmer)
