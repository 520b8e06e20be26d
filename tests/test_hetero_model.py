"""Typed MFGs (common.mfg.HeteroMFG) and the relational GraphSAGE (trainer_client.hetero_model)
against DGL as the oracle.

A random heterograph (3 node types with different feature widths, 5 relations, one of them
same-type) is sampled with DGL's own sampler (dgl.sampling.sample_neighbors with per-relation
fanouts + dgl.to_block); the blocks become a SampledMFG (the wire struct, checked), and then:
the view's DGL blocks have DGL's edges and node ids per relation / type; the model computes
what dgl.nn.HeteroGraphConv of SAGEConv computes (forward and every gradient, mean and sum);
a homogeneous SampledMFG through the same model is trainer_client.model.GraphSAGE; the model
learns; .to() / pin_memory keep everything.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.dgl_compat import import_dgl
from common.errors import ConfigError
from common.mfg import NID, HeteroMFG, to_device
from common.sampled_mfg import Features, Layer, NodeSet, Relation, SampledMFG
from trainer_client.hetero_model import (
    HeteroSAGE,
    RelGraphSAGE,
    build_hetero_model,
    check_hetero_spec,
    hetero_spec,
)
from trainer_client.model import GraphSAGE

pytestmark = pytest.mark.timeout(60)

NTYPES = ["author", "paper", "field"]
ETYPES = [("paper", "cites", "paper"), ("author", "writes", "paper"),
          ("paper", "written_by", "author"), ("paper", "has_topic", "field"),
          ("field", "topic_of", "paper")]
WIDTHS = {"author": 6, "paper": 8, "field": 5}
NUM = {"author": 40, "paper": 60, "field": 12}
FANOUTS = [{"cites": 3, "writes": 2, "written_by": 2, "has_topic": 1, "topic_of": 2},
           {"cites": 4, "writes": 3, "written_by": 2, "has_topic": 2, "topic_of": 1}]
CLASSES = 4


def make_graph(seed: int = 0, etypes=ETYPES):
    dgl = import_dgl()
    g = torch.Generator().manual_seed(seed)
    data = {}
    for s, e, d in etypes:
        n = 3 * NUM[d]
        src = torch.randint(0, NUM[s], (n,), generator=g)
        dst = torch.randint(0, NUM[d], (n,), generator=g)
        keys = torch.unique(src * NUM[d] + dst)  # no parallel edges
        data[(s, e, d)] = (keys // NUM[d], keys % NUM[d])
    graph = dgl.heterograph(data, num_nodes_dict=NUM)
    feat = {t: torch.randn(NUM[t], WIDTHS[t], generator=g) for t in NTYPES}
    label = torch.randint(0, CLASSES, (NUM["paper"],), generator=g)
    return graph, feat, label


def dgl_blocks(graph, seeds: torch.Tensor, fanouts: list[dict[str, int]], seed: int = 0):
    """DGL's sampled blocks for paper seeds, input layer first (what NeighborSampler does)."""
    dgl = import_dgl()
    dgl.seed(seed)
    dst = {"paper": seeds}
    blocks = []
    for fanout in reversed(fanouts):
        frontier = dgl.sampling.sample_neighbors(
            graph, dst, {c: fanout[c[1]] for c in graph.canonical_etypes})
        blk = dgl.to_block(frontier, dst)
        dst = {t: blk.srcnodes[t].data[dgl.NID] for t in blk.srctypes}
        blocks.insert(0, blk)
    return blocks


def to_sampled(blocks, feat, label) -> SampledMFG:
    """DGL blocks -> the wire struct: node type t's input ids are the first block's source
    ids (each later layer's ids are prefixes of them), one CSC per relation per layer."""
    dgl = import_dgl()
    ntypes = blocks[0].srctypes
    nodes = []
    for t in ntypes:
        ids = blocks[0].srcnodes[t].data[dgl.NID]
        out = blocks[-1].num_dst_nodes(t)
        nodes.append(NodeSet(ids, Features.frames(feat[t][ids]),
                             label[ids[:out]] if t == "paper" else torch.empty(0, dtype=torch.int64),
                             ntype=t))
    layers = []
    for blk in blocks:
        for t in ntypes:  # the prefix rule, as DGL builds it
            n_src, n_dst = blk.num_src_nodes(t), blk.num_dst_nodes(t)
            ids = nodes[ntypes.index(t)].ids
            assert torch.equal(blk.srcnodes[t].data[dgl.NID], ids[:n_src])
            assert torch.equal(blk.dstnodes[t].data[dgl.NID], ids[:n_dst])
        rels = []
        for s, e, d in blk.canonical_etypes:
            indptr, indices, _ = blk.adj_tensors("csc", (s, e, d))
            rels.append(Relation(indptr.long(), indices.long(), ntypes.index(s),
                                 ntypes.index(d), e))
        layers.append(Layer([blk.num_src_nodes(t) for t in ntypes],
                            [blk.num_dst_nodes(t) for t in ntypes], rels))
    sampled = SampledMFG(nodes, layers)
    for ns in sampled.nodes:
        ns.feat.check()
        ns.check()
    for layer in sampled.layers:
        for r in layer.rels:
            r.check()
        layer.check()
    sampled.check()
    return sampled


@pytest.fixture(scope="module")
def batch():
    graph, feat, label = make_graph()
    seeds = torch.arange(0, NUM["paper"], 3)
    blocks = dgl_blocks(graph, seeds, FANOUTS)
    return graph, feat, label, seeds, blocks, to_sampled(blocks, feat, label)


def edge_set(blk, etype) -> list[tuple[int, int]]:
    s, d = blk.edges(etype=etype)
    return sorted(zip(s.tolist(), d.tolist()))


def test_view_and_to_dgl_match_dgls_blocks(batch):
    dgl = import_dgl()
    graph, feat, label, seeds, blocks, sampled = batch
    mfg = HeteroMFG.of(sampled)
    assert mfg.seed_ntype == "paper" and torch.equal(mfg.output_nodes, seeds)
    assert mfg.ntypes == graph.ntypes != NTYPES and len(mfg) == len(FANOUTS)  # by name
    assert torch.equal(mfg.label, label[seeds])
    for t in NTYPES:
        assert torch.equal(mfg.feat[t], feat[t][mfg.input_nodes[t]])
    for ours, ref in zip(mfg.to_dgl(), blocks):
        assert ours.is_block
        assert sorted(ours.canonical_etypes) == sorted(ref.canonical_etypes)
        for t in NTYPES:
            assert ours.num_src_nodes(t) == ref.num_src_nodes(t)
            assert ours.num_dst_nodes(t) == ref.num_dst_nodes(t)
            assert torch.equal(ours.srcnodes[t].data[NID], ref.srcnodes[t].data[dgl.NID])
            assert torch.equal(ours.dstnodes[t].data[NID], ref.dstnodes[t].data[dgl.NID])
        for c in ref.canonical_etypes:
            assert edge_set(ours, c) == edge_set(ref, c), c
            # and every sampled edge is an edge of the graph, in global ids
            s, d = ours.edges(etype=c)
            gs = ours.srcnodes[c[0]].data[NID][s]
            gd = ours.dstnodes[c[2]].data[NID][d]
            assert bool(graph.has_edges_between(gs, gd, etype=c).all())
    first = mfg.to_dgl()[0]
    for t in NTYPES:
        assert torch.equal(first.srcnodes[t].data["feat"], mfg.feat[t])
    assert torch.equal(mfg.to_dgl()[-1].dstnodes["paper"].data["label"], label[seeds])


def test_seed_ntype_and_unknown_types_are_named(batch):
    *_, sampled = batch
    with pytest.raises(ValueError, match="not in this MFG's node types"):
        HeteroMFG.of(sampled, seed_ntype="venue")
    with pytest.raises(ValueError, match="which this MFG does not have"):
        HeteroMFG.of(sampled, feat={"venue": torch.zeros(1, 1)})
    mfg = HeteroMFG.of(sampled)
    model = RelGraphSAGE(NTYPES, ETYPES[:4], WIDTHS, 8, CLASSES, 2, "paper")
    with pytest.raises(ValueError, match=r"relation \('field', 'topic_of', 'paper'\)"):
        model(mfg, mfg.feat)
    model = RelGraphSAGE(NTYPES, ETYPES, WIDTHS, 8, CLASSES, 2, "paper")
    x = dict(mfg.feat)
    x["field"] = x["field"][:-1]
    with pytest.raises(ValueError, match=r"needs \d+ source states of node type 'field', got"):
        model(mfg, x)
    del x["field"]
    with pytest.raises(ValueError, match="no input states for node type 'field'"):
        model(mfg, x)
    model = RelGraphSAGE(NTYPES, ETYPES, WIDTHS, 8, CLASSES, 2, "author")
    with pytest.raises(ValueError, match="seeds are of node type 'paper'"):
        model(mfg, mfg.feat)


class DGLSumSAGE(nn.Module):
    """SAGEConv's form with a sum over in-edges (DGL message passing), for the reference."""

    def __init__(self, in_feats: tuple[int, int], out_feats: int):
        super().__init__()
        self.fc_self = nn.Linear(in_feats[1], out_feats)
        self.fc_neigh = nn.Linear(in_feats[0], out_feats, bias=False)

    def forward(self, g, h):
        import dgl.function as fn

        with g.local_scope():
            g.srcdata["h"] = h[0]
            g.update_all(fn.copy_u("h", "m"), fn.sum("m", "neigh"))
            return self.fc_self(h[1]) + self.fc_neigh(g.dstdata["neigh"])


class DGLReference(nn.Module):
    """The DGL model: HeteroGraphConv({rel: SAGEConv}, aggregate="sum") layers, ReLU between,
    each layer's relations built in ``etypes`` order (as HeteroSAGE builds its own)."""

    def __init__(self, dims: list[dict[str, int]], aggregator: str, etypes=ETYPES):
        super().__init__()
        from dgl.nn import HeteroGraphConv, SAGEConv

        def conv(s, d, i, o):
            if aggregator == "mean":
                return SAGEConv((i[s], i[d]), o, "mean")
            return DGLSumSAGE((i[s], i[d]), o)

        self.layers = nn.ModuleList(
            HeteroGraphConv({e: conv(s, d, i, o[NTYPES[0]]) for s, e, d in etypes},
                            aggregate="sum")
            for i, o in zip(dims[:-1], dims[1:]))

    def forward(self, blocks, x):
        h = x
        for i, (layer, blk) in enumerate(zip(self.layers, blocks)):
            h = layer(blk, h)
            if i < len(self.layers) - 1:
                h = {t: F.relu(v) for t, v in h.items()}
        return h["paper"]


def copy_from_reference(model: RelGraphSAGE, ref: DGLReference) -> None:
    """Per relation W_r = fc_neigh; per node type W_self / b = the sums of fc_self / bias
    over the relations into it (HeteroGraphConv sums the relations' outputs)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for ours, theirs in zip(model.layers, ref.layers):
            for p in theirs.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            for r, (_, e, _) in enumerate(ours.etypes):
                ours.rel_fc[r].weight.copy_(theirs.mods[e].fc_neigh.weight)
            for ti, t in enumerate(ours.ntypes):
                into = [theirs.mods[e] for _, e, d in ours.etypes if d == t]
                ours.self_fc[ti].weight.copy_(sum(m.fc_self.weight for m in into))
                ours.self_fc[ti].bias.copy_(sum(m.fc_self.bias for m in into))


def forward_backward_agree(model, ref, mfg, blocks) -> None:
    """Our model on the MFG and DGL's ``ref`` on DGL's blocks (and on the MFG's own DGL
    blocks): the same outputs and input gradients; the parameters' gradients are left for
    the caller to compare."""
    x_ours = {t: v.clone().requires_grad_() for t, v in mfg.feat.items()}
    x_ref = {t: v.clone().requires_grad_() for t, v in mfg.feat.items()}
    out, want = model(mfg, x_ours), ref(blocks, x_ref)
    assert out.shape == (mfg.output_nodes.numel(), CLASSES)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref(mfg.to_dgl(), mfg.feat), want, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * g).sum().backward()
    (want * g).sum().backward()
    for t in NTYPES:
        torch.testing.assert_close(x_ours[t].grad, x_ref[t].grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("aggregator", ["mean", "sum"])
@pytest.mark.parametrize("hidden", [3, 16])  # 3: project before aggregating (in > out)
def test_model_equals_dgl_heterographconv_forward_and_gradients(batch, aggregator, hidden):
    *_, blocks, sampled = batch
    mfg = HeteroMFG.of(sampled)
    dims = [WIDTHS, {t: hidden for t in NTYPES}, {t: CLASSES for t in NTYPES}]
    ref = DGLReference(dims, aggregator)
    model = build_hetero_model({
        "name": "rsage", "ntypes": NTYPES, "etypes": [list(e) for e in ETYPES],
        "predict_ntype": "paper", "in_feats": WIDTHS, "hidden": hidden,
        "num_classes": CLASSES, "num_layers": 2, "aggregator": aggregator})
    copy_from_reference(model, ref)
    forward_backward_agree(model, ref, mfg, blocks)
    for ours, theirs in zip(model.layers, ref.layers):
        for r, (_, e, _) in enumerate(ours.etypes):
            torch.testing.assert_close(ours.rel_fc[r].weight.grad,
                                       theirs.mods[e].fc_neigh.weight.grad, atol=1e-5, rtol=1e-5)
        for ti, t in enumerate(ours.ntypes):
            for _, e, d in ours.etypes:  # each relation's fc_self sees the sum's gradient
                if d == t:
                    m = theirs.mods[e]
                    torch.testing.assert_close(ours.self_fc[ti].weight.grad, m.fc_self.weight.grad,
                                               atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(ours.self_fc[ti].bias.grad, m.fc_self.bias.grad,
                                               atol=1e-5, rtol=1e-5)


def homogeneous_batch():
    dgl = import_dgl()
    gen = torch.Generator().manual_seed(3)
    n = 80
    graph = dgl.graph((torch.randint(0, n, (400,), generator=gen),
                       torch.randint(0, n, (400,), generator=gen)), num_nodes=n)
    feat = torch.randn(n, 7, generator=gen)
    dgl.seed(3)
    dst = torch.arange(0, n, 5)
    blocks = []
    for fanout in (3, 4):
        blk = dgl.to_block(dgl.sampling.sample_neighbors(graph, dst, fanout), dst)
        dst = blk.srcdata[dgl.NID]
        blocks.insert(0, blk)
    ids = blocks[0].srcdata[dgl.NID]
    layers = [Layer.homogeneous(b.num_src_nodes(), b.num_dst_nodes(),
                                *[t.long() for t in b.adj_tensors("csc")[:2]]) for b in blocks]
    sampled = SampledMFG.homogeneous(ids, layers, Features.frames(feat[ids]))
    sampled.check()
    return sampled, blocks


@pytest.mark.parametrize("hidden", [4, 16])
def test_homogeneous_mfg_equals_graphsage(hidden):
    dgl = import_dgl()
    sampled, blocks = homogeneous_batch()
    mfg = HeteroMFG.of(sampled)
    assert mfg.ntypes == [""] and mfg.seed_ntype == ""
    assert list(mfg[0].rels) == [("", "", "")]
    spec = hetero_spec(SimpleNamespace(ntypes=[], etypes=[], predict_ntype=""), in_feats=7,
                       hidden=hidden, num_classes=CLASSES, num_layers=2)
    assert spec["ntypes"] == [""] and spec["etypes"] == [["", "", ""]]
    model = build_hetero_model(spec)
    sage = GraphSAGE(7, hidden, CLASSES, 2, dropout=0.0)
    with torch.no_grad():
        for ours, theirs in zip(model.layers, sage.layers):
            theirs.fc_self.bias.copy_(torch.randn(theirs.fc_self.bias.shape))
            ours.self_fc[0].load_state_dict(theirs.fc_self.state_dict())
            ours.rel_fc[0].load_state_dict(theirs.fc_neigh.state_dict())
    x1 = mfg.feat[""].clone().requires_grad_()
    x2 = mfg.feat[""].clone().requires_grad_()
    out = model(mfg, {"": x1})
    want = sage([b for b in _homogeneous_view(sampled)], x2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(model.layers, sage.layers):
        torch.testing.assert_close(ours.rel_fc[0].weight.grad, theirs.fc_neigh.weight.grad,
                                   atol=1e-5, rtol=1e-5)
    # to_dgl names the one type DGL's way; its edges are DGL's
    for ours, ref in zip(mfg.to_dgl(), blocks):
        assert ours.canonical_etypes == [("_N", "_E", "_N")]
        assert edge_set(ours, ("_N", "_E", "_N")) == edge_set(ref, ref.canonical_etypes[0])
        assert torch.equal(ours.srcdata[NID], ref.srcdata[dgl.NID])


def _homogeneous_view(sampled):
    from common.mfg import MFG

    return MFG.of(sampled)


def test_model_learns_a_relational_toy_task():
    """Paper labels depend on the paper's own features and on its authors': the loss falls."""
    torch.manual_seed(0)
    graph, feat, _ = make_graph(seed=1)
    import_dgl()
    # label = argmax(own features @ A + mean of in-neighbour authors' features @ B)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(WIDTHS["paper"], CLASSES, generator=gen), torch.randn(
        WIDTHS["author"], CLASSES, generator=gen)
    src, dst = graph.edges(etype="writes")
    mean_auth = torch.zeros(NUM["paper"], WIDTHS["author"]).index_add_(0, dst, feat["author"][src])
    mean_auth /= torch.bincount(dst, minlength=NUM["paper"]).clamp(min=1).unsqueeze(1)
    label = (feat["paper"] @ a + 2 * mean_auth @ b).argmax(1)
    seeds = torch.arange(NUM["paper"])
    fanouts = [{e: -1 for _, e, _ in ETYPES}] * 2
    mfg = HeteroMFG.of(to_sampled(dgl_blocks(graph, seeds, fanouts), feat, label))
    model = build_hetero_model({
        "name": "rsage", "ntypes": NTYPES, "etypes": [list(e) for e in ETYPES],
        "predict_ntype": "paper", "in_feats": WIDTHS, "hidden": 32, "num_classes": CLASSES,
        "num_layers": 2, "dropout": 0.1})
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(mfg, mfg.feat), mfg.label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses
    model.eval()
    acc = (model(mfg, mfg.feat).argmax(1) == mfg.label).float().mean().item()
    assert acc > 0.9, acc


def test_a_type_without_relations_into_it_keeps_its_self_loop_state():
    """No relation leads into author: its layer-0 state is its self loop alone, and the
    relation out of it (writes) still counts in layer 1 (HeteroGraphConv would drop it)."""
    etypes = [e for e in ETYPES if e[1] != "written_by"]
    graph, feat, label = make_graph(seed=4, etypes=etypes)
    fanouts = [{e: 3 for _, e, _ in etypes}] * 2
    mfg = HeteroMFG.of(to_sampled(dgl_blocks(graph, torch.arange(0, 60, 2), fanouts),
                                  feat, label))
    model = RelGraphSAGE(NTYPES, etypes, WIDTHS, 8, CLASSES, 2, "paper").eval()
    h = model.layers[0](mfg[0], mfg.feat)
    nd = mfg[0].num_dst["author"]
    assert nd > 0 and mfg[1].num_edges(("author", "writes", "paper")) > 0
    torch.testing.assert_close(h["author"], model.layers[0].self_fc[0](mfg.feat["author"][:nd]))
    out = model(mfg, mfg.feat)
    with torch.no_grad():
        model.layers[1].rel_fc[etypes.index(("author", "writes", "paper"))].weight.zero_()
    assert not torch.allclose(model(mfg, mfg.feat), out)


def test_to_and_pin_memory_keep_everything(batch):
    *_, sampled = batch
    mfg = HeteroMFG.of(sampled)
    model = RelGraphSAGE(NTYPES, ETYPES, WIDTHS, 8, CLASSES, 2, "paper").eval()
    want = model(mfg, mfg.feat)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        views = [mfg.to(dev), to_device(mfg, dev)]  # the loader's copy: pageable first
        if dev == "cuda":
            views.append(mfg.pin_memory().to(dev, non_blocking=True))
            assert all(b.indptr.is_pinned() for hb in mfg.pin_memory() for b in hb.rels.values())
        for moved in views:
            assert moved is not mfg and moved.seed_ntype == "paper"
            assert moved.output_nodes.device.type == dev
            for hb, orig in zip(moved, mfg):
                assert hb.num_src == orig.num_src and hb.num_dst == orig.num_dst
                assert list(hb.rels) == list(orig.rels)
                for k, blk in hb.rels.items():
                    assert blk.device.type == dev
                    assert torch.equal(blk.indptr.cpu(), orig.rels[k].indptr)
                    assert torch.equal(blk.indices.cpu(), orig.rels[k].indices)
                for t in NTYPES:
                    assert torch.equal(hb.srcdata[t][NID].cpu(), orig.srcdata[t][NID])
            for t in NTYPES:
                assert torch.equal(moved.input_nodes[t].cpu(), mfg.input_nodes[t])
                assert torch.equal(moved.feat[t].cpu(), mfg.feat[t])
            torch.testing.assert_close(model.to(dev)(moved, moved.feat).cpu(), want,
                                       atol=1e-5, rtol=1e-5)
            model.cpu()


def test_spec_from_metadata_and_bad_specs():
    meta = SimpleNamespace(ntypes=NTYPES, etypes=[list(e) for e in ETYPES],
                           predict_ntype="paper")
    spec = hetero_spec(meta, in_feats=8, hidden=16, num_classes=CLASSES, num_layers=2)
    assert spec["in_feats"] == {t: 8 for t in NTYPES}
    assert spec == check_hetero_spec(spec)  # normalised specs are fixed points
    m1, m2 = build_hetero_model(spec), build_hetero_model(spec)
    m2.load_state_dict(m1.state_dict())  # same spec, same keys
    assert "layers.1.rel_fc.4.weight" in m1.state_dict()
    good = dict(spec)
    for bad, pattern in [
        ({"name": "sage"}, r"'name' must be one of \['rsage', 'hetero-sage'\]"),
        ({"heads": 2}, "unknown key"),
        ({"ntypes": []}, "'ntypes' must be"),
        ({"etypes": [["paper", "cites", "venue"]]}, "not in 'ntypes'"),
        ({"etypes": [list(ETYPES[0])] * 2}, "twice"),
        ({"predict_ntype": "venue"}, "'predict_ntype' must be"),
        ({"in_feats": {"paper": 3}}, "'in_feats' must be"),
        ({"in_feats": 0}, "'author' must be an integer"),
        ({"aggregator": "max"}, "'aggregator' must be"),
        ({"dropout": 1.0}, "'dropout' must be"),
        ({"num_layers": 0}, "'num_layers' must be"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            check_hetero_spec({**good, **bad})


# --- hetero-sage: DGL's HeteroGraphConv({rel: SAGEConv((d_s, d_t), out, "mean")}, "sum")


def from_dgl_state(ref: nn.Module, etypes) -> dict:
    """DGL's state dict with ``mods.{etype}`` renamed to HeteroSAGE's ``mods.{position}``."""
    pos = {e: str(r) for r, (_, e, _) in enumerate(etypes)}
    out = {}
    for k, v in ref.state_dict().items():
        parts = k.split(".")
        parts[3] = pos[parts[3]]  # layers.{i}.mods.{etype}.fc_*.{weight,bias}
        out[".".join(parts)] = v
    return out


def sparse_batch(etypes, seed: int = 4):
    """Blocks where one relation has no sampled edge in the input layer (fanout 0) and
    some destinations have no in-edges of a relation (fanout 1 on a sparse random graph)."""
    graph, feat, label = make_graph(seed=seed, etypes=etypes)
    fanouts = [{e: (0 if e == "topic_of" else 1) for _, e, _ in etypes},
               {e: 2 for _, e, _ in etypes}]
    blocks = dgl_blocks(graph, torch.arange(0, NUM["paper"], 2), fanouts, seed=seed)
    return blocks, HeteroMFG.of(to_sampled(blocks, feat, label))


@pytest.mark.parametrize("drop", [None, "written_by"])  # written_by: nothing leads into author
@pytest.mark.parametrize("hidden", [3, 16])  # 3: project before aggregating (in > out)
def test_hetero_sage_is_dgl_heterographconv_init_forward_and_gradients(hidden, drop):
    etypes = [e for e in ETYPES if e[1] != drop]
    blocks, mfg = sparse_batch(etypes)
    # the batch has the cases DGL treats specially
    assert mfg[0].num_edges(("field", "topic_of", "paper")) == 0
    assert any(bool((b.in_degrees() == 0).any()) for hb in mfg for b in hb.rels.values()
               if b.num_edges())
    dims = [WIDTHS, {t: hidden for t in NTYPES}, {t: CLASSES for t in NTYPES}]
    torch.manual_seed(11)
    ref = DGLReference(dims, "mean", etypes)
    torch.manual_seed(11)
    spec = hetero_spec(SimpleNamespace(ntypes=NTYPES, etypes=etypes, predict_ntype="paper"),
                       WIDTHS, hidden, CLASSES, 2, name="hetero-sage")
    model = build_hetero_model(spec)
    assert isinstance(model, HeteroSAGE) and model.name == "hetero-sage"
    # the same parameters, drawn in the same order: DGL's init exactly (bias included)
    want_sd = from_dgl_state(ref, etypes)
    assert sorted(model.state_dict()) == sorted(want_sd)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want_sd[k]), k
    for check in ("init", "random"):
        if check == "random":  # any weights, copied over by the renamed state dict
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in ref.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            model.load_state_dict(from_dgl_state(ref, etypes))
        model.zero_grad()
        ref.zero_grad()
        forward_backward_agree(model, ref, mfg, blocks)
        grads = {k: p.grad for k, p in model.named_parameters()}
        ref_grads = dict(zip(from_dgl_state(ref, etypes),
                             (p.grad for p in ref.state_dict(keep_vars=True).values())))
        params = dict(model.named_parameters())
        for k, gv in ref_grads.items():  # None: unused (e.g. fc_neigh of a relation DGL
            # skipped; DGL's zero-edge relation multiplies zeros: a zero gradient)
            zero = torch.zeros_like(params[k])
            torch.testing.assert_close(zero if grads[k] is None else grads[k],
                                       zero if gv is None else gv, atol=1e-5, rtol=1e-5)
    if drop:  # HeteroGraphConv gives author no output: writes is skipped in layer 1
        h = model.layers[0](mfg[0], mfg.feat)
        assert "author" not in h and set(h) == {"paper", "field"}
        assert model.layers[1].mods[etypes.index(("author", "writes", "paper"))] \
            .fc_neigh.weight.grad is None


def test_hetero_sage_zero_edge_relation_adds_its_self_term():
    """DGL 2.1's HeteroGraphConv runs a relation with no sampled edges: its SAGEConv's mean
    is 0, fc_self(h_dst) + bias still counts. Ours: the same (the output changes with that
    relation's fc_self)."""
    blocks, mfg = sparse_batch(ETYPES)
    model = HeteroSAGE(NTYPES, ETYPES, WIDTHS, 8, CLASSES, 2, "paper").eval()
    rel = ETYPES.index(("field", "topic_of", "paper"))
    h = model.layers[0](mfg[0], mfg.feat)
    with torch.no_grad():
        model.layers[0].mods[rel].fc_self.bias.add_(1.0)
    h2 = model.layers[0](mfg[0], mfg.feat)
    torch.testing.assert_close(h2["paper"] - h["paper"], torch.ones_like(h["paper"]))
    torch.testing.assert_close(h2["author"], h["author"])


def test_hetero_sage_spec_state_dict_and_homogeneous_case(tmp_path):
    from common.config import HETERO_MODEL_NAMES, TRAINER_MODELS
    from trainer_client.hetero_model import HETERO_MODELS
    from trainer_client.models import build_model, check_spec

    assert tuple(HETERO_MODELS) == HETERO_MODEL_NAMES and "hetero-sage" in TRAINER_MODELS
    meta = SimpleNamespace(ntypes=NTYPES, etypes=[list(e) for e in ETYPES],
                           predict_ntype="paper")
    spec = hetero_spec(meta, in_feats=WIDTHS, hidden=16, num_classes=CLASSES, num_layers=2,
                       dropout=0.2, name="hetero-sage")
    assert spec["name"] == "hetero-sage" and check_spec(spec) == spec
    m1 = build_model(spec)
    assert isinstance(m1, HeteroSAGE) and m1.num_layers == 2
    sd = m1.state_dict()
    assert "layers.1.mods.4.fc_neigh.weight" in sd and "layers.0.mods.0.fc_self.bias" in sd
    assert not any(".fc_neigh.bias" in k for k in sd)  # SAGEConv's fc_neigh has no bias
    assert sd["layers.0.mods.1.fc_self.weight"].shape == (16, WIDTHS["paper"])  # d_dst
    assert sd["layers.0.mods.1.fc_neigh.weight"].shape == (16, WIDTHS["author"])  # d_src
    # the round trip a checkpoint makes: spec + state dict -> the same outputs
    torch.save({"spec": spec, "model": sd}, tmp_path / "m.pt")
    saved = torch.load(tmp_path / "m.pt")
    m2 = build_model(saved["spec"])
    m2.load_state_dict(saved["model"])
    graph, feat, label = make_graph()
    mfg = HeteroMFG.of(to_sampled(dgl_blocks(graph, torch.arange(0, 60, 3), FANOUTS),
                                  feat, label))
    torch.testing.assert_close(m2.eval()(mfg, mfg.feat), m1.eval()(mfg, mfg.feat))
    # rsage's parameters are other ones: a checkpoint of one does not load into the other
    with pytest.raises(RuntimeError, match="Missing key"):
        build_model({**spec, "name": "rsage"}).load_state_dict(sd)
    # one node type, one relation: SAGEConv, i.e. GraphSAGE
    sampled, _ = homogeneous_batch()
    hmfg = HeteroMFG.of(sampled)
    model = build_hetero_model(hetero_spec(SimpleNamespace(ntypes=[], etypes=[],
                                                           predict_ntype=""), 7, 16, CLASSES,
                                           2, name="hetero-sage"))
    sage = GraphSAGE(7, 16, CLASSES, 2, dropout=0.0)
    with torch.no_grad():
        for ours, theirs in zip(model.layers, sage.layers):
            ours.mods[0].fc_self.load_state_dict(theirs.fc_self.state_dict())
            ours.mods[0].fc_neigh.load_state_dict(theirs.fc_neigh.state_dict())
    torch.testing.assert_close(model(hmfg, hmfg.feat), sage(_homogeneous_view(sampled),
                                                             hmfg.feat[""]),
                               atol=1e-5, rtol=1e-5)


def test_hetero_sage_refused_by_mfgserve_infer_only():
    """mfgserve-infer does not export typed models yet; training's --eval full runs them."""
    from common.config import TrainerConfig
    from trainer_client.inference import refuse_typed

    info = SimpleNamespace(dataset="d", ntypes=[])
    with pytest.raises(ConfigError, match=r"typed model \(hetero-sage\)"):
        refuse_typed("hetero-sage", info)
    TrainerConfig(cluster="/c", model="hetero-sage", eval="full").validate()


def _typed_run(model, mfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A typed model's logits and every parameter's gradient of a fixed loss."""
    model.zero_grad()
    x = {t: f.clone() for t, f in mfg.feat.items()}
    out = model(mfg, x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                          if p.grad is not None}


@pytest.mark.parametrize("name", ["rsage", "hetero-sage"])
def test_typed_layers_either_order_and_bfloat16_operands(batch, name, monkeypatch):
    """A destination type's state is one sum of products (``model.linear_sum``): its self
    loop and every relation aggregated first, plus the relations projected first where
    ``project_first`` finds that cheaper. Forced to aggregate every relation first, and to
    project every one first, the logits and all gradients are the same as the mixed default
    (float32 rounding only). At ``medium`` (both routes forced here, on any CPU) each sum is
    one product of the terms packed side by side with bucketed rows (``_LinearSumPacked``):
    "cast" packs bfloat16, so float32's outputs and gradients within bfloat16's error;
    "onednn" packs float32 (torch's medium rounds inside the product, and this process runs
    at ``highest``), so float32's results; all float32, the buckets' rows dropped."""
    import trainer_client.hetero_model as hm
    import trainer_client.model as model_mod

    # float32 through torch's mm (--cpu-gemm mkl) on any CPU, as the "onednn" route's packed
    # float32 product is: its 1e-5 comparison is with the same library's sums, not oneDNN's
    monkeypatch.setattr(model_mod, "_CPU_GEMM", "mkl")
    *_, sampled = batch
    mfg = HeteroMFG.of(sampled)
    torch.manual_seed(2)
    model = build_hetero_model(hetero_spec(
        SimpleNamespace(ntypes=NTYPES, etypes=ETYPES, predict_ntype="paper"), WIDTHS, 3,
        CLASSES, 2, name=name))
    chosen = []
    real_pf = hm.project_first
    monkeypatch.setattr(hm, "project_first", lambda *a: chosen.append(real_pf(*a)) or chosen[-1])
    want_out, want = _typed_run(model, mfg)
    assert True in chosen and False in chosen, chosen  # the batch takes both orders
    for forced in (True, False):
        monkeypatch.setattr(hm, "project_first", lambda *a, f=forced: f)
        out, got = _typed_run(model, mfg)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        assert sorted(got) == sorted(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(hm, "project_first", real_pf)

    def rel_err(a, b):
        return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()

    real = model_mod._LinearSumPacked.forward
    for route in ("cast", "onednn"):
        calls = []
        monkeypatch.setattr(model_mod._LinearSumPacked, "forward", staticmethod(
            lambda ctx, bias, padded, dtype, *xw, calls=calls:
            calls.append((padded, xw[0].shape[0], dtype)) or real(ctx, bias, padded, dtype, *xw)))
        monkeypatch.setattr(model_mod, "bf16_products",
                            lambda device, r=route: r if device.type == "cpu" else None)
        out, got = _typed_run(model, mfg)
        dtype = torch.bfloat16 if route == "cast" else torch.float32
        assert calls and all(d == dtype and p >= max(r, 64) for p, r, d in calls), calls
        assert any(p > r for p, r, _ in calls), calls  # rows bucketed
        assert out.dtype == torch.float32 and out.shape == want_out.shape
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == torch.float32
            if route == "onednn":
                torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)
            else:
                assert rel_err(got[k], want[k]) < 0.1, (k, rel_err(got[k], want[k]))
        if route == "onednn":
            torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        else:
            assert 0 < rel_err(out, want_out) < 2e-2
