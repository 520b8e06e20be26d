"""Typed (heterogeneous) sampling by real sampler servers, with DGL's heterograph as oracle.

A mag-shaped graph (partition/maggen.py: 4 node types, 4 relations plus their reverses, all
types with features through ``--derive-features mean``) goes the real way: OGB raw layout ->
partition/hetero.py -> partition.partitioner.partition_graph, into 1, 2 and 4 parts (and 2
with a halo). Servers answer typed SampleRequests; for every layer and relation the test
checks that each sampled edge is an edge of that relation, that each destination got
min(in-degree in that relation, fanout_r) distinct in-neighbours (DGL's sampler on the
heterograph agrees), the per-type prefix rule, that fanout -1 gives exactly DGL's
``sample_neighbors(g, {type: nodes}, -1)`` edges, and that features / labels are the original
rows. Seeded requests repeat across threads, sampler processes, replicas and parts; bad
``rel_fanouts`` get a clear error reply and the server keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from procs import ServerProcess, stop_all
from rpc_helpers import call, channel

from common.cluster import ClusterSpec
from common.dgl_compat import import_dgl
from common.errors import RemoteError
from common.messages import (
    MFGReply,
    NeighborsReply,
    NeighborsRequest,
    RelFanouts,
    SampleRequest,
)
from common.shm_ring import ShmRing

pytestmark = pytest.mark.timeout(120)
PAPERS = 300  # -> 790 nodes, about 13k edges with the reverse relations


@pytest.fixture(scope="module")
def mag_data(tmp_path_factory):
    """The typed GraphData, read back from OGB's raw layout (the real reader)."""
    from partition.hetero import load_hetero
    from partition.maggen import generate_mag, write_mag_raw

    root = tmp_path_factory.mktemp("mag")
    raw = write_mag_raw(generate_mag(PAPERS, feat_dim=8, num_classes=4, seed=3), root / "raw",
                        progress=False)
    return load_hetero(dataset_dir=str(raw), add_reverse_edges=True, derive_features="mean",
                       work_dir=str(root / "work"))


@pytest.fixture(scope="module")
def mag_parts(mag_data, tmp_path_factory):
    """partition sets by (num_parts, halo_hops), made on first use."""
    from partition.partitioner import partition_graph

    made: dict[tuple[int, int], Path] = {}

    def get(num_parts: int, halo: int = 0) -> Path:
        if (num_parts, halo) not in made:
            out = tmp_path_factory.mktemp(f"magp{num_parts}h{halo}")
            partition_graph(mag_data, num_parts, str(out), method="metis", seed=0,
                            progress=False, halo_hops=halo, overwrite=True,
                            presample_batches=4, presample_batch_size=64)
            made[num_parts, halo] = out
        return made[num_parts, halo]

    return get


class Cluster:
    """Real servers of one partition set (``replicas[p]``: extra argv per replica of part p),
    started together; each one's exit code is checked at the end."""

    def __init__(self, parts: Path, tmp: Path, replicas: list[list[list[str]]]):
        self.spec = ClusterSpec({p: [f"ipc://{tmp}/t{p}r{r}.sock" for r in range(len(reps))]
                                 for p, reps in enumerate(replicas)})
        cluster_file = tmp / "cluster.yaml"
        self.spec.write(cluster_file)
        self.servers = [ServerProcess(parts, p, ep, cluster_file, tmp, replicas[p][r])
                        for p, eps in self.spec.partitions.items() for r, ep in enumerate(eps)]
        for s in self.servers:
            s.wait_ready(90)

    def ep(self, part: int, replica: int = 0) -> str:
        return self.spec.partitions[part][replica]


@pytest.fixture
def cluster(tmp_path):
    made: list[Cluster] = []

    def start(parts: Path, num_parts: int, replicas: list[list[list[str]]] | None = None
              ) -> Cluster:
        c = Cluster(parts, tmp_path, replicas or [[[]] for _ in range(num_parts)])
        made.append(c)
        return c

    yield start
    stop_all([s for c in made for s in c.servers])


class TypedOracle:
    """The original typed graph in global (relabelled) ids, and as a DGL heterograph."""

    def __init__(self, data, parts: Path):
        o2n = np.load(parts / "orig_to_new.npy")
        self.data, self.n = data, data.num_nodes
        self.n2o = np.empty_like(o2n)
        self.n2o[o2n] = np.arange(o2n.size)
        self.ntypes, self.etypes = list(data.ntypes), [list(t) for t in data.etypes]
        self.ntype = np.empty(self.n, dtype=np.int64)
        self.ntype[o2n] = data.node_type
        assert np.array_equal(np.load(parts / "node_type.npy"), self.ntype)
        self.tidx = np.empty(self.n, dtype=np.int64)  # per-type id of each global id
        self.tids = []  # global ids of each type, by per-type id
        for t in range(len(self.ntypes)):
            ids = np.flatnonzero(self.ntype == t)
            self.tidx[ids] = np.arange(ids.size)
            self.tids.append(ids)
        src, dst, et = o2n[data.src], o2n[data.dst], np.asarray(data.edge_type)
        self.keys, self.in_deg, edges = [], [], {}
        for r, (s, name, d) in enumerate(self.etypes):
            m = et == r
            assert (self.ntype[src[m]] == self.ntypes.index(s)).all()
            assert (self.ntype[dst[m]] == self.ntypes.index(d)).all()
            keys = dst[m] * self.n + src[m]
            assert np.unique(keys).size == keys.size, "the test graph has no multi-edges"
            self.keys.append(np.sort(keys))
            self.in_deg.append(np.bincount(dst[m], minlength=self.n))
            edges[(s, name, d)] = (torch.from_numpy(self.tidx[src[m]]),
                                   torch.from_numpy(self.tidx[dst[m]]))
        self.dgl = import_dgl()
        self.hg = self.dgl.heterograph(edges, num_nodes_dict={
            t: ids.size for t, ids in zip(self.ntypes, self.tids)})

    def seeds(self, ntype: str, count: int, seed: int) -> torch.Tensor:
        ids = self.tids[self.ntypes.index(ntype)]
        rng = np.random.default_rng(seed)
        return torch.from_numpy(rng.choice(ids, min(count, ids.size), replace=False))

    def check(self, reply: MFGReply, seeds: torch.Tensor, fans: list[list[int]],
              feat: bool = True) -> None:
        """``fans[l][r]``: relation r's fanout in layer l (input layer first)."""
        mfg = reply.mfg
        mfg.check()
        nt = len(self.ntypes)
        assert [ns.ntype for ns in mfg.nodes] == self.ntypes
        ids = [ns.ids.numpy() for ns in mfg.nodes]
        for t in range(nt):
            assert (self.ntype[ids[t]] == t).all(), "a node set holds nodes of another type"
            assert np.unique(ids[t]).size == ids[t].size
        ts = int(self.ntype[int(seeds[0])])
        assert np.array_equal(ids[ts][:seeds.numel()], seeds.numpy()), "seeds come first"
        assert mfg.layers[-1].num_dst == [seeds.numel() if t == ts else 0 for t in range(nt)]
        for li, layer in enumerate(mfg.layers):
            assert [(r.src_type, r.etype, r.dst_type) for r in layer.rels] == [
                (self.ntypes.index(s), name, self.ntypes.index(d)) for s, name, d in self.etypes]
            reached: list[set[int]] = [set(ids[t][:layer.num_dst[t]].tolist()) for t in range(nt)]
            dgl_fan = {tuple(c): f for c, f in zip(self.etypes, fans[li])}
            dst_nodes = {self.ntypes[t]: torch.from_numpy(self.tidx[ids[t][:layer.num_dst[t]]])
                         for t in range(nt) if layer.num_dst[t]}
            sg = self.dgl.sampling.sample_neighbors(self.hg, dst_nodes, dgl_fan)
            for r, rel in enumerate(layer.rels):
                s, d, f = rel.src_type, rel.dst_type, fans[li][r]
                nd = layer.num_dst[d]
                dst_g = ids[d][:nd]
                counts = np.diff(rel.indptr.numpy())
                src_g = ids[s][rel.indices.numpy()]
                dst_e = np.repeat(dst_g, counts)
                keys = dst_e * self.n + src_g
                where = f"layer {li}, relation {self.etypes[r]}"
                assert np.isin(keys, self.keys[r]).all(), f"{where}: not an edge of it"
                assert np.unique(keys).size == keys.size, f"{where}: a neighbour twice"
                deg = self.in_deg[r][dst_g]
                want = deg if f == -1 else np.minimum(deg, f)
                assert np.array_equal(counts, want), f"{where}: wrong neighbour counts"
                canon = tuple(self.etypes[r])
                if nd:  # DGL's sampler on the heterograph takes as many per destination
                    got = sg.in_degrees(torch.from_numpy(self.tidx[dst_g]), etype=canon)
                    assert np.array_equal(counts, got.numpy()), where
                if f == -1:  # all neighbours: exactly DGL's edges of this relation
                    u, v = sg.edges(etype=canon)
                    dgl_keys = np.sort(self.tids[d][v.numpy()] * self.n
                                       + self.tids[s][u.numpy()])
                    assert np.array_equal(np.sort(keys), dgl_keys), where
                reached[s].update(src_g.tolist())
            for t in range(nt):  # the sources are the destinations plus the sampled ones
                assert set(ids[t][:layer.num_src[t]].tolist()) == reached[t], f"layer {li}"
        for ns, got in zip(mfg.nodes, ids):
            if feat:
                assert ns.feat.via == "frames" and ns.feat.num_rows == got.size
                np.testing.assert_array_equal(ns.feat.rows.numpy(),
                                              self.data.feat[self.n2o[got]])
            want_label = (self.data.label[self.n2o[seeds.numpy()]] if ns is mfg.nodes[ts]
                          else np.zeros(0))
            np.testing.assert_array_equal(ns.label.numpy(), want_label)


def _fans(fanouts: list[int], rel: list[list[int]] | None, num_rel: int) -> list[list[int]]:
    return rel if rel else [[f] * num_rel for f in fanouts]


def _spread_seeds(oracle: TypedOracle, parts: Path, ntype: str, per_part: int, seed: int
                  ) -> torch.Tensor:
    """``ntype`` seeds from every part."""
    from partition.layout import PartitionSetMeta

    off = PartitionSetMeta.load(parts).node_offsets
    rng = np.random.default_rng(seed)
    t = oracle.ntypes.index(ntype)
    picks = []
    for lo, hi in zip(off[:-1], off[1:]):
        ids = np.flatnonzero(oracle.ntype[lo:hi] == t) + lo
        picks.append(rng.choice(ids, min(per_part, ids.size), replace=False))
    return torch.from_numpy(rng.permutation(np.concatenate(picks)))


@pytest.mark.parametrize("num_parts,halo", [(1, 0), (2, 0), (4, 0), (2, 1)])
def test_typed_mfg_matches_heterograph(num_parts, halo, mag_data, mag_parts, cluster):
    parts = mag_parts(num_parts, halo)
    c = cluster(parts, num_parts)
    oracle = TypedOracle(mag_data, parts)
    num_rel = len(oracle.etypes)
    assert num_rel == 7  # 4 relations, cites symmetrised in place, 3 rev_ relations
    rel = [[2, 3, -1, 1, 0, 2, 3], [3, 1, 2, 4, 2, 1, 2]]
    cases = [(["paper", [2, 2], rel]), (["paper", [-1, -1], None]), (["author", [3, 2], None]),
             (["paper", [4], None])]
    remote = 0
    ctx = zmq.Context()
    try:
        for p in range(num_parts):
            with channel(c.ep(p), ctx=ctx, timeout_s=60) as ch:
                for i, (ntype, fanouts, rf) in enumerate(cases):
                    seeds = _spread_seeds(oracle, parts, ntype, 12, 10 * p + i)
                    reply = ch.call(SampleRequest(
                        seeds=seeds, fanouts=fanouts,
                        rel_fanouts=RelFanouts.table(rf) if rf else []))
                    assert isinstance(reply, MFGReply)
                    oracle.check(reply, seeds, _fans(fanouts, rf, num_rel))
                    remote += int(reply.timings["remote_requests"])
    finally:
        ctx.term()
    assert (remote == 0) == (num_parts == 1)


def test_seeded_typed_mfg_repeats(mag_data, mag_parts, cluster):
    """The same seeded request gives the same typed MFG from a sampler thread, a sampler
    process, another replica and the other part's server; another seed gives another MFG."""
    parts = mag_parts(2)
    c = cluster(parts, 2, [[[], ["--sampler-procs", "1"]], [[]]])
    oracle = TypedOracle(mag_data, parts)
    from partition.layout import PartitionSetMeta

    lo, hi = PartitionSetMeta.load(parts).node_offsets[:2]
    paper = oracle.ntypes.index("paper")
    own = np.flatnonzero(oracle.ntype[lo:hi] == paper)[:40] + lo  # all owned by part 0
    seeds = torch.from_numpy(own)
    rf = [[2, 3, 2, 1, 2, 2, 3], [2, 2, 2, 3, 1, 2, 2]]

    def ask(ep: str, sample_seed: int) -> MFGReply:
        return call(ep, SampleRequest(seeds=seeds, fanouts=[2, 2], sample_seed=sample_seed,
                                      rel_fanouts=RelFanouts.table(rf)), MFGReply, timeout_s=60)

    def flat(reply: MFGReply) -> list[torch.Tensor]:
        m = reply.mfg
        return ([ns.ids for ns in m.nodes] + [ns.feat.rows for ns in m.nodes]
                + [t for layer in m.layers for r in layer.rels for t in (r.indptr, r.indices)])

    first = ask(c.ep(0, 0), 7)
    oracle.check(first, seeds, rf)
    for ep in (c.ep(0, 0), c.ep(0, 1), c.ep(1, 0)):
        again = flat(ask(ep, 7))
        assert all(torch.equal(a, b) for a, b in zip(flat(first), again)), ep
    other = ask(c.ep(0, 0), 8)
    oracle.check(other, seeds, rf)
    assert not all(torch.equal(a, b) for a, b in zip(flat(first), flat(other)))


def test_typed_features_ring_fp16_cache(mag_data, mag_parts, cluster):
    """Ring slot (rows in node-set order), half-precision transfer and the feature cache's
    present-mask per node set, from a 2-part cluster."""
    from partition.layout import PartitionSetMeta, cached_mask, load_hot_rank

    parts = mag_parts(2)
    c = cluster(parts, 2)
    oracle = TypedOracle(mag_data, parts)
    seeds = _spread_seeds(oracle, parts, "paper", 15, 5)
    fans = [[3] * 7, [2] * 7]
    ring = ShmRing(1, 1 << 20)
    try:
        reply = call(c.ep(0), SampleRequest(seeds=seeds, fanouts=[3, 2],
                                            slot=ring.ref(ring.acquire())), MFGReply,
                     timeout_s=60)
        oracle.check(reply, seeds, fans, feat=False)
        feats = [ns.feat for ns in reply.mfg.nodes]
        assert all(f.via == "ring" and not f.slot_error for f in feats)
        total = sum(f.num_rows for f in feats)
        dim = feats[0].rows.shape[1]
        rows = ring.view(0, total, dim, feats[0].rows.dtype)
        want = np.concatenate([mag_data.feat[oracle.n2o[ns.ids.numpy()]]
                               for ns in reply.mfg.nodes])
        np.testing.assert_array_equal(rows.numpy(), want)
        del rows
    finally:
        ring.close()
    half = call(c.ep(1), SampleRequest(seeds=seeds, fanouts=[3, 2], feat_dtype="float16"),
                MFGReply, timeout_s=60)
    oracle.check(half, seeds, fans, feat=False)
    for ns in half.mfg.nodes:
        assert ns.feat.rows.dtype == torch.float16 and ns.feat.num_rows == ns.ids.numel()
        want = torch.from_numpy(mag_data.feat[oracle.n2o[ns.ids.numpy()]])
        torch.testing.assert_close(ns.feat.rows.float(), want.half().float())
    rank = load_hot_rank(parts)
    assert rank is not None
    offsets = PartitionSetMeta.load(parts).node_offsets
    cached = call(c.ep(0), SampleRequest(seeds=seeds, fanouts=[3, 2], cache_ratio=0.5),
                  MFGReply, timeout_s=60)
    oracle.check(cached, seeds, fans, feat=False)
    left_out = 0
    for ns in cached.mfg.nodes:
        ids = ns.ids.numpy()
        present = ns.feat.present.numpy()
        if ids.size:
            assert present.size == ids.size
            assert np.array_equal(~present, cached_mask(rank, ids, offsets, 0.5))
        np.testing.assert_array_equal(ns.feat.rows.numpy(),
                                      mag_data.feat[oracle.n2o[ids[present]]] if ids.size
                                      else np.zeros((0, ns.feat.rows.shape[1])))
        left_out += ns.feat.cached_rows
    assert left_out > 0, "no row was left out"


def test_bad_typed_requests_answered(mag_data, mag_parts, cluster, synth_parts1):
    """Bad rel_fanouts / mixed seed types / unknown relation get a clear error reply naming
    the field, and the server keeps serving; a homogeneous set refuses rel_fanouts."""
    parts = mag_parts(1)
    c = cluster(parts, 1)
    oracle = TypedOracle(mag_data, parts)
    papers = oracle.seeds("paper", 6, 1)
    mixed = torch.cat([papers, oracle.seeds("author", 3, 2)])
    bad = {
        "bad_field:rel_fanouts needs one fanout per relation": SampleRequest(
            seeds=papers, fanouts=[2, 2], rel_fanouts=RelFanouts.table([[2, 2], [2, 2]])),
        "bad_field:rel_fanouts must have one entry per layer": SampleRequest(
            seeds=papers, fanouts=[2, 2], rel_fanouts=RelFanouts.table([[2] * 7])),
        "bad_field:rel_fanouts: each fanout must be -1 or": SampleRequest(
            seeds=papers, fanouts=[2], rel_fanouts=RelFanouts.table([[2] * 6 + [-3]])),
        "bad_seeds:seeds must all be of one node type": SampleRequest(
            seeds=mixed, fanouts=[2]),
        "bad_request:etype 99 is not a relation id": NeighborsRequest(
            nodes=papers, fanout=2, etype=99),
    }
    for want, msg in bad.items():
        code, text = want.split(":", 1)
        with pytest.raises(RemoteError) as e:
            call(c.ep(0), msg, timeout_s=30)
        assert e.value.code == code and text in str(e.value), str(e.value)
        ok = call(c.ep(0), SampleRequest(seeds=papers, fanouts=[2]), MFGReply, timeout_s=30)
        oracle.check(ok, papers, [[2] * 7])
    # one relation of the seeds' in-edges, by NeighborsRequest(etype=r) as peers send it
    r = oracle.etypes.index(["author", "writes", "paper"])
    nb = call(c.ep(0), NeighborsRequest(nodes=papers, fanout=2, etype=r, seed=5), NeighborsReply,
              timeout_s=30)
    assert np.array_equal(nb.counts.numpy(), np.minimum(oracle.in_deg[r][papers.numpy()], 2))
    keys = np.repeat(papers.numpy(), nb.counts.numpy()) * oracle.n + nb.src.numpy()
    assert np.isin(keys, oracle.keys[r]).all()
    # a homogeneous set: rel_fanouts refused (the check the sampler runs on every request)
    from common.errors import ProtocolError
    from sampler_server.partition_store import PartitionStore
    from sampler_server.sample_worker import typed_fanouts

    store = PartitionStore(str(synth_parts1), 0)
    with pytest.raises(ProtocolError, match="rel_fanouts is for typed partition sets"):
        typed_fanouts(SampleRequest(seeds=papers, fanouts=[2],
                                    rel_fanouts=RelFanouts.table([[2]])), store)
    assert typed_fanouts(SampleRequest(seeds=papers, fanouts=[2]), store) is None


@pytest.mark.parametrize("kernel", ["native", "numpy"])
def test_relation_runs_match_a_scan(kernel, monkeypatch):
    """relation_runs (the per-relation run of each destination's etype-sorted in-edge
    segment) against a plain scan: empty segments, absent relations, the array's last row;
    by the C kernel and by the numpy passes it falls back to."""
    from common import native
    from sampler_server import partition_store
    from sampler_server.partition_store import relation_runs

    if kernel == "native":
        if native.load() is None:
            pytest.skip(f"native kernels not loaded: {native.status()}")
    else:
        monkeypatch.setattr(partition_store.native, "load", lambda: None)
    rng = np.random.default_rng(0)
    deg = rng.integers(0, 40, 300)
    deg[[0, 7, -1]] = [0, 1, 33]
    indptr = np.concatenate([[0], np.cumsum(deg)])
    etype = np.concatenate([np.sort(rng.integers(0, 5, d)) for d in deg]).astype(np.int16)
    rows = rng.permutation(deg.size)
    for r in range(6):
        start, cnt = relation_runs(indptr, etype, rows, r)
        for i, v in enumerate(rows):
            seg = etype[indptr[v]:indptr[v + 1]]
            hit = np.flatnonzero(seg == r)
            assert cnt[i] == hit.size
            if hit.size:
                assert start[i] == indptr[v] + hit[0] and (np.diff(hit) == 1).all()


def test_relation_runs_refuse_rows_outside_the_csc():
    """The C kernel checks every row and segment before writing: a row past the CSC, or an
    indptr pointing past the relation ids (a damaged partition), is an IndexError naming
    both sizes, not a read out of bounds."""
    from common import native
    from sampler_server.partition_store import relation_runs

    if native.load() is None:
        pytest.skip(f"native kernels not loaded: {native.status()}")
    indptr = np.array([0, 2, 5], dtype=np.int64)
    etype = np.array([0, 1, 0, 0, 2], dtype=np.int16)
    start, deg = relation_runs(indptr, etype, np.array([1, 0]), 0)
    assert start.tolist() == [2, 0] and deg.tolist() == [2, 1]
    with pytest.raises(IndexError, match="outside the CSC's 2 rows"):
        relation_runs(indptr, etype, np.array([0, 2]), 0)
    with pytest.raises(IndexError, match="outside its 4 relation ids"):
        relation_runs(indptr, etype[:4], np.array([1]), 0)
