"""The streaming partitioner (issue 12): partition.stream over in-memory and on-disk sources.

Streaming partitions satisfy every invariant of partition/layout.py (every node in exactly one
part, every directed edge stored once in its destination's owner, in-edges sorted, rows equal
to the source's) for random and fennel; random streamed is byte-identical to the in-memory
partitioner with the same seed, with or without sort sub-buckets; the binary layout with NaN
labels and float16 features round-trips; real sampler servers serve MFGs from a streamed set
that the DGL oracle of tests/test_mfg_oracle.py accepts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import zmq
from procs import run_cli
from rpc_helpers import channel

from common.cluster import ClusterSpec
from common.messages import MFGReply, SampleRequest
from partition.buckets import BucketFiles
from partition.layout import FEAT_DTYPES, PartitionSetMeta, load_partition
from partition.outdir import PartitionError
from partition.partitioner import partition_graph
from partition.stream import GraphSource, NpyWriter, _reorder_rows, partition_stream
from partition.synthetic import generate
from tests.test_mfg_oracle import Oracle, mixed_seeds
from tests.test_partition import CORA, check_partition_set, needs_cora

pytestmark = pytest.mark.timeout(90)
EPS = 0.05  # partition.streamassign.DEFAULT_EPSILON: the stated balance tolerance


@pytest.fixture(scope="module")
def graph():
    return generate(6000, avg_degree=12, feat_dim=8, num_classes=5, seed=2, progress=False)


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*.npy"))}


def _assert_balanced(meta: PartitionSetMeta) -> None:
    """Nodes and training seeds within (1 + EPS) x the mean (+1 for rounding) per part."""
    st = meta.stats
    for key in ("part_nodes", "part_train"):
        counts = np.asarray(st[key])
        assert counts.max() <= math.ceil((1 + EPS) * counts.mean()) + 1, (key, counts)


def test_bucket_files_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    want = [[] for _ in range(5)]
    with BucketFiles(tmp_path, 5, buffer_bytes=4096) as b:
        for _ in range(30):
            ids, vals = rng.integers(0, 5, 3000), rng.integers(0, 1 << 50, 3000)
            b.add(ids, vals)
            for k in range(5):
                want[k].append(vals[ids == k])
        where = b.dir
        for k in range(5):
            exp = np.concatenate(want[k])
            assert b.count(k) == exp.size
            assert np.array_equal(b.read(k), exp)
            assert np.array_equal(np.concatenate(list(b.read_chunks(k, 777))), exp)
        b.discard(2)
        assert b.count(2) == 0 and b.read(2).size == 0
        with pytest.raises(ValueError, match="outside"):
            b.add(np.array([5]), np.array([1]))
    assert not where.exists()


def test_npy_writer_matches_np_save(tmp_path):
    arr = np.random.default_rng(1).random((1000, 7)).astype(np.float16)
    w = NpyWriter(tmp_path / "a.npy", arr.shape, arr.dtype)
    for s in range(0, 1000, 333):
        w.write(arr[s:s + 333])
    w.close()
    np.save(tmp_path / "b.npy", arr)
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
    short = NpyWriter(tmp_path / "c.npy", (10,), np.int64)
    short.write(np.arange(5))
    with pytest.raises(ValueError, match="needs 10"):
        short.close()


@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_reorder_rows_by_chunks(tmp_path, rows):
    """A part's rows, written in original-id order, rewritten in new-id order by chunks of
    any size (the last one short); the temporary file is gone afterwards."""
    orig = np.array([40, 3, 17, 8, 99, 5, 23, 61, 12, 2, 77])  # new id j -> original id
    by_id = np.sort(orig)
    feat = (np.repeat(by_id[:, None], 3, axis=1).astype(np.float16)
            + np.arange(3, dtype=np.float16))
    np.save(tmp_path / "feat-0.npy", feat)
    _reorder_rows(tmp_path / "feat-0.npy", tmp_path / "feat.npy", orig, rows)
    out = np.load(tmp_path / "feat.npy")
    assert out.dtype == np.float16 and np.array_equal(out[:, 0], orig.astype(np.float16))
    assert np.array_equal(out, feat[np.searchsorted(by_id, orig)])
    assert not (tmp_path / "feat-0.npy").exists()


@pytest.mark.parametrize("num_parts,sort_bytes,order", [
    (1, None, "degree"), (3, None, "degree"), (3, 8 * 2000, "degree"), (1, None, "id"),
    (3, 8 * 2000, "id")])
def test_stream_random_is_byte_identical_to_in_memory(graph, tmp_path, num_parts, sort_bytes,
                                                      order):
    """Same seed, same assignment, same relabel: the same bytes in every array file, also
    when parts are sorted in sub-buckets (sort_bytes 16 KB: ~5 sub-buckets per part), in
    either node order (degree: the streamed features and labels rewritten in new-id order)."""
    a, b = tmp_path / "mem", tmp_path / "stream"
    m1 = partition_graph(graph, num_parts, a, "random", seed=7, progress=False,
                         presample_batches=0, node_order=order)
    m2 = partition_stream(GraphSource(graph), num_parts, b, "random", seed=7, progress=False,
                          presample_batches=0, sort_bytes=sort_bytes, node_order=order)
    assert m1.stats["node_order"] == m2.stats["node_order"] == order
    assert _files(a) == _files(b)
    assert not any(p.name.startswith(("feat-", "label-")) for p in b.rglob("*"))
    for key, value in m1.stats.items():
        if not key.endswith("_s") and key != "peak_rss_bytes":
            assert m2.stats[key] == value, key
    assert (m2.stats["sort_sub_buckets"] > num_parts) == (sort_bytes is not None)
    assert m2.node_offsets == m1.node_offsets and m2.edge_cut == m1.edge_cut
    check_partition_set(graph, b)


@pytest.mark.parametrize("method", ["random", "fennel", "ldg"])
def test_streaming_partition_is_valid_and_balanced(graph, tmp_path, method):
    meta = partition_stream(GraphSource(graph), 4, tmp_path / "p", method, seed=0,
                            progress=False, max_memory_gb=2.0, sort_bytes=8 * 5000)
    check_partition_set(graph, tmp_path / "p")  # every node once, every edge once at its owner
    _assert_balanced(meta)
    st = meta.stats
    assert st["method"] == method and st["max_memory_bytes"] == 2 << 30
    assert 0 < st["peak_rss_sampled_bytes"] < st["max_memory_bytes"]
    # the assignment's passes, the bucketing pass and the degrees' pass
    assert st["passes"] == (3 if method != "random" else 1) + 1
    rank = np.load(tmp_path / "p" / "hot_rank.npy")
    for p in range(4):  # a permutation of each part's local ids
        lo, hi = meta.node_offsets[p], meta.node_offsets[p + 1]
        assert np.array_equal(np.sort(rank[lo:hi]), np.arange(hi - lo))
    if method != "random":  # a streaming partitioner cuts far fewer edges than random's 3/4
        assert st["edge_cut_frac"] < 0.6, st["edge_cut_frac"]


@pytest.mark.parametrize("num_parts,hops", [(2, 1), (3, 2)])
def test_stream_halo_is_byte_identical_to_in_memory(graph, tmp_path, num_parts, hops):
    """Halos found over the written parts' mapped CSC: the same node sets, in-edges,
    features and labels as partition.halo's, byte for byte."""
    a, b = tmp_path / "mem", tmp_path / "stream"
    m1 = partition_graph(graph, num_parts, a, "random", seed=3, progress=False,
                         presample_batches=0, halo_hops=hops)
    m2 = partition_stream(GraphSource(graph), num_parts, b, "random", seed=3, progress=False,
                          presample_batches=0, halo_hops=hops)
    assert _files(a) == _files(b)
    assert m2.halo_hops == hops and [p.num_halo_nodes for p in m2.parts] == \
        m1.stats["part_halo_nodes"] == m2.stats["part_halo_nodes"]
    assert all(p.num_halo_edges > 0 for p in m2.parts)


def test_stream_refuses_metis(graph, tmp_path):
    with pytest.raises(PartitionError, match="metis partitions in memory"):
        partition_stream(GraphSource(graph), 2, tmp_path / "m", "metis", progress=False)
    with pytest.raises(PartitionError, match="halo_hops=4"):
        partition_stream(GraphSource(graph), 2, tmp_path / "h", "random", halo_hops=4,
                         progress=False)
    assert not (tmp_path / "m").exists() and not (tmp_path / "h").exists()


@pytest.fixture(scope="module")
def binary_dir(tmp_path_factory) -> Path:
    """A products-shaped graph in OGB's binary layout: float16 features, 40% labelled."""
    raw = tmp_path_factory.mktemp("bin") / "raw"
    run_cli("partition.cli", ["--dataset", "synthetic", "--raw-format", "binary",
                              "--num-nodes", "4000", "--avg-degree", "10", "--feat-dim", "12",
                              "--num-classes", "6", "--feat-dtype", "float16",
                              "--labeled-frac", "0.4", "--raw-out", raw, "--no-progress"],
            timeout=80)
    return raw


def test_binary_nan_labels_float16_round_trip(binary_dir, tmp_path):
    """The binary layout streamed: float16 kept, NaN labels -> -1, only labelled seeds,
    each stored undirected edge twice (--add-reverse-edges)."""
    out = tmp_path / "parts"
    res = run_cli("partition.cli", ["--dataset-dir", binary_dir, "--add-reverse-edges",
                                    "--method", "fennel", "--num-parts", "2", "--out", out,
                                    "--no-progress"], timeout=80)
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["streamed"] and summary["feat_dtype"] == "float16"
    meta = PartitionSetMeta.load(out)
    assert meta.feat_dtype == "float16" and "float16" in FEAT_DTYPES
    with np.load(binary_dir / "raw" / "data.npz") as z:
        feat, ei = z["node_feat"], z["edge_index"]
    with np.load(binary_dir / "raw" / "node-label.npz") as z:
        label = z["node_label"][:, 0]
    assert meta.num_edges == 2 * ei.shape[1] - int(np.count_nonzero(ei[0] == ei[1]))
    labelled = 0
    for p in range(2):
        part = load_partition(out, p)
        orig = np.asarray(part.orig_ids)
        assert part.feat.dtype == np.float16
        assert np.array_equal(np.asarray(part.feat), feat[orig])
        want = np.where(np.isnan(label[orig]), -1, np.nan_to_num(label[orig])).astype(np.int64)
        assert np.array_equal(np.asarray(part.label), want)
        for s in ("train", "valid", "test"):  # seeds are labelled nodes
            local = np.asarray(getattr(part, s)) - part.node_start
            assert np.all(np.asarray(part.label)[local] >= 0)
        labelled += int(np.count_nonzero(want >= 0))
    assert 0.3 * meta.num_nodes < labelled < 0.5 * meta.num_nodes
    _assert_balanced(meta)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("halo", [0, 1])
def test_oracle_sampling_on_a_streamed_partition(server_factory, synth_graph, tmp_path, halo):
    """Real servers on a set streamed by fennel under a budget (conftest's 3000-node
    synth_graph, 2 parts, with and without a 1-hop halo): every MFG is the graph's (DGL
    oracle)."""
    graph, parts = synth_graph, tmp_path / "parts"
    partition_stream(GraphSource(graph), 2, parts, "fennel", seed=0, progress=False,
                     max_memory_gb=1.0, halo_hops=halo)
    cluster = ClusterSpec({p: [f"ipc://{tmp_path}/o{p}.sock"] for p in range(2)})
    cluster.write(tmp_path / "cluster.yaml")
    for p, ep in cluster.all_endpoints():
        server_factory(parts, p, cluster=tmp_path / "cluster.yaml", endpoint=ep)
    oracle = Oracle(graph, parts)
    ctx = zmq.Context()
    try:
        for p, ep in cluster.all_endpoints():
            with channel(ep, ctx=ctx, timeout_s=30) as ch:
                for fanouts, seed in (([4, 3], 1), ([-1, 2, 5], 2)):
                    seeds = mixed_seeds(parts, 60, seed + p)
                    reply = ch.call(SampleRequest(seeds=seeds, fanouts=fanouts))
                    assert isinstance(reply, MFGReply)
                    oracle.check(reply, seeds, fanouts)
    finally:
        ctx.term()


@needs_cora
def test_cli_cora_streamed_equals_in_memory(tmp_path):
    """partition-ogbn on Cora's csv layout: random in memory and random streamed under a
    budget (rawstream's csv reader) write the same bytes (hot_rank aside: a different
    pre-sampler)."""
    mem, streamed = tmp_path / "mem", tmp_path / "stream"
    run_cli("partition.cli", ["--dataset-dir", CORA, "--method", "random", "--num-parts", "3",
                              "--out", mem, "--no-progress"], timeout=80)
    res = run_cli("partition.cli", ["--dataset-dir", CORA, "--method", "random",
                                    "--num-parts", "3", "--max-memory-gb", "1", "--out",
                                    streamed, "--no-progress"], timeout=80)
    assert json.loads(res.stdout.strip().splitlines()[-1])["streamed"]
    a, b = _files(mem), _files(streamed)
    assert a.pop("hot_rank.npy") and b.pop("hot_rank.npy")
    assert a == b
