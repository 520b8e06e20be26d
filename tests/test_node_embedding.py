"""Learnable node embeddings on real sampler servers (trainer_client/node_embedding.py):
the servers' sparse Adam / Adagrad / SGD equal a reference written here on the same
gradients (per-row step counts, as DGL's SparseAdam); a state dict (rows + optimizer state)
loaded into fresh servers gives bit-identical later updates; every call is split into
messages under a small --max-message-mb; a state dict that does not fit is refused with what
differs, and nothing is written.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from procs import ServerProcess

from common.cluster import ClusterSpec
from common.errors import ConfigError, RemoteError
from common.messages import Ping, Pong, TensorWrite
from trainer_client.node_embedding import NodeEmbedding
from trainer_client.server_pool import ServerPool

pytestmark = pytest.mark.timeout(240)
LR, BETAS, EPS = 0.05, (0.8, 0.99), 1e-6


def _start(parts: Path, tmp: Path, tag: str, max_mb: int) -> tuple[ClusterSpec, list]:
    """Two servers (one per part), started without waiting for them."""
    extra = ["--max-message-mb", str(max_mb)] if max_mb else []
    cluster = ClusterSpec({p: [f"ipc://{tmp}/{tag}{p}.sock"] for p in range(2)})
    cluster_file = tmp / f"cluster-{tag}.yaml"
    cluster.write(cluster_file)
    return cluster, [ServerProcess(parts, p, ep, cluster_file, tmp, extra)
                     for p, ep in cluster.all_endpoints()]


@pytest.fixture(scope="module")
def clusters(synth_parts2, tmp_path_factory):
    """Two 2-part clusters for the whole module (each test uses its own tensor names, so
    each tensor starts on servers that never held it): "a" under the default message limit,
    "b" under --max-message-mb 1 (its pool too). Every server's exit code is checked."""
    tmp = tmp_path_factory.mktemp("emb")
    started = {tag: _start(synth_parts2, tmp, tag, mb) for tag, mb in (("a", 0), ("b", 1))}
    servers = [s for _, procs in started.values() for s in procs]
    pools: dict[str, ServerPool] = {}
    try:
        for s in servers:
            s.wait_ready(120)
        for tag, (cluster, _) in started.items():
            pools[tag] = ServerPool(cluster, timeout_s=60.0,
                                    max_message_bytes=(1 if tag == "b" else 64) << 20)
        yield pools
    finally:
        for p in pools.values():
            p.close()
        errors = []
        for s in servers:  # all told at once, then each waited for and checked
            s.terminate()
        for s in servers:
            try:
                s.stop_and_check(60)
            except AssertionError as e:
                errors.append(e)
        if errors:
            raise errors[0]


@pytest.fixture
def pool(clusters):
    return clusters["a"]


class Reference:
    """The sparse optimizers written out on a local table (float64): a step sums a repeated
    id's gradients, then updates each row once; Adam counts steps per row (DGL's SparseAdam)
    and applies torch's bias correction and eps placement."""

    def __init__(self, init: torch.Tensor, optimizer: str):
        self.w, self.opt = init.double().clone(), optimizer
        self.s1, self.s2 = torch.zeros_like(self.w), torch.zeros_like(self.w)
        self.t = torch.zeros(self.w.shape[0], dtype=torch.float64)

    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        rows, inverse = torch.unique(ids, return_inverse=True)
        g = torch.zeros(rows.numel(), self.w.shape[1], dtype=torch.float64)
        g.index_add_(0, inverse, grads.double())
        if self.opt == "sgd":
            self.w[rows] -= LR * g
        elif self.opt == "adagrad":
            self.s1[rows] += g * g
            self.w[rows] -= LR * g / (self.s1[rows].sqrt() + EPS)
        else:
            self.t[rows] += 1
            self.s1[rows] = BETAS[0] * self.s1[rows] + (1 - BETAS[0]) * g
            self.s2[rows] = BETAS[1] * self.s2[rows] + (1 - BETAS[1]) * g * g
            t = self.t[rows].unsqueeze(1)
            size = LR * torch.sqrt(1 - BETAS[1] ** t) / (1 - BETAS[0] ** t)
            self.w[rows] -= size * self.s1[rows] / (self.s2[rows].sqrt() + EPS)


def _emb(pool: ServerPool, name: str, optimizer: str, dim: int = 4) -> NodeEmbedding:
    n = pool.info().num_nodes
    return NodeEmbedding(pool, name, n, dim, lr=LR, optimizer=optimizer, init_scale=0.5,
                         seed=7, betas=BETAS, eps=EPS)


def _batch(n: int, step: int) -> torch.Tensor:
    """Ids of one step: a different subset each step (so rows' step counts differ), with
    repeats."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randperm(n, generator=g)[: n // 3]
    return torch.cat([ids, ids[:50]])


def _train(emb: NodeEmbedding, steps: range, ref: Reference | None = None) -> None:
    """Each step: two lookups (the second repeats ids of the first), a loss that weighs
    every looked-up row differently, backward, emb.step(); ``ref`` gets the same gradients."""
    for step in steps:
        a, b = _batch(emb.num_nodes, step), _batch(emb.num_nodes, step + 1000)[:200]
        ra, rb = emb.lookup(a), emb.lookup(b)
        assert ra.is_leaf and ra.requires_grad
        g = torch.Generator().manual_seed(step)
        wa, wb = torch.randn(ra.shape, generator=g), torch.randn(rb.shape, generator=g)
        ((ra * wa).sum() + (rb * wb).pow(2).sum()).backward()
        if ref is not None:
            ref.step(torch.cat([a, b]), torch.cat([ra.grad, rb.grad]))
        emb.step()


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "sgd"])
def test_updates_equal_reference(pool, optimizer):
    emb = _emb(pool, f"e-{optimizer}", optimizer)
    every = torch.arange(emb.num_nodes)
    init = emb.tensor.read(every)
    ref = Reference(init, optimizer)
    _train(emb, range(5), ref)
    got = emb.tensor.read(every)
    torch.testing.assert_close(got.double(), ref.w, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, init)
    if optimizer == "adam":  # rows got different numbers of steps
        assert len(set(ref.t.tolist())) > 2
    with torch.no_grad():
        assert not emb.lookup(every[:5]).requires_grad
    emb.eval()
    assert not emb.lookup(every[:5]).requires_grad
    emb.step()  # nothing recorded: nothing changes
    assert torch.equal(emb.tensor.read(every), got)
    assert emb.nbytes_per_server() == {
        p: n * (16 * {"adam": 3, "adagrad": 2, "sgd": 1}[optimizer] + 4 * (optimizer == "adam"))
        for p, n in enumerate(torch.diff(emb.tensor.offsets).tolist())}


def test_two_trainers_each_step_the_rows_they_looked_up(clusters):
    """Two trainers (two pools, as two DDP ranks) look up the same row in one step: the row
    gets two optimizer steps, one per trainer's gradient (DistDGL's push-based updates)."""
    second = ServerPool(clusters["a"].cluster, timeout_s=60.0, max_message_bytes=64 << 20)
    try:
        embs = [_emb(clusters["a"], "ranks", "adam"), _emb(second, "ranks", "adam")]
        ids = torch.tensor([5, 5, 2000])
        ref = Reference(embs[0].tensor.read(torch.arange(embs[0].num_nodes)), "adam")
        for k, emb in enumerate(embs):
            rows = emb.lookup(ids)
            (rows * (k + 1)).sum().backward()
            ref.step(ids, rows.grad)
        for emb in embs:
            emb.step()
        state = embs[1].state_dict()
        assert state["step"][[5, 2000, 6]].tolist() == [2, 2, 0]
        torch.testing.assert_close(state["data"].double(), ref.w, rtol=1e-5, atol=1e-6)
    finally:
        second.close()


def _round_trip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Through torch.save / torch.load(weights_only=True), as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_state_dict_restores_later_updates_on_fresh_servers(clusters, optimizer):
    """Train 3 steps, save, train 3 more on the same servers; load the saved state into
    fresh servers (under a 1 MiB message limit: every call takes several messages) and
    train the same 3 steps: identical rows and optimizer state. Restoring the rows alone
    (without the optimizer state) would not be."""
    name = f"ckpt-{optimizer}"
    emb = _emb(clusters["a"], name, optimizer, dim=96)
    _train(emb, range(3))
    saved = _round_trip(emb.state_dict())
    _train(emb, range(3, 6))
    want = emb.state_dict()
    other = _emb(clusters["b"], name, optimizer, dim=96)
    assert other.tensor.created and other.tensor.max_message_bytes == 1 << 20
    assert min(other.nbytes_per_server().values()) > 1 << 20  # no part fits one message
    other.load_state_dict(saved)
    assert all(torch.equal(v, saved[k]) for k, v in other.state_dict().items())
    _train(other, range(3, 6))
    got = other.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), optimizer
    other.tensor.write(torch.arange(other.num_nodes), saved["data"])  # rows only
    _train(other, range(3, 6))
    assert not torch.equal(other.state_dict()["data"], want["data"])


def _refused(emb: NodeEmbedding, state: dict, *needles: str) -> None:
    before = emb.tensor.read(torch.arange(emb.num_nodes))
    with pytest.raises(ConfigError) as info:
        emb.load_state_dict(state)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert torch.equal(emb.tensor.read(torch.arange(emb.num_nodes)), before)


def test_state_dict_that_does_not_fit_is_refused(pool):
    adam, adagrad = _emb(pool, "fit-adam", "adam"), _emb(pool, "fit-ada", "adagrad")
    good = adam.state_dict()
    zeros = {k: torch.zeros_like(v) for k, v in good.items()}
    _refused(adam, {**zeros, "hparams": good["hparams"], "data": torch.zeros(5, 4)},
             "'data'", "(5, 4)")
    _refused(adam, {**good, "step": good["step"].long()}, "'step'", "torch.int64")
    _refused(adam, adagrad.state_dict(), "'exp_avg'", "optimizer 'adam'")
    other_lr = good["hparams"].clone()
    other_lr[0] = 0.5
    _refused(adam, {**good, "hparams": other_lr}, "lr=0.5 in the state dict")
    wide = _emb(pool, "fit-wide", "adam", dim=5)
    _refused(wide, good, "'exp_avg_sq'", "(3000, 4)", "(3000, 5)")
    adam.load_state_dict(zeros | {"hparams": good["hparams"]})  # a fitting one is written
    assert not adam.state_dict()["data"].any()


def test_bad_construction_and_bad_state_writes(pool):
    n = pool.info().num_nodes
    with pytest.raises(ConfigError, match="hold 3000"):
        NodeEmbedding(pool, "x", n + 1, 4, lr=LR)
    with pytest.raises(ConfigError, match="optimizer must be"):
        NodeEmbedding(pool, "x", n, 4, lr=LR, optimizer="none")
    emb = _emb(pool, "bad-w", "adam")
    ids = torch.arange(3)
    short = TensorWrite(name="bad-w", ids=ids, rows=torch.zeros(3, 4), state=[torch.zeros(3, 4)])
    with pytest.raises(RemoteError, match="tensor_mismatch") as info:
        pool.wait(pool.submit(0, short))
    assert "exp_avg_sq" in str(info.value)
    assert isinstance(pool.wait(pool.submit(0, Ping())), Pong)  # still serving
    before = emb.tensor.read(ids)
    steps_f32 = [torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3)]
    bad = TensorWrite(name="bad-w", ids=ids, rows=torch.ones(3, 4), state=steps_f32)
    with pytest.raises(RemoteError, match="int32"):
        pool.wait(pool.submit(0, bad))
    assert torch.equal(emb.tensor.read(ids), before)  # a refused write changed nothing
