"""The trainer's feature cache (``--cache-ratio``) on typed (heterogeneous) partition sets.

Servers leave out the rows of the nodes a trainer caches (a present-mask per NodeSet of a typed
MFG, over the set's one global id space); the loader completes each NodeSet from its one
:class:`~trainer_client.feature_cache.FeatureCache`, through the code homogeneous MFGs take.

A generated ogbn-mag-shaped graph (partition/maggen.py, 2000 papers) is partitioned into 2
parts by ``partition-ogbn`` (hot_rank.npy pre-sampled, as by default). hot_rank.npy ranks the
featured type (papers) first and the featureless types after it, so at ratio 0.5 a part's
cache holds all its papers and some of every featureless type: the tests use it so that rows
of every type are left out.

* Loader level (real servers, real sockets): batches with the cache equal, type by type and
  bit for bit, those of a loader without it (same deterministic sample seeds), with the
  shared-memory ring (the default path) and without, in float32 and with float16 /
  bfloat16 transfer;
  the cache served rows of every type and the replies carried that many fewer rows. With the
  ring, every type's rows are copied out of the slot while decoding, so held batches keep no
  slot.
* End to end: worker-mode training with ``--cache-ratio`` trains exactly as without it (same
  batches, same features) and its summary reports the rows the cache served.
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

from common.shm_ring import ShmRing
from tests.test_mfg_oracle import start_cluster
from trainer_client.feature_cache import FeatureCache
from trainer_client.loader import DistNodeDataLoader
from trainer_client.server_pool import ServerPool

REPO = Path(__file__).resolve().parents[1]
PAPERS = 2000
RATIO = 0.5
FANOUTS = [5, 5]
BAR = 0.3  # test accuracy clearly above chance (1/16); see tests/test_hetero_train.py
TRAIN = ["--fanouts", "10,5", "--batch-size", "128", "--hidden", "32", "--dropout", "0",
         "--lr", "0.01", "--no-progress", "--num-trainers", "1"]


def _run(module: str, args: list, tmp: Path, timeout: float) -> subprocess.CompletedProcess:
    run_tmp = tmp / "t"
    run_tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(run_tmp),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def mag(tmp_path_factory) -> dict[str, Path]:
    """One generated raw dataset in 2 parts, with hot_rank.npy: featureless types as
    generated ("plain"), and every type with derived features ("mean")."""
    tmp = tmp_path_factory.mktemp("magcache")
    raw = tmp / "raw"
    out = {}
    for name, extra in (("plain", []), ("mean", ["--derive-features", "mean"])):
        src = (["--dataset-dir", raw] if raw.exists() else
               ["--dataset", "synthetic-mag", "--num-nodes", PAPERS, "--raw-out", raw])
        r = _run("partition.cli", [*src, "--num-parts", 2, "--out", tmp / name,
                                   "--add-reverse-edges", "--no-progress", *extra], tmp, 240)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (tmp / name / "hot_rank.npy").is_file(), "partition-ogbn wrote no hot_rank.npy"
        out[name] = tmp / name
    return out


def _epoch(loader: DistNodeDataLoader, held: list | None = None) -> list[tuple[dict, dict]]:
    """Every batch's (input ids, features) per node type; ``held``: the batches themselves
    (their tensors, ring views included) are appended to it."""
    out = []
    for _, _, mfg in loader:
        out.append(({t: i.clone() for t, i in mfg.input_nodes.items()},
                    {t: f.clone() for t, f in mfg.feat.items()}))
        if held is not None:
            held.append(mfg)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path,transfer", [("ring", ""), ("wire", ""), ("ring", "float16"),
                                            ("wire", "bfloat16")])
def test_typed_batches_with_the_cache_equal_those_without(path, transfer, mag, server_factory,
                                                          tmp_path):
    from partition.layout import PartitionSetMeta, cached_mask, load_hot_rank, load_partition

    parts = mag["mean"]
    meta = PartitionSetMeta.load(parts)
    cluster = start_cluster(server_factory, parts, tmp_path, 2)
    pool = ServerPool(cluster, timeout_s=60, max_message_bytes=256 << 20)
    slot_bytes = meta.num_nodes * meta.feat_dim * 4  # any batch's rows fit
    rings = []
    try:
        info = pool.info()
        seeds = pool.seeds("train")
        assert seeds.numel() > 1000

        def loader(cache: FeatureCache | None, ring: ShmRing | None) -> DistNodeDataLoader:
            return DistNodeDataLoader(pool, seeds, info.node_offsets, fanouts=FANOUTS,
                                      batch_size=128, shuffle=False, seed=5, max_inflight=3,
                                      feat_transfer=transfer, cache=cache, cache_ratio=RATIO,
                                      ring=ring, hetero=True, seed_ntype="paper")

        def new_ring(slots: int) -> ShmRing | None:
            if path != "ring":
                return None
            rings.append(ShmRing(slots, slot_bytes))
            return rings[-1]

        plain = loader(None, new_ring(8))
        rx0 = pool.bytes_received
        want = _epoch(plain)
        plain_rx = pool.bytes_received - rx0

        cache = FeatureCache.fill(pool, 2, info.num_nodes, RATIO, transfer, torch.device("cpu"))
        sizes = np.diff(meta.node_offsets)
        assert cache.num_cached == sum(int(RATIO * s) for s in sizes)
        # Three slots for three requests in flight: every batch is held to the end, yet none
        # keeps its slot (each type's rows were copied out of it when decoded).
        ring = new_ring(3)
        cached = loader(cache, ring)
        rx0 = pool.bytes_received
        held: list = []
        got = _epoch(cached, held)
        cached_rx = pool.bytes_received - rx0
        if ring is not None:
            assert len(held) == len(got) and not ring.in_use, "a held batch keeps its slot"
        del held

        assert len(got) == len(want) == len(plain) > 5
        dtype = getattr(torch, transfer or "float32")
        rank, offsets = np.asarray(load_hot_rank(parts)), meta.node_offsets
        left_out = dict.fromkeys(meta.ntypes, 0)
        for (ids_w, feat_w), (ids_g, feat_g) in zip(want, got):
            assert ids_w.keys() == ids_g.keys() == feat_g.keys()
            for t in ids_w:
                assert torch.equal(ids_w[t], ids_g[t]), t  # the same sample seeds
                assert feat_g[t].dtype == feat_w[t].dtype == dtype
                assert torch.equal(feat_g[t], feat_w[t]), f"type {t}: features differ"
                left_out[t] += int(cached_mask(rank, ids_g[t].numpy(), offsets, RATIO).sum())
        assert all(n > 0 for n in left_out.values()), left_out  # every type had cached rows
        served = sum(left_out.values())
        assert cache.rows_served == served == cached.stats.server.cached_rows
        assert plain.stats.server.cached_rows == 0

        # The truth, once: the original rows (the partition's feature matrix).
        feat = np.concatenate([np.asarray(load_partition(parts, p).feat) for p in range(2)])
        for t, ids in got[0][0].items():
            assert torch.equal(got[0][1][t], torch.from_numpy(feat[ids.numpy()]).to(dtype)), t

        # Fewer rows in the replies: `served` rows fewer in the ring, or fewer bytes on the wire.
        if path == "ring":
            assert cached.stats.ring_hits == len(got) and cached.stats.ring_misses == 0
            assert plain.stats.ring_hits > 0
            s_plain, s_cached = plain.stats.server, cached.stats.server
            assert s_plain.shm_rows > 0 and plain.stats.ring_misses == 0
            assert s_cached.shm_rows == s_plain.shm_rows - served
        else:
            row_bytes = meta.feat_dim * dtype.itemsize
            assert plain_rx - cached_rx >= served * row_bytes * 0.9, (plain_rx, cached_rx)
        for r in rings:  # every slot back once no batch is held
            assert not r.in_use and not r.poisoned
            assert sorted(r.free + [s for s, _ in r.pending]) == list(range(r.num_slots))
    finally:
        pool.close()
        for r in rings:
            r.close()


def _worker(parts: Path, args: list, tmp: Path, timeout: float = 240) -> dict:
    proc = _run("deploy.worker_mode", ["--parts", parts, *TRAIN, *args], tmp, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    assert lines, "nothing on stdout"
    s = json.loads(lines[-1])
    assert s["model"] == "rsage" and s["dataset"] == "synthetic-mag"
    return s


@pytest.mark.timeout(500)
def test_worker_mode_trains_a_typed_set_with_the_cache(mag, tmp_path):
    """Featureless types from server-held embeddings, features through the ring (the
    default), the cache on: the same training as without the cache, fewer bytes received."""
    from partition.layout import PartitionSetMeta

    parts = mag["plain"]
    args = ["--epochs", 2, "--node-emb-dim", 16]
    s = _worker(parts, [*args, "--cache-ratio", RATIO, "--run-dir", tmp_path / "c"], tmp_path)
    assert s["test_acc"] > BAR, s
    assert s["shm_ring"]["used"] and s["shm_ring"]["replies_in_ring"] > 0
    c = s["cache"]
    sizes = np.diff(PartitionSetMeta.load(parts).node_offsets)
    assert c["ratio"] == RATIO and c["nodes"] == sum(int(RATIO * n) for n in sizes)
    assert c["rows_from_cache"] > 0 and c["bytes_saved"] > 0, c
    # Deterministic sampling: the same batches without the cache, and the same features.
    w = _worker(parts, [*args, "--run-dir", tmp_path / "n"], tmp_path)
    assert w["cache"] is None
    assert w["final_loss"] == pytest.approx(s["final_loss"], rel=1e-3, abs=1e-4)
    assert w["valid_acc"] == pytest.approx(s["valid_acc"], abs=0.002)
