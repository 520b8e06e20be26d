"""A synthetic multi-label dataset shaped like ogbn-proteins, written in OGB's raw csv layout.

ogbn-proteins (ogb's ``master.csv``): an undirected graph (``add_inverse_edge`` True) with
no node features, 8-dim edge features (association scores in (0, 1]), 112 binary tasks per
node (``binary classification``, eval metric ``rocauc``), an additional node file
``node_species`` (the NCBI taxonomy id of each protein's species) and the split
``species`` (train / valid / test nodes are proteins of different species). This module
writes the same files:

* ``raw/edge.csv.gz`` (each undirected edge once), ``raw/edge-feat.csv.gz`` (one row of
  ``edge_feat_dim`` floats per edge), ``raw/node-label.csv.gz`` (``num_tasks`` columns of
  0 / 1), ``raw/node_species.csv.gz`` (one integer per node), ``raw/num-node-list.csv.gz``,
  ``raw/num-edge-list.csv.gz``;
* ``split/species/{train,valid,test}.csv.gz``; ``RELEASE_v1.txt``; ``meta.json`` with ogb's
  meta_dict keys (those of ogbn-proteins, ``num tasks`` adjusted) plus ``"name"``.

How the data is made (everything from one seeded generator):

1. The graph: :func:`partition.synthetic.generate` (power-law degrees, ``num_communities``
   homophilous communities); its node "features" become a latent vector ``z_i`` per node
   (community centroid + noise), used only to make the edge features below and then
   dropped (the dataset has no node features, like ogbn-proteins).
2. Edge features: for an undirected edge ``{u, v}``, ``sigmoid(A (z_u + z_v) / 2 + 0.5 eps)``
   per dimension (``A`` a random ``dim x dim`` matrix), rounded to 3 decimals and clipped to
   [0.001, 1]; each entry is "absent" (0.001, the floor ogbn-proteins uses) with probability
   0.3. Both directions of the edge carry the same row (ogb duplicates it).
3. Labels: ``h_i`` = the mean of node i's incident edge features (what ``partition-ogbn
   --edge-feat-to-node mean`` derives; zeros for an isolated node); per task t a random
   projection ``p_it = w_t . h_i``, standardised; the score is ``(p_it + mean over i's
   neighbours of p_jt) / 2 + label_noise * eps`` and task t is positive on the top
   ``r_t`` fraction of scores, ``r_t ~ U(0.05, 0.5)``. So labels are learnable from the
   edge features of a node and of its neighbours (a GNN over the derived node features gets
   a ROC-AUC well above 0.5), never perfectly (the noise).
4. Species: 8 taxonomy ids (those of ogbn-proteins); a random 65 % of the nodes belong to six
   "training" species, 16 % to a validation species and the rest to a test species; the
   ``species`` split is exactly that (as ogbn-proteins' split is by species).
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partition.graph_data import DatasetError

__all__ = ["ProteinsData", "generate_proteins", "write_proteins_raw", "SPECIES",
           "DEFAULT_NUM_TASKS", "DEFAULT_EDGE_FEAT_DIM"]

DEFAULT_NUM_TASKS = 112  # ogbn-proteins: ogb's Evaluator('ogbn-proteins') expects 112
DEFAULT_EDGE_FEAT_DIM = 8
DEFAULT_AVG_DEGREE = 50.0
SPECIES = (3702, 4932, 6239, 7227, 7955, 9606, 10090, 511145)  # ogbn-proteins' NCBI ids
_TRAIN_SPECIES, _VALID_SPECIES, _TEST_SPECIES = SPECIES[:6], SPECIES[6], SPECIES[7]
_TRAIN_FRAC, _VALID_FRAC = 0.65, 0.16
SPLIT_NAME = "species"
_ABSENT = 0.001


@dataclass
class ProteinsData:
    """A proteins-shaped dataset: ``src`` / ``dst`` hold each undirected edge once (the rows of
    ``raw/edge.csv.gz``), ``edge_feat`` one row per such edge, ``label`` float32
    ``[num_nodes, num_tasks]`` (0 / 1), ``species`` int64 taxonomy ids, splits sorted."""

    name: str
    num_nodes: int
    src: np.ndarray
    dst: np.ndarray
    edge_feat: np.ndarray
    label: np.ndarray
    species: np.ndarray
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray

    @property
    def num_tasks(self) -> int:
        return int(self.label.shape[1])


def _check(num_nodes, avg_degree, num_tasks, edge_feat_dim, label_noise) -> None:
    problems = []
    if int(num_nodes) < 8:
        problems.append(f"num_nodes={num_nodes} must be >= 8 (one node per species at least)")
    if not avg_degree >= 0:
        problems.append(f"avg_degree={avg_degree} must be >= 0")
    if int(num_tasks) < 1:
        problems.append(f"num_tasks={num_tasks} must be >= 1")
    if int(edge_feat_dim) < 1:
        problems.append(f"edge_feat_dim={edge_feat_dim} must be >= 1")
    if not label_noise >= 0:
        problems.append(f"label_noise={label_noise} must be >= 0")
    if problems:
        raise DatasetError("synthetic-proteins: " + "; ".join(problems))


def mean_incident(src: np.ndarray, dst: np.ndarray, feat: np.ndarray, n: int,
                  reduce: str = "mean") -> np.ndarray:
    """Per node, the sum or mean of the rows of ``feat`` (one per edge) over the edges whose
    ``dst`` is that node (``float32 [n, D]``; zeros where a node has no such edge)."""
    out = np.zeros((n, feat.shape[1]), dtype=np.float64)
    for k in range(feat.shape[1]):
        out[:, k] = np.bincount(dst, weights=feat[:, k], minlength=n)
    if reduce == "mean":
        deg = np.bincount(dst, minlength=n).astype(np.float64)
        out /= np.maximum(deg, 1.0)[:, None]
    return out.astype(np.float32)


def generate_proteins(num_nodes: int, avg_degree: float = DEFAULT_AVG_DEGREE,
                      num_tasks: int = DEFAULT_NUM_TASKS, seed: int = 0, *,
                      edge_feat_dim: int = DEFAULT_EDGE_FEAT_DIM, num_communities: int = 32,
                      homophily: float = 0.8, label_noise: float = 0.5,
                      progress: bool = False, name: str | None = None) -> ProteinsData:
    """Generate a proteins-shaped dataset (see the module docstring); deterministic."""
    from scipy import sparse

    from partition.synthetic import generate

    _check(num_nodes, avg_degree, num_tasks, edge_feat_dim, label_noise)
    n, t, d = int(num_nodes), int(num_tasks), int(edge_feat_dim)
    g = generate(n, avg_degree=avg_degree, feat_dim=d, num_classes=num_communities,
                 seed=seed, homophily=homophily, feat_noise=1.0, progress=progress)
    z = g.feat
    rng = np.random.default_rng([seed, 11])
    src, dst = g.src[0::2].copy(), g.dst[0::2].copy()  # each undirected edge once
    a = rng.standard_normal((d, d)).astype(np.float32) / np.float32(np.sqrt(d))
    x = ((z[src] + z[dst]) * np.float32(0.5)) @ a
    x += np.float32(0.5) * rng.standard_normal(x.shape, dtype=np.float32)
    ef = 1.0 / (1.0 + np.exp(-x))
    ef = np.clip(np.round(ef, 3), _ABSENT, 1.0)
    ef[rng.random(ef.shape) < 0.3] = _ABSENT
    ef = ef.astype(np.float32)
    del x, z
    # node representation = mean incident edge feature (both directions of every edge)
    both_src = np.concatenate([src, dst])
    both_dst = np.concatenate([dst, src])
    h = mean_incident(both_src, both_dst, np.concatenate([ef, ef]), n).astype(np.float64)
    w = rng.standard_normal((d, t))
    p = h @ w
    p -= p.mean(axis=0)
    p /= np.maximum(p.std(axis=0), 1e-12)
    adj = sparse.csr_matrix((np.ones(both_src.shape[0]), (both_dst, both_src)), shape=(n, n))
    deg = np.asarray(adj.sum(axis=1)).ravel()
    m = (adj @ p) / np.maximum(deg, 1.0)[:, None]
    score = 0.5 * (p + m) + label_noise * rng.standard_normal((n, t))
    rate = rng.uniform(0.05, 0.5, size=t)
    thresh = np.array([np.quantile(score[:, k], 1.0 - rate[k]) for k in range(t)])
    label = (score > thresh).astype(np.float32)
    # species and the species split
    perm = rng.permutation(n)
    n_train = int(round(_TRAIN_FRAC * n))
    n_valid = max(1, int(round(_VALID_FRAC * n)))
    n_train = min(n_train, n - n_valid - 1)
    species = np.empty(n, dtype=np.int64)
    train, valid, test = perm[:n_train], perm[n_train:n_train + n_valid], perm[n_train + n_valid:]
    species[train] = np.asarray(_TRAIN_SPECIES)[rng.integers(0, len(_TRAIN_SPECIES),
                                                              train.shape[0])]
    species[valid] = _VALID_SPECIES
    species[test] = _TEST_SPECIES
    return ProteinsData(name=name or f"synthetic-proteins-{n}", num_nodes=n, src=src, dst=dst,
                        edge_feat=ef, label=label, species=species,
                        train=np.sort(train).astype(np.int64),
                        valid=np.sort(valid).astype(np.int64),
                        test=np.sort(test).astype(np.int64))


def _write_table(path: Path, arr: np.ndarray, float_format: str | None = None) -> None:
    """Rows of ``arr`` (2-D) as comma-separated lines in a gzip file, no header."""
    import pandas as pd

    rows = 1 << 15
    with gzip.open(path, "wt", compresslevel=3, newline="") as f:
        for s in range(0, arr.shape[0], rows):
            pd.DataFrame(arr[s:s + rows]).to_csv(f, header=False, index=False,
                                                  float_format=float_format,
                                                  lineterminator="\n")


def proteins_meta(name: str, num_tasks: int) -> dict:
    """ogbn-proteins' meta_dict (ogb's master.csv) with ``num tasks`` = ``num_tasks``."""
    return {
        "name": name,
        "num tasks": int(num_tasks),
        "num classes": 2,
        "eval metric": "rocauc",
        "task type": "binary classification",
        "download_name": name,
        "version": 1,
        "url": "",
        "add_inverse_edge": "True",
        "has_node_attr": "False",
        "has_edge_attr": "True",
        "split": SPLIT_NAME,
        "additional node files": "node_species",
        "additional edge files": "None",
        "is hetero": "False",
        "binary": "False",
    }


def write_proteins_raw(data: ProteinsData, out_dir: str | Path) -> Path:
    """Write ``data`` in ogbn-proteins' raw layout under ``out_dir`` (see the module
    docstring); an existing ``raw/`` and ``split/species/`` there are replaced."""
    out = Path(out_dir)
    raw, split = out / "raw", out / "split" / SPLIT_NAME
    for p in (raw, split):
        if p.exists():
            shutil.rmtree(p)
        p.mkdir(parents=True)
    _write_table(raw / "edge.csv.gz", np.stack([data.src, data.dst], axis=1))
    _write_table(raw / "edge-feat.csv.gz", data.edge_feat, float_format="%.9g")
    _write_table(raw / "node-label.csv.gz", data.label.astype(np.int8))
    _write_table(raw / "node_species.csv.gz", data.species.reshape(-1, 1))
    _write_table(raw / "num-node-list.csv.gz", np.array([[data.num_nodes]], dtype=np.int64))
    _write_table(raw / "num-edge-list.csv.gz", np.array([[data.src.shape[0]]], dtype=np.int64))
    for s in ("train", "valid", "test"):
        _write_table(split / f"{s}.csv.gz", getattr(data, s).reshape(-1, 1))
    (out / "RELEASE_v1.txt").write_text("v1")
    meta = proteins_meta(data.name, data.num_tasks)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"synthetic-proteins: wrote {data.num_nodes:,} nodes, {data.src.shape[0]:,} "
          f"undirected edges, {data.num_tasks} tasks to {out}", file=sys.stderr)
    return out
