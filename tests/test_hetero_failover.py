"""Failover with typed (heterogeneous) batches, the shared-memory ring on (issue 11: failover
works for typed graphs through the one code path).

A small ogbn-mag-shaped set (every type featured: ``--derive-features mean``, as a set served
by replicas is run: server-held embeddings refuse replicas), 2 parts, 2 replicas per part.

* In process: the trainer's typed loader (``loader_args`` of trainer_client/typed.py, the ring
  of trainer_client/train.py ``make_ring``) iterates an epoch while a replica of part 0 is
  frozen (SIGSTOP) and then killed (SIGKILL) with requests in flight on it: every training
  seed is seen exactly once, requests were re-sent, and every batch, those after the failover
  included, is a correct typed MFG: the seed type's output nodes are the batch, each type's
  input ids are of that type, its feature rows and the seeds' labels are the servers' own.
* End to end: server-client mode (``trainer-client`` against the 4 servers) with a replica
  frozen, then killed, mid-training: the run finishes with exit 0 and its summary counts the
  failovers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import REPO, clean_env, tail
from rpc_helpers import call

from common.cluster import ClusterSpec
from common.config import TrainerConfig
from common.messages import NodeDataReply, NodeDataRequest, StatsReply, StatsRequest
from common.mfg import NID, HeteroMFG
from common.rpc import expect
from trainer_client.loader import DistNodeDataLoader
from trainer_client.server_pool import ServerPool
from trainer_client.train import make_ring
from trainer_client.typed import loader_args

pytestmark = pytest.mark.timeout(300)

PAPERS = 400
PEER_TIMEOUT_S = 2.0  # servers' deadline for each other; the trainer's is longer
FANOUTS = [4, 3]
REL_FANOUTS = "cites=2/rev_writes=1"  # per-relation fanouts, as a user would give them


@pytest.fixture(scope="module")
def mag2(tmp_path_factory) -> Path:
    from partition.hetero import load_hetero
    from partition.maggen import generate_mag, write_mag_raw
    from partition.partitioner import partition_graph

    root = tmp_path_factory.mktemp("magfo")
    raw = write_mag_raw(generate_mag(PAPERS, feat_dim=8, num_classes=4, seed=5), root / "raw",
                        progress=False)
    data = load_hetero(dataset_dir=str(raw), add_reverse_edges=True, derive_features="mean",
                       work_dir=str(root / "work"))
    out = root / "p2"
    partition_graph(data, 2, str(out), method="metis", seed=0, progress=False,
                    presample_batches=2, presample_batch_size=64)
    return out


def _replicated(server_factory, parts: Path, tmp: Path) -> tuple[ClusterSpec, Path, dict]:
    cluster = ClusterSpec({p: [f"ipc://{tmp}/h{p}r{r}.sock" for r in range(2)]
                           for p in range(2)})
    path = tmp / "cluster.yaml"
    cluster.write(path)
    servers = {ep: server_factory(parts, p, cluster=path, endpoint=ep,
                                  extra=["--peer-timeout-s", str(PEER_TIMEOUT_S)])
               for p, ep in cluster.all_endpoints()}
    return cluster, path, servers


def _wait_until(cond, timeout: float, what: str, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(poll)


class _Watch:
    """What the trainer's thread is doing, as seen from the test's killer thread: the
    request it waits for (``ServerPool.wait`` wrapped on this pool instance only)."""

    def __init__(self, pool: ServerPool):
        self.pool = pool
        self.awaited = None  # the Handle pool.wait is waiting for now
        wait = pool.wait

        def watched(handle):
            self.awaited = handle
            try:
                return wait(handle)
            finally:
                self.awaited = None

        pool.wait = watched  # type: ignore[method-assign]

    def sent_after(self, endpoint: str, t: float) -> bool:
        """Whether a request sent to ``endpoint`` after ``t`` (perf_counter) is in flight.
        The dict may change meanwhile (then: not yet)."""
        try:
            handles = list(self.pool._inflight.values())
        except RuntimeError:
            return False
        return any(h.channel.endpoint == endpoint and h.sent_at > t for h in handles)


STUCK_S = 0.5  # waiting this long on a frozen server's request: its reply never left


def _freeze_then_kill(watch: _Watch, pid: int, endpoint: str) -> threading.Thread:
    """Freeze the replica (SIGSTOP) now, and kill it (SIGKILL) from a thread once one of its
    requests is surely unanswered, so that it must be re-sent: one sent after the freeze, or
    one sent before that the trainer has been waiting for over STUCK_S (a reply sent before
    the freeze would have ended that wait at once)."""
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.perf_counter()
    since: dict = {}  # awaited handle -> when first seen awaited

    def stuck() -> bool:
        if watch.sent_after(endpoint, stopped_at):
            return True
        h = watch.awaited
        if h is None or h.channel.endpoint != endpoint:
            return False
        first = since.setdefault(id(h), time.perf_counter())
        return time.perf_counter() - first > STUCK_S

    def kill_when_stuck() -> None:
        try:
            _wait_until(stuck, 60, "a request to the frozen replica")
        except AssertionError as e:
            killer.error = e  # type: ignore[attr-defined]
        finally:
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_stuck, daemon=True)
    killer.error = None  # type: ignore[attr-defined]
    killer.start()
    return killer


def _server_rows(pool: ServerPool, offsets: list[int], ids: torch.Tensor, label: bool
                 ) -> torch.Tensor:
    """The servers' feature rows (or labels) of ``ids``, asked of each owning part."""
    owner = torch.searchsorted(torch.tensor(offsets), ids, right=True) - 1
    out = None
    for p in owner.unique().tolist():
        idx = (owner == p).nonzero().flatten()
        req = NodeDataRequest(nodes=ids[idx], with_feat=not label, with_label=label,
                              set_id=pool.set_id)
        reply = expect(pool.wait(pool.submit(p, req)), NodeDataReply, f"part {p}")
        rows = reply.label if label else reply.feat
        if out is None:
            out = torch.empty((ids.numel(), *rows.shape[1:]), dtype=rows.dtype)
        out[idx] = rows
    assert out is not None
    return out


def test_replica_death_mid_epoch_typed_batches_ring_on(server_factory, mag2, tmp_path):
    cluster, path, servers = _replicated(server_factory, mag2, tmp_path)
    victim_ep = cluster.partitions[0][0]
    victim = servers[victim_ep]
    node_type = torch.from_numpy(np.load(mag2 / "node_type.npy").astype(np.int64))
    cfg = TrainerConfig(cluster=str(path), fanouts=FANOUTS, rel_fanouts=REL_FANOUTS,
                        batch_size=16, max_inflight=6)
    pool = ServerPool(cluster, timeout_s=60, max_message_bytes=64 << 20)
    ring = None
    try:
        info = pool.info()
        ring = make_ring(cfg, info, torch.device("cpu"))
        assert ring is not None, "no shared-memory ring on this host"
        typed = loader_args(cfg, info, cfg.fanouts, cfg.rel_fanouts)
        assert typed["hetero"] and typed["seed_ntype"] == info.predict_ntype == "paper"
        loader = DistNodeDataLoader(pool, pool.seeds("train"), info.node_offsets,
                                    fanouts=cfg.fanouts, batch_size=cfg.batch_size,
                                    max_inflight=cfg.max_inflight, shuffle=True, seed=3,
                                    ring=ring, **typed)
        expected = loader._batches()
        assert len(expected) >= 12, len(expected)
        types = [t.name for t in info.ntypes]
        seen, kept, failover_at = [], [], None
        killer, watch = None, _Watch(pool)
        t0 = time.monotonic()
        for i, (_, output_nodes, mfg) in enumerate(loader):
            assert isinstance(mfg, HeteroMFG) and mfg.seed_ntype == "paper"
            assert torch.equal(output_nodes, expected[i]), f"batch {i} is not its seeds"
            assert torch.equal(mfg.blocks[-1].dstdata["paper"][NID], output_nodes)
            seen.append(output_nodes.clone())
            # copies: the ring slot is free again once the batch is dropped
            kept.append((i, {t: ids.clone() for t, ids in mfg.input_nodes.items()},
                         {t: x.clone() for t, x in mfg.feat.items()}, mfg.label.clone()))
            if failover_at is None and pool.failovers:
                failover_at, ring_hits_then = i, loader.stats.ring_hits
            if i == 3:
                killer = _freeze_then_kill(watch, victim.proc.pid, victim_ep)
            del mfg
        assert killer is not None
        epoch_s = time.monotonic() - t0
        killer.join(timeout=70)
        assert not killer.is_alive() and killer.error is None, killer.error
        seen_all = torch.cat(seen)
        # every training seed exactly once, re-sent requests included
        assert seen_all.numel() == loader.seeds.numel()
        assert torch.equal(torch.sort(seen_all).values, torch.sort(loader.seeds).values)
        assert pool.failovers >= 1, "requests in flight on the dead replica were not re-sent"
        assert failover_at is not None and failover_at < len(expected) - 1
        # the surviving replicas kept writing into the ring after the failover
        assert loader.stats.ring_hits > ring_hits_then, loader.stats

        print(f"\n{len(expected)} typed batches in {epoch_s:.1f}s, {pool.failovers} re-sent "
              f"(first seen after batch {failover_at}), {loader.stats.ring_hits} replies in "
              f"the ring, {loader.stats.ring_misses} requests without a slot")
        # Every batch's typed structure and rows, those after the failover included.
        after = 0
        for i, ids, feat, label in kept:
            assert set(ids) <= set(types) and set(feat) == set(ids)
            for t, x in ids.items():
                assert bool((node_type[x] == types.index(t)).all()), f"batch {i}: {t} ids"
                assert feat[t].shape == (x.numel(), info.feat_dim)
                if x.numel():
                    want = _server_rows(pool, info.node_offsets, x, label=False)
                    assert torch.equal(feat[t], want.to(feat[t].dtype)), f"batch {i}: {t} rows"
            assert torch.equal(label, _server_rows(pool, info.node_offsets, expected[i],
                                                   label=True)), f"batch {i}: labels"
            assert ids["paper"][:expected[i].numel()].equal(expected[i])
            after += i >= failover_at
        assert after >= 2, (failover_at, len(kept))
        assert victim.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        pool.close()
        if ring is not None:
            ring.close()
    victim.stop_and_check(expect_code=None)  # killed: -SIGKILL, checked above
    for ep, s in servers.items():
        if ep != victim_ep:
            s.stop_and_check()  # the survivors kept serving and stop cleanly (exit 0)


def _warnings(log: Path) -> str:
    """The trainer's warning lines (a replica dropped idle is one; see ReplicaSet.healthy)."""
    return "\n".join(line for line in log.read_text().splitlines() if " W [" in line)


def _sample_requests(endpoint: str) -> float:
    return call(endpoint, StatsRequest(), StatsReply, timeout_s=30).values["sample_requests"]


# The replica is frozen once the trainer has logged epoch 0 (and the replica has served 3
# requests). Every epoch after that must still send it requests (round-robin), or the run can
# end before the trainer notices: with 4 epochs (0.4 s each after the first) a fast machine
# finished the run first (1 failure in a clean-clone suite run). 40 epochs leave the test's
# poll well over 10 s to act in. Not earlier than that: epoch 0 (seconds) holds the one-time
# setup, and a freeze just after the replica answered its requests can then pass
# --heartbeat-timeout-s with nothing in flight on it; the trainer drops it idle, skips it, and
# nothing is ever re-sent (a clean-clone suite run failed so: 40 epochs, 0 failovers).
EPOCHS = 40


def test_server_client_run_survives_a_replica_death(server_factory, mag2, tmp_path):
    """trainer-client (ring on: the default) against 2 parts x 2 replicas; a replica of part 0
    is frozen mid-training, its requests re-sent once the trainer sees it frozen, then it is
    killed; the run finishes (exit 0) and reports the failovers."""
    cluster, path, servers = _replicated(server_factory, mag2, tmp_path)
    victim_ep = cluster.partitions[0][1]
    victim = servers[victim_ep]
    out, err = tmp_path / "t.out", tmp_path / "t.err"
    argv = [sys.executable, "-m", "deploy.trainer_cli", "--cluster", str(path),
            "--fanouts", ",".join(map(str, FANOUTS)), "--rel-fanouts", REL_FANOUTS,
            "--batch-size", "16", "--hidden", "16", "--epochs", str(EPOCHS), "--no-progress",
            "--num-threads", "1", "--request-timeout-s", "60",
            "--run-dir", str(tmp_path / "run")]
    with open(out, "w") as fo, open(err, "w") as fe:
        trainer = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                   cwd=REPO, env=clean_env())
    try:
        def training() -> bool:
            assert trainer.poll() is None, f"trainer exited early:\n{tail(err)}"
            return ('"epoch": 0,' in err.read_text()  # past the first epoch's setup
                    and _sample_requests(victim_ep) >= 3)

        _wait_until(training, 120, "the trainer sampling from the replica", poll=0.1)
        os.kill(victim.proc.pid, signal.SIGSTOP)

        def resent() -> bool:
            assert trainer.poll() is None, (
                f"trainer exited before the failover:\n{_warnings(err)}\n{tail(err)}")
            return f"from {victim_ep} to" in err.read_text()

        _wait_until(resent, 60, "the trainer re-sending the frozen replica's requests",
                    poll=0.1)
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert victim.proc.wait(timeout=10) == -signal.SIGKILL
        code = trainer.wait(timeout=200)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=10)
        if victim.proc.poll() is None:
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(timeout=10)
    assert code == 0, tail(err, 40)
    s = json.loads(out.read_text().strip().splitlines()[-1])
    assert s["model"] == "rsage" and s["num_parts"] == 2 and s["epochs_done"] == EPOCHS, s
    print(f"\ntrainer-client: {s['failovers']} request(s) re-sent, "
          f"{s['shm_ring']['replies_in_ring']} replies in the ring, test_acc {s['test_acc']}")
    assert s["failovers"] > 0, s
    assert s["shm_ring"]["used"], s["shm_ring"]
    assert 0.0 <= s["test_acc"] <= 1.0
    victim.stop_and_check(expect_code=None)
    for ep, srv in servers.items():
        if ep != victim_ep:
            srv.stop_and_check()
