"""``--local-features``: a CPU trainer on the host of a partition set reads the input rows
from the parts' memory-mapped ``feat.npy`` inside SAGEConv's mean
(trainer_client/local_features.py).

The model computes the same function from :class:`SourceRows` as from the gathered rows (one
part: the same sums in the same order, equal outputs and gradients; several: each
destination's per-part sums added, float32 rounding only); the decision names why it does not
apply; and worker mode, as a user runs it, trains to the same result with and without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from procs import REPO, run_cli
from test_page_cache import evict

from common.errors import ConfigError
from common.mfg import Block, SourceRows
from common.page_cache import resident_fraction
from partition.layout import PartitionSetMeta, load_partition
from trainer_client.local_features import open_local_features
from trainer_client.model import GraphSAGE, SAGEConv


def _block(num_src: int, num_dst: int, fanout: int, g: torch.Generator,
           empty_rows: int = 0) -> Block:
    """A random block: each destination has up to ``fanout`` sources (the last
    ``empty_rows`` destinations none)."""
    deg = torch.randint(1, fanout + 1, (num_dst,), generator=g)
    if empty_rows:
        deg[-empty_rows:] = 0
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    torch.cumsum(deg, 0, out=indptr[1:])
    indices = torch.randint(0, num_src, (int(indptr[-1]),), generator=g)
    return Block(indptr, indices, num_src, num_dst)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("in_feats,out_feats", [(24, 40), (64, 5)])
def test_sageconv_reads_source_rows_as_the_gathered_rows(in_feats, out_feats):
    """Aggregate-first (the input layer of the seed model) reads the matrix in its mean;
    project-first (wide input, narrow output) gathers; both equal the tensor path exactly,
    outputs and parameter gradients, a destination without in-edges included."""
    g = torch.Generator().manual_seed(0)
    matrix = torch.randn(500, in_feats, generator=g)
    ids = torch.randperm(500, generator=g)[:120]
    block = _block(120, 30, 6, g, empty_rows=2)
    torch.manual_seed(1)
    conv = SAGEConv(in_feats, out_feats)
    outs, grads = [], []
    for x in (matrix.index_select(0, ids), SourceRows(matrix, ids)):
        conv.zero_grad()
        y = conv(block, x)[:30]
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append(_grads(conv))
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_graphsage_trains_the_same_from_source_rows():
    """The seed model (3 layers) from SourceRows and from the gathered rows: the same
    logits and gradients, with dropout 0 and with dropout 0.5 under the same RNG state."""
    g = torch.Generator().manual_seed(2)
    matrix = torch.randn(2000, 16, generator=g)
    ids = torch.randperm(2000, generator=g)[:900]
    blocks = [_block(900, 300, 5, g), _block(300, 80, 4, g), _block(80, 20, 3, g)]
    for p in (0.0, 0.5):
        torch.manual_seed(3)
        model = GraphSAGE(16, 32, 7, 3, dropout=p)
        assert model.takes_source_rows
        outs, grads = [], []
        for x in (matrix.index_select(0, ids), SourceRows(matrix, ids)):
            model.zero_grad()
            torch.manual_seed(4)
            y = model(blocks, x)
            torch.nn.functional.cross_entropy(y, torch.arange(20) % 7).backward()
            outs.append(y.detach())
            grads.append(_grads(model))
        assert torch.equal(outs[0], outs[1]), p
        for a, b in zip(*grads):
            assert torch.equal(a, b), p


def _split(matrix: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    """``matrix`` as the parts' own matrices (separate tensors, as separate files map)."""
    return [matrix[a:b].clone() for a, b in zip(offsets, offsets[1:])]


def test_source_rows_of_several_parts_gather_and_train_as_the_gathered_rows():
    """Rows of a three-part set (one part owning none of the batch's sources): the copy is
    the gathered rows exactly; SAGEConv (both orders) and the seed model compute the same
    logits and gradients from them up to float32 rounding (per-part sums added)."""
    g = torch.Generator().manual_seed(5)
    matrix = torch.randn(700, 24, generator=g)
    offsets = [0, 250, 400, 700]
    ids = torch.cat([torch.randperm(250, generator=g)[:90],
                     400 + torch.randperm(300, generator=g)[:110]])  # none of part 1
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    rows = SourceRows(_split(matrix, offsets), ids, offsets)
    assert rows.num_parts == 3 and rows.shape == (200, 24)
    assert torch.equal(rows.gather(), matrix[ids]) and torch.equal(rows.gather(7), matrix[ids[:7]])
    part, local = rows.owners()
    assert torch.equal(torch.tensor(offsets)[part] + local, ids) and not (part == 1).any()
    with pytest.raises(ValueError, match="no single matrix"):
        rows.matrix  # noqa: B018
    with pytest.raises(ValueError, match="node offsets"):
        SourceRows(_split(matrix, offsets), ids)
    block = _block(200, 50, 6, g, empty_rows=3)
    for out_feats in (40, 5):  # aggregate first (read in place), project first (gathered)
        torch.manual_seed(1)
        conv = SAGEConv(24, out_feats)
        outs, grads = [], []
        for x in (matrix.index_select(0, ids), SourceRows(_split(matrix, offsets), ids, offsets)):
            conv.zero_grad()
            y = conv(block, x)[:50]
            y.square().sum().backward()
            outs.append(y.detach())
            grads.append(_grads(conv))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)
    blocks = [block, _block(50, 20, 4, g), _block(20, 8, 3, g)]
    torch.manual_seed(3)
    model = GraphSAGE(24, 32, 7, 3, dropout=0.0)
    outs, grads = [], []
    for x in (matrix.index_select(0, ids), rows):
        model.zero_grad()
        y = model(blocks, x)
        torch.nn.functional.cross_entropy(y, torch.arange(8) % 7).backward()
        outs.append(y.detach())
        grads.append(_grads(model))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_part_bags_native_and_torch_split_alike(monkeypatch):
    """The bags split by part (common/native.c ``mfg_split_bags``) are the torch fallback's:
    each part's edges in CSC order, its rows and weights, its bag offsets (padding bags
    included); a source position out of range is refused."""
    import trainer_client.model as model_mod

    g = torch.Generator().manual_seed(8)
    offsets = [0, 100, 130, 400]
    ids = torch.randperm(400, generator=g)[:150]
    block = _block(150, 40, 7, g, empty_rows=4)
    idx, off, w = block.mean_bags()
    off = torch.cat([off, off[-1:].expand(5)])  # five padding bags
    rows = SourceRows([torch.zeros(b - a, 3) for a, b in zip(offsets, offsets[1:])], ids,
                      offsets)
    if model_mod.native.load() is None:
        pytest.skip("native kernels not loaded here")
    native_split = model_mod.part_bags(idx, off, w, rows)
    monkeypatch.setattr(model_mod.native, "load", lambda: None)
    torch_split = model_mod.part_bags(idx, off, w, rows)
    monkeypatch.undo()
    part, local = rows.owners()
    for p, (a, b) in enumerate(zip(native_split, torch_split)):
        for u, v in zip(a, b):
            assert torch.equal(u, v), p
        mine = part[idx] == p
        assert torch.equal(a[0], local[idx][mine]) and int(a[2][-1]) == int(mine.sum())
    bad = idx.clone()
    bad[3] = 150
    with pytest.raises(ValueError, match="part_bags"):
        model_mod.part_bags(bad, off, w, rows)


@pytest.mark.parametrize("num_parts", [3, 12])  # a scan over the bounds; a binary search
def test_owners_and_gather_native_and_torch_alike(monkeypatch, num_parts):
    """Each source's part and row (common/native.c ``mfg_owners``) and the rows copied from
    several parts (``mfg_copy_part_rows``) are the torch fallback's, with an empty part and
    ids on every bound; an id past the last part, or a part's row past its matrix, is refused
    before anything is written."""
    import common.mfg as mfg_mod

    if mfg_mod.native.load() is None:
        pytest.skip("native kernels not loaded here")
    g = torch.Generator().manual_seed(num_parts)
    cuts = torch.randperm(999, generator=g)[:num_parts - 2].add(1).sort().values.tolist()
    offsets = [0, *cuts, cuts[-1], 1000]  # the second-to-last part owns no row
    matrix = torch.randn(1000, 9, generator=g)
    ids = torch.cat([torch.tensor(offsets[:-1]), torch.tensor(offsets[1:]) - 1,
                     torch.randint(0, 1000, (300,), generator=g)])
    ids = ids[ids >= 0]

    def run():
        rows = SourceRows(_split(matrix, offsets), ids, offsets)
        return rows.owners(), rows.gather(), rows.gather(17)

    (part, local), full, head = run()
    monkeypatch.setattr(mfg_mod.native, "load", lambda: None)
    (t_part, t_local), t_full, t_head = run()
    with pytest.raises(ValueError, match="outside the parts"):
        SourceRows(_split(matrix, offsets), torch.tensor([3, 1000]), offsets).owners()
    monkeypatch.undo()
    assert torch.equal(part, t_part) and torch.equal(local, t_local)
    assert torch.equal(full, t_full) and torch.equal(head, t_head)
    assert torch.equal(full, matrix[ids]) and not (part == num_parts - 2).any()
    with pytest.raises(ValueError, match="outside the parts"):
        SourceRows(_split(matrix, offsets), torch.tensor([3, 1000]), offsets).owners()
    short = _split(matrix, offsets)
    short[0] = short[0][:-1]  # part 0's matrix a row shorter than its offsets say
    rows = SourceRows(short, torch.tensor([offsets[1] - 1]), offsets)
    with pytest.raises(ValueError, match="outside their parts"):
        rows.gather()


def test_source_rows_gather_and_to():
    matrix = torch.arange(30.0).view(10, 3)
    rows = SourceRows(matrix, torch.tensor([4, 1, 7]))
    assert rows.shape == (3, 3) and rows.dtype == torch.float32 and not rows.requires_grad
    assert torch.equal(rows.gather(), matrix[[4, 1, 7]])
    assert torch.equal(rows.gather(2), matrix[[4, 1]])
    assert rows.to("cpu") is rows and rows.float() is rows
    half = SourceRows(matrix.half(), torch.tensor([2]))
    assert torch.equal(half.float(), matrix[[2]])


@pytest.fixture(scope="module")
def cora_one_part(cora_dir, tmp_path_factory) -> Path:
    parts = tmp_path_factory.mktemp("lf") / "cora-1"
    run_cli("partition.cli", ["--dataset-dir", cora_dir, "--num-parts", 1, "--out", parts],
            timeout=300)
    return parts


def _info(parts: Path, **kw) -> SimpleNamespace:
    """What the servers of ``parts`` answer in their Pong (the fields the decision reads)."""
    meta = PartitionSetMeta.load(parts)
    base = dict(num_parts=meta.num_parts, num_nodes=meta.num_nodes, feat_dim=meta.feat_dim,
                feat_dtype=meta.feat_dtype, set_id=meta.set_id, ntypes=[],
                node_offsets=list(meta.node_offsets))
    return SimpleNamespace(**{**base, **kw})


def test_decision_names_why_and_maps_the_servers_set(cora_one_part):
    parts, cpu = str(cora_one_part), torch.device("cpu")
    info = _info(cora_one_part)
    feat_file = str(cora_one_part / "part-0" / "feat.npy")
    evict(feat_file)  # as after another job, or the VM's reclaim
    cold = resident_fraction(feat_file)
    used = open_local_features("auto", parts, info, cpu)
    warm = used.wait_warm(60)  # the part's file read into the page cache, in order
    assert warm["done"] and warm["files"] == 1 and "error" not in warm, warm
    if cold == 0.0:  # (where eviction works) the whole file was read, and is cached now
        assert warm["mb_read"] == warm["mb"] > 0, warm
    assert resident_fraction(feat_file) == 1.0
    assert used.used and used.summary() == {"mode": "auto", "used": True, "page_cache": warm}
    feat = load_partition(parts, 0).feat
    (matrix,) = used.matrices
    assert matrix.shape == feat.shape and torch.equal(matrix, torch.from_numpy(feat))
    assert open_local_features("off", parts, info, cpu).summary() == {
        "mode": "off", "used": False, "reason": "off"}
    cases = [  # (kwargs, what the reason names)
        (dict(parts=""), "--parts-on-host"),
        (dict(device=torch.device("cuda")), "cuda"),
        (dict(cache_ratio=0.2), "--cache-ratio"),
        (dict(feat_transfer="float16"), "--feat-transfer"),
        (dict(info=_info(cora_one_part, feat_dtype="float16")), "float16"),
        (dict(hetero=True), "typed"),
    ]
    for kw, named in cases:
        args = dict(parts=parts, info=info, device=cpu)
        args.update({k: kw.pop(k) for k in ("parts", "info", "device") if k in kw})
        auto = open_local_features("auto", args["parts"], args["info"], args["device"], **kw)
        assert not auto.used and named in auto.reason, (kw, auto.reason)
        with pytest.raises(ConfigError, match="--local-features on cannot apply") as e:
            open_local_features("on", args["parts"], args["info"], args["device"], **kw)
        assert named in str(e.value)
    # auto leaves a model that does not read the rows in place alone; on maps for it
    assert "GraphSAGE" in open_local_features("auto", parts, info, cpu,
                                              model_reads_rows=False).reason
    assert open_local_features("on", parts, info, cpu, model_reads_rows=False).used
    with pytest.raises(ConfigError, match="not the set the servers serve"):
        open_local_features("auto", parts, _info(cora_one_part, set_id="other-set"), cpu)
    with pytest.raises(ConfigError, match="in 2 parts"):  # the servers' set is split in two
        open_local_features("auto", parts, _info(cora_one_part, num_parts=2), cpu)
    with pytest.raises(ConfigError, match="cannot read the partition set"):
        open_local_features("auto", str(cora_one_part / "missing"), info, cpu)
    with pytest.raises(ConfigError, match="must be one of"):
        open_local_features("sometimes", parts, info, cpu)


def _worker(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    run_tmp = tmp / "t"
    run_tmp.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "deploy.worker_mode", *args],
                          capture_output=True, text=True, timeout=400, cwd=REPO,
                          env={**os.environ, "TMPDIR": str(run_tmp)}, stdin=subprocess.DEVNULL)


def _summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SETTINGS = ["--num-trainers", "2", "--epochs", "6", "--fanouts", "10,10", "--batch-size", "64",
            "--dropout", "0.5", "--no-progress"]


@pytest.mark.timeout(600)
def test_worker_mode_trains_the_same_with_and_without_local_features(cora_one_part, tmp_path):
    """Worker mode on a one-part set, two DDP trainers: by default (auto) the trainers read
    the features here (no ring); with off the servers
    gather them into the ring. The same seeds, MFGs and sums: the same losses and accuracy."""
    auto = _summary(_worker(["--parts", str(cora_one_part), *SETTINGS], tmp_path))
    off = _summary(_worker(["--parts", str(cora_one_part), *SETTINGS,
                            "--local-features", "off"], tmp_path))
    cached = auto["local_features"].pop("page_cache")
    assert cached["done"] and cached["files"] == 1 and "error" not in cached, cached
    assert auto["local_features"] == {"mode": "auto", "used": True}, auto["local_features"]
    assert off["local_features"]["used"] is False
    # off: the features came in the ring (not counted in bytes_received, the socket's)
    assert auto["shm_ring"] is None and off["shm_ring"]["replies_in_ring"] > 0
    assert auto["bytes_received"] <= off["bytes_received"]
    assert auto["prefetch"]["alternated"] == off["prefetch"]["alternated"]
    assert auto["final_loss"] == off["final_loss"] and auto["test_acc"] == off["test_acc"]
    assert auto["test_acc"] >= 0.7, auto


@pytest.fixture(scope="module")
def cora_two_parts(cora_dir, tmp_path_factory) -> Path:
    parts = tmp_path_factory.mktemp("lf") / "cora-2"
    run_cli("partition.cli", ["--dataset-dir", cora_dir, "--num-parts", 2, "--out", parts],
            timeout=300)
    return parts


def test_decision_maps_every_part_or_names_the_missing_one(cora_two_parts, tmp_path):
    """A two-part set: each part's matrix, in part order; a copy of the set without part 1
    on this host: auto names the part and reads nothing here, on refuses."""
    parts, cpu, info = str(cora_two_parts), torch.device("cpu"), _info(cora_two_parts)
    used = open_local_features("auto", parts, info, cpu)
    assert used.used and len(used.matrices) == 2
    warm = used.wait_warm(60)
    assert warm["done"] and warm["files"] == 2 and "error" not in warm, warm
    assert used.summary() == {"mode": "auto", "used": True, "parts": 2, "joined": True,
                              "page_cache": warm}
    meta = PartitionSetMeta.load(parts)
    for p, matrix in enumerate(used.matrices):
        feat = torch.from_numpy(load_partition(parts, p).feat)
        assert torch.equal(matrix, feat)
        # the joined matrix holds the same rows, each part from its start
        start = used.joined.starts[p]
        assert torch.equal(used.joined.matrix[start:start + feat.shape[0]], feat)
    assert [m.shape[0] for m in used.matrices] == [b - a for a, b in
                                                   zip(meta.node_offsets, meta.node_offsets[1:])]
    half = tmp_path / "half"
    shutil.copytree(cora_two_parts, half)
    shutil.rmtree(half / meta.parts[1].dir)
    auto = open_local_features("auto", str(half), info, cpu)
    assert not auto.used and "part 1" in auto.reason, auto.reason
    with pytest.raises(ConfigError, match="--local-features on cannot apply: part 1"):
        open_local_features("on", str(half), info, cpu)
    moved = dict(info.__dict__, node_offsets=[0, 1000, meta.num_nodes])
    with pytest.raises(ConfigError, match="not the set the servers serve"):
        open_local_features("auto", parts, SimpleNamespace(**moved), cpu)


@pytest.mark.timeout(600)
def test_worker_mode_reads_a_two_part_set_in_place(cora_two_parts, tmp_path):
    """Worker mode on a two-part set (two servers, two trainers): by default the trainers
    read both parts' features here, joined into one matrix, no ring; with off the servers
    gather them into the ring. The same seeds, MFGs and sums: the same loss and accuracy; on
    with a cache refuses, naming it."""
    feats = [str(cora_two_parts / f"part-{p}" / "feat.npy") for p in range(2)]
    for f in feats:  # as after another job: read in order before the first step
        evict(f)
    cold = [resident_fraction(f) for f in feats]
    auto = _summary(_worker(["--parts", str(cora_two_parts), *SETTINGS], tmp_path))
    off = _summary(_worker(["--parts", str(cora_two_parts), *SETTINGS,
                            "--local-features", "off"], tmp_path))
    # (rank 0's pass; which trainer read the evicted files first is a race: the reading
    # itself is checked in test_decision_names_why_and_maps_the_servers_set)
    cached = auto["local_features"].pop("page_cache")
    assert cached["done"] and cached["files"] == 2 and "error" not in cached, (cold, cached)
    # read in (cold was the evicted state); not all of it need still be resident: a VM's
    # reclaim (DAMON's pageout here) may drop some idle pages while the second run goes on
    # (one CI run read 0.991 for part 1)
    assert all(resident_fraction(f) > 0.5 for f in feats), (cold, cached)
    assert auto["num_parts"] == 2 and auto["local_features"] == {
        "mode": "auto", "used": True, "parts": 2, "joined": True}, auto["local_features"]
    assert auto["shm_ring"] is None and off["shm_ring"]["replies_in_ring"] > 0
    assert auto["bytes_received"] < off["bytes_received"]
    # the parts joined into one matrix: the mean is the one-part mean, the same sums in the
    # same order as over the servers' gathered rows
    assert auto["final_loss"] == off["final_loss"] and auto["test_acc"] == off["test_acc"], (
        auto["final_loss"], off["final_loss"])
    assert auto["test_acc"] >= 0.7, auto
    proc = _worker(["--parts", str(cora_two_parts), *SETTINGS, "--epochs", "1",
                    "--cache-ratio", "0.2", "--local-features", "on"], tmp_path)
    assert proc.returncode != 0
    assert "--local-features on cannot apply: --cache-ratio" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_local_mean_benchmark_runs_and_reports_json():
    """benchmarks.local_mean on a tiny matrix: it runs, prints each round and one JSON line
    (timings are reported, never asserted)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.local_mean", "--nodes", "3000",
                           "--sources", "800", "--dests", "200", "--parts", "3",
                           "--repeats", "1", "--rounds", "1"], capture_output=True, text=True,
                          timeout=100, cwd=REPO, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["parts"] == 3 and out["edges"] > 0 and len(out["rounds"]) == 1
    assert set(out["rounds"][0]) == {"parts_ms", "one_part_ms", "joined_ms"}
    assert out["rounds"][0]["joined_ms"] is not None and "round 1" in proc.stderr
