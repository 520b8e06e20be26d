"""An ogbn-mag-shaped heterogeneous graph, written in OGB's heterogeneous raw layout.

``partition-ogbn --dataset synthetic-mag --num-nodes N --raw-out DIR`` (N = number of
papers) writes, exactly as ogbn-mag ships it (``ogb/io/read_graph_raw.py``
``read_csv_heterograph_raw`` and ``ogb/nodeproppred/dataset.py``)::

    DIR/meta.json                               ogb's meta_dict (ogbn-mag's row, own name)
    DIR/RELEASE_v2.txt
    DIR/raw/num-node-dict.csv.gz                header: the node types; one row of counts
    DIR/raw/triplet-type-list.csv.gz            one "src,relation,dst" line per relation
    DIR/raw/nodetype-has-label.csv.gz           header: the node types; True for paper
    DIR/raw/relations/<src>___<rel>___<dst>/edge.csv.gz          "src_id,dst_id" per edge
    DIR/raw/relations/<src>___<rel>___<dst>/num-edge-list.csv.gz the edge count
    DIR/raw/relations/<src>___<rel>___<dst>/edge_reltype.csv.gz  relation id per edge
    DIR/raw/node-feat/paper/node-feat.csv.gz    float features (paper only)
    DIR/raw/node-feat/paper/node_year.csv.gz    publication year
    DIR/raw/node-label/paper/node-label.csv.gz  class per paper
    DIR/split/time/nodetype-has-split.csv.gz    header: the node types; True for paper
    DIR/split/time/paper/{train,valid,test}.csv.gz  paper ids

Four node types (author, field_of_study, institution, paper) and ogbn-mag's four relations
(author affiliated_with institution, author writes paper, paper cites paper, paper
has_topic field_of_study). Sizes follow ogbn-mag's ratios per paper: 1.54 authors, 0.012
institutions, 0.081 fields of study; 9.7 writes, 7.4 cites and 10.2 has_topic edges per
paper and 0.92 affiliations per author, with overdispersed (heavy-tailed) counts and
preferential (Pareto-weighted) choice of authors, institutions and fields.

Labels are learnable and need the relations: every author, field and institution has a
latent class; a paper's label ``y`` picks each of its authors, fields and cited papers from
class ``y`` with probability ``homophily`` (0.6; else from any class), an author's
institution from the author's class with probability 0.7. A paper's own features are a
class centroid plus noise, but the centroid is ``y``'s only with probability
``feat_signal`` (0.5; else a random class's), so features alone get about
``feat_signal + (1 - feat_signal) / C`` right and the authors / topics carry the rest
(also through ``--derive-features mean``, which gives an author the mean of its papers).
The split is by time as ogbn-mag's: papers get a random publication order; the oldest
``train_frac`` are train (years up to 2017), the next ``valid_frac`` valid (2018), the
rest test (2019); a paper cites only older papers, so ``cites`` is a directed relation.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from partition.graph_data import DatasetError
from partition.synthetic import _write_float_csv, _write_int_csv

__all__ = ["MagGraph", "generate_mag", "write_mag_raw", "NTYPES", "ETYPES", "mag_meta"]

NTYPES = ("author", "field_of_study", "institution", "paper")
ETYPES = (("author", "affiliated_with", "institution"), ("author", "writes", "paper"),
          ("paper", "cites", "paper"), ("paper", "has_topic", "field_of_study"))
# per paper, from ogbn-mag (736,389 papers)
_NODES_PER_PAPER = {"author": 1134649 / 736389, "institution": 8740 / 736389,
                    "field_of_study": 59965 / 736389}
_WRITES, _CITES, _TOPICS, _AFFIL_PER_AUTHOR = 9.7, 7.4, 10.2, 0.92
_SPLIT = "time"


@dataclass
class MagGraph:
    """A generated mag-shaped graph in per-type ids (what the raw files hold)."""

    name: str
    num_nodes: dict  # type -> count
    edges: dict  # (src, rel, dst) -> (src ids, dst ids), int64
    feat: np.ndarray  # float32 [papers, D]
    label: np.ndarray  # int64 [papers]
    year: np.ndarray  # int64 [papers]
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    num_classes: int


def _class_prior(c: int) -> np.ndarray:
    p = (np.arange(c) + 1.0) ** -0.5
    return p / p.sum()


def _counts(rng, n: int, mean: float) -> np.ndarray:
    """Overdispersed per-item counts with the given mean (gamma-Poisson, at least 0)."""
    lam = rng.gamma(shape=1.5, scale=mean / 1.5, size=n)
    return rng.poisson(lam).astype(np.int64)


def _pick(rng, want: np.ndarray, node_class: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """For each wanted class, a node of that class drawn proportional to ``weight`` (any
    node when the class has none)."""
    out = np.empty(want.size, dtype=np.int64)
    order = np.argsort(node_class, kind="stable")
    bounds = np.searchsorted(node_class[order], np.arange(int(node_class.max()) + 2))
    all_cdf = np.cumsum(weight)
    for c in np.unique(want):
        sel = np.flatnonzero(want == c)
        lo, hi = (bounds[c], bounds[c + 1]) if c + 1 < bounds.size else (0, 0)
        if hi > lo:
            members = order[lo:hi]
            cdf = np.cumsum(weight[members])
            idx = np.searchsorted(cdf, rng.random(sel.size) * cdf[-1], side="right")
            out[sel] = members[np.minimum(idx, members.size - 1)]
        else:
            idx = np.searchsorted(all_cdf, rng.random(sel.size) * all_cdf[-1], side="right")
            out[sel] = np.minimum(idx, weight.size - 1)
    return out


def _mixed_class(rng, own: np.ndarray, homophily: float, prior: np.ndarray) -> np.ndarray:
    """``own`` with probability ``homophily``, else a class drawn from ``prior``."""
    other = rng.choice(prior.size, size=own.size, p=prior)
    return np.where(rng.random(own.size) < homophily, own, other)


def _dedupe(src: np.ndarray, dst: np.ndarray, n_dst: int) -> tuple[np.ndarray, np.ndarray]:
    keys = np.unique(src * n_dst + dst)
    return keys // n_dst, keys % n_dst


def _cites(rng, label: np.ndarray, rank: np.ndarray, homophily: float,
           prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each paper cites older papers (lower ``rank``), of its own class w.p. ``homophily``."""
    n = label.size
    per = _counts(rng, n, _CITES)
    src = np.repeat(np.arange(n, dtype=np.int64), per)
    want = _mixed_class(rng, label[src], homophily, prior)
    dst = np.full(src.size, -1, dtype=np.int64)
    by_time = np.argsort(rank)  # paper ids, oldest first
    for c in np.unique(want):
        members = by_time[label[by_time] == c]  # class-c papers, oldest first
        sel = np.flatnonzero(want == c)
        older = np.searchsorted(rank[members], rank[src[sel]])  # class-c papers older
        ok = older > 0
        # skewed towards the oldest (much-cited) papers
        pos = (rng.random(int(ok.sum())) ** 2 * older[ok]).astype(np.int64)
        dst[sel[ok]] = members[pos]
    keep = dst >= 0
    return _dedupe(src[keep], dst[keep], n)


def generate_mag(num_papers: int, *, feat_dim: int = 128, num_classes: int = 16,
                 train_frac: float = 0.85, valid_frac: float = 0.09, homophily: float = 0.6,
                 feat_signal: float = 0.5, feat_noise: float = 1.0, seed: int = 0,
                 name: str = "synthetic-mag", progress: bool = False) -> MagGraph:
    """Generate the graph described in the module docstring (``num_papers`` papers)."""
    if num_papers < 2:
        raise DatasetError(f"--num-nodes {num_papers}: a mag-shaped graph needs >= 2 papers")
    if feat_dim < 1 or num_classes < 1:
        raise DatasetError(f"feat_dim={feat_dim} and num_classes={num_classes} must be >= 1")
    if not (0 <= train_frac and 0 <= valid_frac and train_frac + valid_frac < 1):
        raise DatasetError(f"train_frac {train_frac:g} + valid_frac {valid_frac:g} must be "
                           "below 1 (the test split is the rest)")
    rng = np.random.default_rng(seed)
    c = int(num_classes)
    prior = _class_prior(c)
    n = {"paper": int(num_papers)}
    for t, r in _NODES_PER_PAPER.items():
        n[t] = max(2, int(round(r * num_papers)))
    steps = tqdm(total=6, desc="generate synthetic-mag", file=sys.stderr, disable=not progress)
    label = rng.choice(c, size=n["paper"], p=prior).astype(np.int64)
    cls = {t: rng.choice(c, size=n[t], p=prior).astype(np.int64)
           for t in ("author", "institution", "field_of_study")}
    weight = {t: rng.pareto(1.5, size=n[t]) + 1.0 for t in cls}
    edges = {}
    # author writes paper: authors of the paper's class w.p. homophily
    dst = np.repeat(np.arange(n["paper"], dtype=np.int64), 1 + _counts(rng, n["paper"],
                                                                        _WRITES - 1))
    src = _pick(rng, _mixed_class(rng, label[dst], homophily, prior), cls["author"],
                weight["author"])
    edges[ETYPES[1]] = _dedupe(src, dst, n["paper"])
    steps.update()
    # paper has_topic field_of_study
    src = np.repeat(np.arange(n["paper"], dtype=np.int64), 1 + _counts(rng, n["paper"],
                                                                        _TOPICS - 1))
    dst = _pick(rng, _mixed_class(rng, label[src], homophily, prior), cls["field_of_study"],
                weight["field_of_study"])
    edges[ETYPES[3]] = _dedupe(src, dst, n["field_of_study"])
    steps.update()
    # author affiliated_with institution: of the author's class w.p. 0.7
    src = np.repeat(np.arange(n["author"], dtype=np.int64),
                    _counts(rng, n["author"], _AFFIL_PER_AUTHOR))
    dst = _pick(rng, _mixed_class(rng, cls["author"][src], 0.7, prior), cls["institution"],
                weight["institution"])
    edges[ETYPES[0]] = _dedupe(src, dst, n["institution"])
    steps.update()
    # time: a random publication order; paper cites paper (older ones only)
    rank = rng.permutation(n["paper"]).astype(np.int64)
    edges[ETYPES[2]] = _cites(rng, label, rank, homophily, prior)
    steps.update()
    # features: the label's centroid w.p. feat_signal, else a random class's
    centroids = rng.standard_normal((c, feat_dim)).astype(np.float32)
    shown = _mixed_class(rng, label, feat_signal, np.full(c, 1.0 / c))
    feat = centroids[shown] + np.float32(feat_noise) * rng.standard_normal(
        (n["paper"], feat_dim), dtype=np.float32)
    steps.update()
    n_train = int(round(train_frac * n["paper"]))
    n_valid = min(n["paper"] - n_train, int(round(valid_frac * n["paper"])))
    year = np.where(rank < n_train, 2010 + (rank * 8) // max(1, n_train),
                    np.where(rank < n_train + n_valid, 2018, 2019)).astype(np.int64)
    train = np.flatnonzero(rank < n_train).astype(np.int64)
    valid = np.flatnonzero((rank >= n_train) & (rank < n_train + n_valid)).astype(np.int64)
    test = np.flatnonzero(rank >= n_train + n_valid).astype(np.int64)
    steps.update()
    steps.close()
    return MagGraph(name=name, num_nodes=n, edges=edges, feat=feat.astype(np.float32),
                    label=label, year=year, train=train, valid=valid, test=test,
                    num_classes=c)


def mag_meta(name: str, num_classes: int) -> dict:
    """ogb's meta_dict for a mag-shaped dataset: ogbn-mag's master.csv row, own name."""
    return {
        "name": name, "num tasks": 1, "num classes": int(num_classes), "eval metric": "acc",
        "task type": "multiclass classification", "download_name": name, "version": 2,
        "url": "", "add_inverse_edge": "False", "has_node_attr": "True",
        "has_edge_attr": "False", "split": _SPLIT, "additional node files": "node_year",
        "additional edge files": "edge_reltype", "is hetero": "True", "binary": "False",
    }


def _write_header_row(path: Path, header: list[str], row: list) -> None:
    import gzip

    with gzip.open(path, "wt") as f:
        f.write(",".join(header) + "\n" + ",".join(str(v) for v in row) + "\n")


def write_mag_raw(g: MagGraph, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Write ``g`` in OGB's heterogeneous raw layout under ``out_dir`` (see module
    docstring); existing raw/ and split/ are replaced."""
    out = Path(out_dir)
    raw, split = out / "raw", out / "split" / _SPLIT
    for p in (raw, out / "split"):
        if p.exists():
            shutil.rmtree(p)
    raw.mkdir(parents=True)
    split.mkdir(parents=True)
    types = list(NTYPES)
    _write_header_row(raw / "num-node-dict.csv.gz", types, [g.num_nodes[t] for t in types])
    _write_header_row(raw / "nodetype-has-label.csv.gz", types,
                      [t == "paper" for t in types])
    _write_header_row(split / "nodetype-has-split.csv.gz", types,
                      [t == "paper" for t in types])
    import gzip

    with gzip.open(raw / "triplet-type-list.csv.gz", "wt") as f:
        f.write("".join(",".join(t) + "\n" for t in ETYPES))
    for rel_id, trip in enumerate(tqdm(ETYPES, desc=f"write OGB hetero raw {out}",
                                       file=sys.stderr, disable=not progress)):
        d = raw / "relations" / "___".join(trip)
        d.mkdir(parents=True)
        src, dst = g.edges[trip]
        _write_int_csv(d / "edge.csv.gz", [src, dst])
        _write_int_csv(d / "num-edge-list.csv.gz", [np.array([src.size], dtype=np.int64)])
        _write_int_csv(d / "edge_reltype.csv.gz", [np.full(src.size, rel_id, dtype=np.int64)])
    fdir = raw / "node-feat" / "paper"
    fdir.mkdir(parents=True)
    _write_float_csv(fdir / "node-feat.csv.gz", g.feat)
    _write_int_csv(fdir / "node_year.csv.gz", [g.year])
    ldir = raw / "node-label" / "paper"
    ldir.mkdir(parents=True)
    _write_int_csv(ldir / "node-label.csv.gz", [g.label])
    (split / "paper").mkdir()
    for s in ("train", "valid", "test"):
        _write_int_csv(split / "paper" / f"{s}.csv.gz", [getattr(g, s)])
    (out / "RELEASE_v2.txt").write_text("v2")
    (out / "meta.json").write_text(json.dumps(mag_meta(g.name, g.num_classes), indent=1))
    return out
