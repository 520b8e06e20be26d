"""MFGs served by real sampler servers, checked against the original graph with DGL as oracle.

For 1, 2 and 4 partitions: every sampled edge exists in the graph, each destination gets
min(in-degree, fanout) distinct in-neighbours whatever part they live in, destination nodes
come first among source nodes (dgl.to_block agrees), and the features / labels are the
original rows of exactly the nodes named.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from rpc_helpers import channel

from common.cluster import ClusterSpec
from common.dgl_compat import import_dgl
from common.messages import MFGReply, Ping, Pong, SampleRequest
from common.mfg import MFG

pytestmark = pytest.mark.timeout(180)


class Oracle:
    """The original graph in global (relabelled) ids."""

    def __init__(self, graph, parts: Path):
        self.graph = graph
        o2n = np.load(parts / "orig_to_new.npy")
        self.n2o = np.empty_like(o2n)
        self.n2o[o2n] = np.arange(o2n.size)
        self.src, self.dst = o2n[graph.src], o2n[graph.dst]
        self.n = graph.num_nodes
        self.edge_keys = np.unique(self.dst * self.n + self.src)
        self.in_deg = np.bincount(self.dst, minlength=self.n)
        dgl = import_dgl()
        self.dgl = dgl
        self.g = dgl.graph((torch.from_numpy(self.src), torch.from_numpy(self.dst)),
                           num_nodes=self.n)

    def check(self, reply: MFGReply, seeds: torch.Tensor, fanouts: list[int]) -> None:
        """The reply's MFG (read through the trainer's view, MFG.of) against the graph."""
        mfg = MFG.of(reply.mfg)
        nodes = mfg.input_nodes.numpy()
        assert len(np.unique(nodes)) == nodes.size, "source node ids must be unique"
        assert mfg[-1].num_dst_nodes() == seeds.numel()
        assert torch.equal(mfg.output_nodes, seeds), "seeds come first"
        for layer, fanout in enumerate(fanouts):
            ns, nd = mfg[layer].num_src_nodes(), mfg[layer].num_dst_nodes()
            if layer + 1 < len(fanouts):
                assert mfg[layer + 1].num_src_nodes() == nd
            indptr, indices = mfg[layer].indptr.numpy(), mfg[layer].indices.numpy()
            counts = np.diff(indptr)
            dst_local = np.repeat(np.arange(nd), counts)
            src_g, dst_g = nodes[indices], nodes[dst_local]
            # every sampled edge is an edge of the graph
            assert np.isin(dst_g * self.n + src_g, self.edge_keys).all(), f"layer {layer}: fake edge"
            # no neighbour twice for one destination (sampling without replacement)
            assert np.unique(dst_g * self.n + src_g).size == src_g.size
            # fanout respected: min(degree, fanout) each, like DGL's sampler
            want = self.in_deg[nodes[:nd]] if fanout == -1 else np.minimum(
                self.in_deg[nodes[:nd]], fanout)
            assert np.array_equal(counts, want), f"layer {layer}: wrong neighbour counts"
            dgl_counts = self.dgl.sampling.sample_neighbors(
                self.g, torch.from_numpy(nodes[:nd]), fanout).in_degrees(torch.from_numpy(nodes[:nd]))
            assert np.array_equal(counts, dgl_counts.numpy())
            # destination nodes first among sources; DGL's to_block agrees on the node sets
            frontier = self.dgl.graph((torch.from_numpy(src_g), torch.from_numpy(dst_g)),
                                      num_nodes=self.n)
            blk = self.dgl.to_block(frontier, dst_nodes=torch.from_numpy(nodes[:nd]))
            dgl_src = blk.srcdata[self.dgl.NID].numpy()
            assert np.array_equal(dgl_src[:nd], nodes[:nd])
            assert set(dgl_src.tolist()) <= set(nodes[:ns].tolist())
            assert set(nodes[indices].tolist()) | set(nodes[:nd].tolist()) == set(
                dgl_src.tolist())
        orig = self.n2o[nodes]
        np.testing.assert_array_equal(mfg[0].srcdata["feat"].numpy(), self.graph.feat[orig])
        np.testing.assert_array_equal(mfg[-1].dstdata["label"].numpy(),
                                      self.graph.label[self.n2o[seeds.numpy()]])


def start_cluster(server_factory, parts: Path, tmp_path: Path, num_parts: int,
                  replicas: int = 1) -> ClusterSpec:
    cluster = ClusterSpec({p: [f"ipc://{tmp_path}/c{p}r{r}.sock" for r in range(replicas)]
                           for p in range(num_parts)})
    cluster_file = tmp_path / "cluster.yaml"
    cluster.write(cluster_file)
    for p, ep in cluster.all_endpoints():
        server_factory(parts, p, cluster=cluster_file, endpoint=ep)
    return cluster


def mixed_seeds(parts: Path, count: int, seed: int) -> torch.Tensor:
    """Seeds spread over every part (global ids), unique."""
    from partition.layout import PartitionSetMeta

    meta = PartitionSetMeta.load(parts)
    rng = np.random.default_rng(seed)
    per = max(1, count // meta.num_parts)
    picks = [rng.choice(np.arange(meta.node_offsets[p], meta.node_offsets[p + 1]), per,
                        replace=False) for p in range(meta.num_parts)]
    return torch.from_numpy(rng.permutation(np.concatenate(picks)).astype(np.int64))


@pytest.mark.parametrize("num_parts,halo,kernels", [
    (1, False, "native"), (2, False, "native"), (4, False, "native"), (2, True, "native"),
    (2, True, "numpy")])
def test_mfg_matches_graph(num_parts, halo, kernels, request, server_factory, synth_graph,
                           tmp_path, monkeypatch):
    """``kernels``: the servers' relabel in the native kernel (common/native.c, the default
    where a C compiler is present) or in numpy (MFGSERVE_NATIVE=0, as without one); each
    server's ``serving`` line says which."""
    parts = request.getfixturevalue(f"synth_parts{num_parts}" + ("_halo" if halo else ""))
    if kernels == "numpy":
        monkeypatch.setenv("MFGSERVE_NATIVE", "0")
    servers = []
    cluster = start_cluster(lambda *a, **k: servers.append(server_factory(*a, **k)), parts,
                            tmp_path, num_parts)
    want = '"native": "loaded"' if kernels == "native" else "MFGSERVE_NATIVE=0"
    for s in servers:
        assert want in s.log.read_text(), s.log.read_text()[-2000:]
    oracle = Oracle(synth_graph, parts)
    remote: dict[bool, float] = {}
    ctx = zmq.Context()
    try:
        for p, ep in cluster.all_endpoints():
            with channel(ep, ctx=ctx, timeout_s=30) as ch:
                pong = ch.call(Ping())
                assert isinstance(pong, Pong) and pong.part_id == p
                for fanouts, seed in (([4, 3], 1), ([-1, 2, 5], 2)):
                    seeds = mixed_seeds(parts, 60, seed + p)
                    reply = ch.call(SampleRequest(seeds=seeds, fanouts=fanouts))
                    assert isinstance(reply, MFGReply)
                    oracle.check(reply, seeds, fanouts)
                    remote[halo] = remote.get(halo, 0) + reply.timings["remote_requests"]
    finally:
        ctx.term()
    if num_parts == 1:
        assert remote[halo] == 0


def test_halo_holds_complete_in_edges(synth_graph, synth_parts2_halo):
    """Each halo node's stored in-edges are exactly its in-edges in the graph; halo nodes are
    other parts' in-neighbours of the part's nodes."""
    from partition.layout import load_partition

    oracle = Oracle(synth_graph, synth_parts2_halo)
    for p in range(2):
        part = load_partition(synth_parts2_halo, p)
        lo, hi = part.meta.node_offsets[p], part.meta.node_offsets[p + 1]
        halo = np.asarray(part.halo_nodes)
        assert halo.size > 0 and ((halo < lo) | (halo >= hi)).all()
        owned_nbrs = np.unique(np.asarray(part.indices))
        want_halo = owned_nbrs[(owned_nbrs < lo) | (owned_nbrs >= hi)]
        assert np.array_equal(halo, want_halo)
        indptr, indices = np.asarray(part.halo_indptr), np.asarray(part.halo_indices)
        for i in range(0, halo.size, max(1, halo.size // 50)):
            got = np.sort(indices[indptr[i]:indptr[i + 1]])
            want = np.sort(oracle.src[oracle.dst == halo[i]])
            assert np.array_equal(got, want)
        np.testing.assert_array_equal(part.halo_feat, synth_graph.feat[oracle.n2o[halo]])


def test_neighbour_choice_uniform_across_parts(server_factory, synth_graph, synth_parts2,
                                               tmp_path):
    """A high-degree node with in-neighbours in both parts: each neighbour is picked with
    probability fanout/degree (chi-square goodness of fit)."""
    from scipy.stats import chisquare

    cluster = start_cluster(server_factory, synth_parts2, tmp_path, 2)
    oracle = Oracle(synth_graph, synth_parts2)
    from partition.layout import PartitionSetMeta

    offsets = PartitionSetMeta.load(synth_parts2).node_offsets
    owner = np.searchsorted(offsets, np.arange(oracle.n), side="right") - 1
    cands = []
    for v in np.argsort(-oracle.in_deg)[:200]:
        nbrs = oracle.src[oracle.dst == v]
        if len(set(owner[nbrs])) == 2 and nbrs.size >= 12:
            cands.append((v, nbrs))
            break
    assert cands, "test graph needs a high-degree node with neighbours in both parts"
    v, nbrs = cands[0]
    fanout, rounds = 4, 400
    # ask the server of the part that does NOT own v: the request crosses parts
    other = 1 - int(owner[v])
    ctx = zmq.Context()
    try:
        with channel(cluster.partitions[other][0], ctx=ctx, timeout_s=30) as ch:
            hits: dict[int, int] = {}
            for _ in range(rounds):
                reply = ch.call(SampleRequest(seeds=torch.tensor([int(v)]), fanouts=[fanout],
                                              with_feat=False, with_label=False))
                picked = reply.mfg.input_nodes[reply.mfg.layers[0].rels[0].indices].tolist()
                assert len(picked) == fanout
                for u in picked:
                    hits[u] = hits.get(u, 0) + 1
    finally:
        ctx.term()
    uniq = np.unique(nbrs)
    observed = np.array([hits.get(int(u), 0) for u in uniq])
    assert observed.sum() == rounds * fanout
    expected = np.full(uniq.size, rounds * fanout / uniq.size)
    assert chisquare(observed, expected).pvalue > 1e-4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_feature_transfer(dtype, server_factory, synth_graph, synth_parts1,
                                         tmp_path):
    """feat_dtype halves the feature bytes; the rows are the original ones, rounded."""
    cluster = start_cluster(server_factory, synth_parts1, tmp_path, 1)
    oracle = Oracle(synth_graph, synth_parts1)
    ctx = zmq.Context()
    try:
        with channel(cluster.partitions[0][0], ctx=ctx, timeout_s=30) as ch:
            seeds = mixed_seeds(synth_parts1, 40, 5)
            full = ch.call(SampleRequest(seeds=seeds, fanouts=[3, 3]))
            half = ch.call(SampleRequest(seeds=seeds, fanouts=[3, 3], feat_dtype=dtype))
    finally:
        ctx.term()
    full_rows, half_rows = full.mfg.only.feat.rows, half.mfg.only.feat.rows
    assert full_rows.dtype == torch.float32 and half_rows.dtype == getattr(torch, dtype)
    assert half_rows.element_size() == 2 and full_rows.element_size() == 4
    want = torch.from_numpy(synth_graph.feat[oracle.n2o[half.mfg.input_nodes.numpy()]])
    torch.testing.assert_close(half_rows.float(), want.to(getattr(torch, dtype)).float())


def test_feature_cache_rows_left_out_and_restored(server_factory, synth_graph, synth_parts2,
                                                  tmp_path):
    """With a cache ratio, servers leave out the hot nodes' rows (fewer bytes) and the
    trainer's cache restores exactly the original features."""
    from trainer_client.feature_cache import FeatureCache
    from trainer_client.server_pool import ServerPool

    cluster = start_cluster(server_factory, synth_parts2, tmp_path, 2)
    oracle = Oracle(synth_graph, synth_parts2)
    pool = ServerPool(cluster, timeout_s=30, max_message_bytes=64 << 20)
    try:
        info = pool.info()
        cache = FeatureCache.fill(pool, 2, info.num_nodes, 0.25, "", torch.device("cpu"))
        sizes = np.diff(info.node_offsets)
        assert cache.num_cached == sum(int(0.25 * s) for s in sizes)
        seeds = mixed_seeds(synth_parts2, 80, 9)
        reply = pool.wait(pool.submit(0, SampleRequest(seeds=seeds, fanouts=[5, 5],
                                                       cache_ratio=0.25)))
        ids, f = reply.mfg.input_nodes, reply.mfg.only.feat
        assert f.via == "frames" and f.present.numel() == ids.numel()
        assert f.rows.shape[0] < ids.numel() and f.cached_rows > 0, "no row was left out"
        feat = cache.assemble(ids, f.rows, f.present)
        np.testing.assert_array_equal(feat.numpy(), synth_graph.feat[oracle.n2o[ids.numpy()]])
        assert cache.rows_served == f.cached_rows
    finally:
        pool.close()
