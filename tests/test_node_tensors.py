"""Server-held node tensors on real sampler servers: values read back equal what was written
across both parts, sparse Adagrad / Adam on the server equal torch's optimizers, two writer
processes at once leave no torn row, a writer killed mid-stream leaves the servers serving,
and every bad request gets its error reply while the server keeps serving.

Run as a script (``python tests/test_node_tensors.py writer ...``) this file is the writer
process of the concurrency tests.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

import threading  # noqa: E402

from common.cluster import ClusterSpec  # noqa: E402
from common.errors import ProtocolError, RemoteError  # noqa: E402
from common.messages import (  # noqa: E402
    Ping,
    Pong,
    TensorCreate,
    TensorRead,
    TensorUpdate,
    TensorWrite,
)
from sampler_server.node_tensors import NodeTensorStore  # noqa: E402
from trainer_client.node_tensors import DistNodeTensor  # noqa: E402
from trainer_client.server_pool import ServerPool  # noqa: E402

pytestmark = pytest.mark.timeout(180)
WIDTH = 8  # row width of the writers' tensor


@pytest.mark.parametrize("change", [
    {"dtype": "complex64"}, {"row_shape": [1, 1, 1, 1]}, {"row_shape": [0]}, {"init": "ones"},
    {"optimizer": "rmsprop"}, {"dtype": "int64", "optimizer": "sgd"},
    {"dtype": "int32", "init": "normal"}, {"lr": 0.0}, {"beta1": 1.0}, {"eps": 0.0},
    {"name": "a b"}, {"name": ""}, {"init_scale": -1.0}])
def test_bad_spec_is_refused_before_any_server(change):
    spec = {"name": "t", "dtype": "float32", "row_shape": [2], **change}
    with pytest.raises(ProtocolError) as info:
        TensorCreate(**spec).check()
    assert info.value.code == "bad_field"


def test_store_reads_see_whole_writes_from_threads():
    """Two writer threads each write all rows of the part per request; a reader thread only
    ever sees every row from one request (requests are applied under the tensor's lock;
    without it, torch's copy runs outside the GIL and reads catch writes half done)."""
    n, width = 4000, 256
    store = NodeTensorStore(0, 0, n, 64 << 20)
    store.handle_create(TensorCreate(name="t", dtype="float32", row_shape=[width]))
    ids, seen, done = torch.arange(n), [], threading.Event()
    full = {k: torch.full((n, width), float(k)) for k in (1, 2)}

    def write(k: int) -> None:
        for _ in range(60):
            store.handle_write(TensorWrite(name="t", ids=ids, rows=full[k]))

    def read() -> None:
        while not done.is_set():
            rows = store.handle_read(TensorRead(name="t", ids=ids)).rows
            seen.append(bool(rows.amin() == rows.amax()))

    threads = [threading.Thread(target=write, args=(k,)) for k in (1, 2)]
    reader = threading.Thread(target=read)
    for t in [*threads, reader]:
        t.start()
    for t in threads:
        t.join(timeout=60)
    done.set()
    reader.join(timeout=60)
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} reads mixed two writes"
    assert store.nbytes == n * width * 4


def _pool(cluster: ClusterSpec) -> ServerPool:
    return ServerPool(cluster, timeout_s=30.0, max_message_bytes=64 << 20)


@pytest.fixture
def cluster2(server_factory, synth_parts2, tmp_path):
    from test_mfg_oracle import start_cluster

    cluster = start_cluster(server_factory, synth_parts2, tmp_path, 2)
    pool = _pool(cluster)
    yield cluster, pool, pool.info().node_offsets
    pool.close()


def _mixed_ids(offsets: list[int], per_part: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    picks = [lo + torch.randperm(hi - lo, generator=g)[:per_part]
             for lo, hi in zip(offsets[:-1], offsets[1:])]
    ids = torch.cat(picks)
    return ids[torch.randperm(ids.numel(), generator=g)]


def test_read_back_equals_written_across_parts(cluster2):
    _, pool, offsets = cluster2
    emb = DistNodeTensor(pool, "emb", [4], init="uniform", init_scale=0.5, seed=3)
    assert emb.created
    again = DistNodeTensor(pool, "emb", [4], init="uniform", init_scale=0.5, seed=3)
    assert not again.created  # same spec: attach, rows untouched
    every = torch.arange(offsets[-1])
    init = emb.read(every)
    assert init.abs().max() <= 0.5 and init.std() > 0.1
    ids = _mixed_ids(offsets, 100, seed=0)
    rows = torch.randn(ids.numel(), 4)
    emb.write(ids, rows)
    assert torch.equal(emb.read(ids), rows)
    perm = torch.randperm(ids.numel())
    assert torch.equal(again.read(ids[perm]), rows[perm])  # any order, any handle
    untouched = torch.ones(offsets[-1], dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(emb.read(every[untouched]), init[untouched])
    counts = DistNodeTensor(pool, "counts", [], dtype="int64")
    counts.write(ids, ids * 7)
    assert torch.equal(counts.read(ids), ids * 7) and counts.read(ids[:0]).shape == (0,)
    emb.drop()
    counts.drop()


def _check_optimizer(pool: ServerPool, offsets: list[int], optimizer: str) -> None:
    n, lr = offsets[-1], 0.05
    emb = DistNodeTensor(pool, f"w-{optimizer}", [3], init="normal", init_scale=1.0,
                         optimizer=optimizer, lr=lr, betas=(0.8, 0.99), eps=1e-6)
    init = emb.read(torch.arange(n))
    param = torch.nn.Parameter(init.clone())
    ref = {"adagrad": lambda: torch.optim.Adagrad([param], lr=lr, eps=1e-6),
           "adam": lambda: torch.optim.SparseAdam([param], lr=lr, betas=(0.8, 0.99), eps=1e-6),
           "sgd": lambda: torch.optim.SGD([param], lr=lr)}[optimizer]()
    fixed = _mixed_ids(offsets, 40, seed=1)
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        # Adam's bias correction counts a row's own steps: the same rows every step match
        # SparseAdam's global count; Adagrad and SGD get other rows each step.
        ids = fixed if optimizer == "adam" else _mixed_ids(offsets, 40, seed=10 + step)
        ids = torch.cat([ids, ids[:10]])  # repeated ids: gradients summed
        grads = torch.randn(ids.numel(), 3, generator=g)
        emb.update(ids, grads)
        param.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grads, (n, 3),
                                             check_invariants=True)
        ref.step()
    got = emb.read(torch.arange(n))
    torch.testing.assert_close(got, param.detach(), rtol=1e-5, atol=1e-5, msg=optimizer)
    assert not torch.allclose(got, init)  # the rows did move


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
def test_sparse_updates_equal_torch_optimizers(cluster2):
    _, pool, offsets = cluster2
    for optimizer in ("adagrad", "adam", "sgd"):
        _check_optimizer(pool, offsets, optimizer)


def _writer(cluster_file: str, name: str, lo: int, hi: int, stamp0: int, seconds: float,
            go_file: str) -> None:
    """One writer process: attach to ``name``, then write rows ``[lo, hi)`` again and again,
    each row filled with one stamp (stamp0 + i for the i-th write), for ``seconds``."""
    pool = _pool(ClusterSpec.load(cluster_file))
    t = DistNodeTensor(pool, name, [WIDTH])
    ids = torch.arange(lo, hi)
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file):
        assert time.monotonic() < deadline, "no go file"
        time.sleep(0.01)
    end, i = time.monotonic() + seconds, 0
    while i == 0 or time.monotonic() < end:
        i += 1
        t.write(ids, torch.full((ids.numel(), WIDTH), float(stamp0 + i)))
        if i == 1:
            print("wrote", flush=True)
    print(f"last {stamp0 + i}", flush=True)
    pool.close()


class Writer:
    def __init__(self, tmp_path: Path, lo: int, hi: int, stamp0: int, seconds: float):
        cluster_file = tmp_path / "cluster.yaml"
        self.go = tmp_path / "go"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "writer", str(cluster_file), "shared", str(lo), str(hi),
             str(stamp0), str(seconds), str(self.go)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            bufsize=0, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})

    def line(self, timeout: float = 60.0) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "writer printed nothing in time"
        out = self.proc.stdout.readline().decode().strip()
        assert out, f"writer ended early: {self.finish(10)[1]}"
        return out

    def finish(self, timeout: float = 60.0) -> tuple[int, str]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise AssertionError("writer did not end in time") from None
        return self.proc.returncode, err.decode(errors="replace")[-3000:]


def _constant_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row's one value; fails on a torn row (values from two writes)."""
    assert torch.equal(rows, rows[:, :1].expand_as(rows)), "a row mixes two writes"
    return rows[:, 0]


def test_concurrent_writers_leave_no_torn_rows(cluster2, tmp_path):
    _, pool, offsets = cluster2
    t = DistNodeTensor(pool, "shared", [WIDTH])
    b = offsets[1]  # A writes [b-600, b+200), B [b-200, b+600): both parts, overlap [b-200, b+200)
    a_w, b_w = Writer(tmp_path, b - 600, b + 200, 1_000_000, 2.0), Writer(
        tmp_path, b - 200, b + 600, 2_000_000, 2.0)
    try:
        assert a_w.line() == "ready" and b_w.line() == "ready"
        (tmp_path / "go").touch()
        lasts = []
        for w in (a_w, b_w):
            assert w.line() == "wrote"
            last = w.line()
            code, err = w.finish()
            assert code == 0, err
            lasts.append(float(last.split()[1]))
    finally:
        for w in (a_w, b_w):
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    a_last, b_last = lasts
    assert a_last - 1_000_000 >= 3 and b_last - 2_000_000 >= 3  # several writes each
    v = _constant_rows(t.read(torch.arange(b - 600, b + 600)))
    assert (v[:400] == a_last).all() and (v[800:] == b_last).all()
    for part_rows in (v[400:600], v[600:800]):  # the overlap in part 0, then in part 1
        assert float(part_rows[0]) in (a_last, b_last)
        assert (part_rows == part_rows[0]).all(), "a part's share of a write is not atomic"


def test_dead_writer_leaves_server_serving(cluster2, tmp_path):
    _, pool, offsets = cluster2
    t = DistNodeTensor(pool, "shared", [WIDTH])
    b = offsets[1]
    w = Writer(tmp_path, b - 500, b + 500, 1_000_000, 60.0)
    try:
        assert w.line() == "ready"
        (tmp_path / "go").touch()
        assert w.line() == "wrote"
        time.sleep(0.3)  # mid-stream
        w.proc.send_signal(signal.SIGKILL)
        code, _ = w.finish(20)
        assert code == -signal.SIGKILL
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
    v = _constant_rows(t.read(torch.arange(b - 500, b + 500)))
    assert (v > 1_000_000).all()
    t.write(torch.tensor([b - 1, b]), torch.full((2, WIDTH), -1.0))
    assert (t.read(torch.tensor([b, b - 1])) == -1).all()
    # the servers' exit codes (0 on SIGTERM) are checked by server_factory


def _error_code(pool: ServerPool, part: int, msg) -> str:
    with pytest.raises(RemoteError) as info:
        pool.wait(pool.submit(part, msg))
    assert isinstance(pool.wait(pool.submit(part, Ping())), Pong)  # still serving
    return info.value.code


def test_bad_requests_get_error_replies(cluster2):
    _, pool, offsets = cluster2
    ids = torch.arange(offsets[0], offsets[0] + 5)
    assert _error_code(pool, 0, TensorRead(name="nope", ids=ids)) == "unknown_tensor"
    DistNodeTensor(pool, "t", [2], optimizer="adagrad")
    foreign = torch.tensor([offsets[1]])
    assert _error_code(pool, 0, TensorRead(name="t", ids=foreign)) == "not_owned"
    f64 = torch.zeros(5, 2, dtype=torch.float64)
    assert _error_code(pool, 0, TensorWrite(name="t", ids=ids, rows=f64)) == "tensor_mismatch"
    wide = torch.zeros(5, 3)
    assert _error_code(pool, 0, TensorUpdate(name="t", ids=ids, grads=wide)) == "tensor_mismatch"
    other = TensorCreate(name="t", dtype="float32", row_shape=[2], optimizer="adam")
    with pytest.raises(RemoteError, match="optimizer='adagrad'"):
        pool.wait(pool.submit(0, other))
    bad = TensorCreate(name="u", dtype="complex64", row_shape=[2])
    assert _error_code(pool, 1, bad) == "bad_field"
    plain = DistNodeTensor(pool, "plain", [2])
    with pytest.raises(RemoteError, match="no_optimizer"):
        plain.update(ids, torch.ones(5, 2))
    assert torch.equal(plain.read(ids), torch.zeros(5, 2))  # a failed request changed nothing


def test_size_cap(server_factory, synth_parts1, tmp_path):
    server = server_factory(synth_parts1, 0, extra=["--max-node-tensor-mb", "1"])
    cluster = ClusterSpec({0: [server.endpoint]})
    pool = _pool(cluster)
    try:
        n = pool.info().num_nodes
        with pytest.raises(RemoteError, match="too_large"):
            DistNodeTensor(pool, "big", [(1 << 20) // (4 * n) + 1])  # just over 1 MiB
        small = DistNodeTensor(pool, "small", [(1 << 20) // (8 * n)], optimizer="sgd")
        with pytest.raises(RemoteError, match="max-node-tensor-mb"):
            DistNodeTensor(pool, "small2", [(1 << 20) // (8 * n)], optimizer="adagrad")
        small.drop()
        DistNodeTensor(pool, "small2", [(1 << 20) // (8 * n)], optimizer="adagrad")
    finally:
        pool.close()


if __name__ == "__main__" and sys.argv[1:2] == ["writer"]:
    a = sys.argv[2:]
    _writer(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), float(a[5]), a[6])
