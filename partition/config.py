"""The options of ``partition-ogbn`` (:mod:`partition.cli`): one dataclass, its command line
built by :func:`common.config.add_config_args`. Checks that need no filesystem live in
``validate``; the paths are checked by the CLI before any work starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.config import opt
from common.errors import ConfigError

# options that belong to one generator only (the others apply to both)
_SYNTHETIC_ONLY = ("homophily", "labeled_frac", "feat_dtype")
_RMAT_ONLY = ("rmat_a", "rmat_b", "rmat_c", "rmat_noise")
# synthetic options of the binary-layout generator (partition.biggen) only
_BINARY_ONLY = ("labeled_frac", "feat_dtype")
# fallbacks that differ for --dataset rmat (issue 14: ~200k training seeds of 2.1M nodes)
_RMAT_FALLBACKS = {"train_frac": 0.1, "valid_frac": 0.05, "raw_format": "binary"}
# --dataset synthetic-proteins (partition/proteins.py): the options it takes, its fallbacks
_PROTEINS_OPTS = ("num_nodes", "avg_degree", "homophily", "num_tasks")
_PROTEINS_FALLBACKS = {"avg_degree": 50.0}
# --dataset synthetic-mag (partition/maggen.py): the options it takes, its fallbacks
_MAG_OPTS = ("num_nodes", "feat_dim", "num_classes", "train_frac", "valid_frac", "raw_out")
_MAG_FALLBACKS = {"feat_dim": 128, "num_classes": 16, "train_frac": 0.85, "valid_frac": 0.09}
DERIVE_FEATURES = ("none", "mean")
METHODS = ("metis", "random", "fennel", "ldg")
STREAM_ONLY_METHODS = ("fennel", "ldg")
# --node-order (partition.partitioner.node_order_keys); the first is the default
NODE_ORDERS = ("degree", "id")


@dataclass
class SyntheticConfig:
    """The generated graph of ``--dataset synthetic`` or ``--dataset rmat``. ``None``: not
    given (its ``fallback`` applies, or ``_RMAT_FALLBACKS`` for rmat; given with another
    dataset, it is an error)."""

    num_nodes: int | None = opt(None, "number of nodes", metavar="N", fallback=100_000)
    avg_degree: float | None = opt(
        None, "average number of directed edges per node, both directions of an undirected "
        "edge counted", metavar="D", fallback=20.0)
    feat_dim: int | None = opt(None, "node feature dimension", metavar="D", fallback=100)
    num_classes: int | None = opt(None, "number of classes", metavar="C", fallback=47)
    homophily: float | None = opt(
        None, "synthetic only: fraction of edges joining nodes of the same class, in [0, 1]",
        metavar="H", fallback=0.8)
    train_frac: float | None = opt(
        None, "fraction of the nodes in the training split; shown: synthetic's default, "
        "rmat's is 0.1 (rmat draws train / valid from nodes with neighbours first)",
        metavar="F", fallback=0.6)
    valid_frac: float | None = opt(
        None, "fraction of the nodes in the validation split, the test split is the rest; "
        "shown: synthetic's default, rmat's is 0.05", metavar="F", fallback=0.2)
    rmat_a: float | None = opt(
        None, "rmat only: probability of the top-left quadrant (both endpoints in the lower "
        "half of the id range) at each recursion level; the bottom-right one gets d = 1 - a - "
        "b - c (Graph500: 0.57, 0.19, 0.19, 0.05). Larger a: more skewed degrees",
        metavar="A", fallback=0.57)
    rmat_b: float | None = opt(
        None, "rmat only: probability of the top-right quadrant per level", metavar="B",
        fallback=0.19)
    rmat_c: float | None = opt(
        None, "rmat only: probability of the bottom-left quadrant per level", metavar="C",
        fallback=0.19)
    rmat_noise: float | None = opt(
        None, "rmat only: per-level noise amplitude on the quadrant probabilities (noisy "
        "Kronecker graphs: smooths the degree distribution), within [0, min(b, c, (a + d) / "
        "2)]; 0 is plain RMAT", metavar="X", fallback=0.1)
    raw_format: str | None = opt(
        None, "layout the generated graph is written in: 'csv' (OGB's raw/*.csv.gz; "
        "synthetic's default, generated in memory) or 'binary' (OGB's raw/data.npz + "
        "raw/node-label.npz, as ogbn-papers100M ships; rmat always). Synthetic with 'binary' "
        "is generated and written by node chunks (partition/biggen.py: memory linear in "
        "nodes, never in edges), each undirected edge stored once, so the graph is read with "
        "--add-reverse-edges as papers100M is; it is what --max-memory-gb needs for a "
        "generated graph", choices=["csv", "binary"], fallback="csv")
    labeled_frac: float | None = opt(
        None, "synthetic --raw-format binary only: fraction of the nodes that carry a label, in "
        "(0, 1]; the others get NaN in node-label.npz (papers100M labels ~1.5M of its 111M "
        "nodes) and the splits are drawn from the labelled nodes", metavar="F", fallback=1.0)
    feat_dtype: str | None = opt(
        None, "synthetic --raw-format binary only: dtype of node_feat in raw/data.npz; "
        "'float16' halves the feature bytes (kept as float16 in a streamed partition set)",
        choices=["float32", "float16"], fallback="float32")
    num_tasks: int | None = opt(
        None, "synthetic-proteins only: number of binary tasks (labels) per node; 112, as "
        "ogbn-proteins, lets ogb's Evaluator('ogbn-proteins') score it", metavar="T",
        fallback=112)
    raw_out: str = opt(
        "", "write the generated graph to DIR, readable with --dataset-dir DIR (synthetic: "
        "OGB's csv raw layout, or binary with --raw-format binary; rmat: OGB's binary "
        "layout, raw/data.npz); with --out as well, also partition it (read back from DIR "
        "for rmat and --raw-format binary)", metavar="DIR")

    def given(self, names: tuple[str, ...] | None = None) -> list[str]:
        """The graph options set (not None), as flags (only those in ``names`` if given)."""
        return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(self)
                if "fallback" in f.metadata and getattr(self, f.name) is not None
                and (names is None or f.name in names)]

    def resolved(self, dataset: str = "synthetic") -> SyntheticConfig:
        """A copy with every option not given set to its fallback for ``dataset``."""
        extra = (_RMAT_FALLBACKS if dataset == "rmat" else
                 _PROTEINS_FALLBACKS if dataset == "synthetic-proteins" else
                 _MAG_FALLBACKS if dataset == "synthetic-mag" else {})
        return dataclasses.replace(self, **{
            f.name: extra.get(f.name, f.metadata["fallback"]) for f in dataclasses.fields(self)
            if "fallback" in f.metadata and getattr(self, f.name) is None})


@dataclass
class PartitionConfig:
    """partition-ogbn: a dataset in, a partition set out (see docs/partitions.md)."""

    dataset: str = opt(
        "", "an OGB node-property dataset name (ogbn-arxiv, ogbn-products, ogbn-papers100M; "
        "downloaded into --root when missing), 'synthetic' for a generated power-law graph with "
        "homophilous classes (products-shaped), or 'rmat' for a generated RMAT (Kronecker) "
        "graph with skewed degrees, written in OGB's binary layout and read back through ogb "
        "(see partition/rmat.py), or 'synthetic-proteins' for a generated multi-label graph "
        "shaped like ogbn-proteins (edge features, --num-tasks binary tasks, species split; "
        "partition/proteins.py), written in OGB's raw csv layout and read back through ogb, "
        "or 'synthetic-mag' for a generated heterogeneous graph shaped like ogbn-mag (4 node "
        "types, 4 relations, features on paper only, time split; --num-nodes counts papers; "
        "partition/maggen.py), written in OGB's heterogeneous raw layout and read back. "
        "Heterogeneous datasets (ogbn-mag, or meta.json 'is hetero' True) become typed "
        "partition sets (docs/partitions.md). "
        "Exactly one of --dataset / --dataset-dir is required.", metavar="NAME",
        mutex="source", mutex_required=True)
    dataset_dir: str = opt(
        "", "a directory in OGB's raw layout (raw/*.csv.gz, or with binary=True in meta.json "
        "raw/data.npz and raw/node-label.npz; split/, RELEASE_v1.txt, meta.json), e.g. "
        "../shared/datasets/cora; it is only read, never written",
        metavar="DIR", mutex="source", mutex_required=True)
    root: str = opt(
        "./data/ogb", "ogb download/cache directory for --dataset ogbn-*; offline, unzip the "
        "dataset to DIR/ogbn_<name>/ yourself", metavar="DIR")
    num_parts: int = opt(1, "number of partitions, >= 1", metavar="N")
    method: str = opt(
        "metis", "node assignment: 'metis' minimises the edge cut and balances nodes and "
        "training seeds (needs DGL with METIS, holds the whole graph in memory; no silent "
        "fallback), 'random' deals nodes out evenly (cut ~ (N-1)/N of the edges), 'fennel' / "
        "'ldg' stream the edges --stream-passes times and place each node with most of its "
        "neighbours, balanced on nodes and training seeds (memory linear in nodes; always the "
        "streaming pipeline)", choices=list(METHODS))
    max_memory_gb: float | None = opt(
        None, "keep the partitioner's peak resident memory under GB (GiB, measured with "
        "psutil and reported): random / fennel / ldg then run the streaming pipeline (edges "
        "and features read in chunks, edges bucketed through temporary files under "
        "--work-dir, parts written by chunks); metis runs in memory if its estimate fits. A "
        "budget below what the method needs fails before any work, naming the minimum. "
        "Not given: no limit", metavar="GB")
    stream_passes: int = opt(
        2, "passes over the edges of --method fennel / ldg (each pass re-places every node "
        "knowing the previous placement of all; 1 is the classic one-pass algorithm)",
        metavar="P")
    halo_hops: int = opt(
        0, "also store, per part, the complete in-edges and features of other parts' nodes "
        "within K in-hops (0-3), so sampling hops 2..K+1 and their features need no "
        "server-to-server request when they stay inside the halo; costs the halo's size (0: "
        "the first hop is always local)", metavar="K")
    node_order: str = opt(
        NODE_ORDERS[0], "the order of each part's nodes (their global ids): 'degree' puts the "
        "nodes with the most out-edges first (ties by original id; a typed graph's nodes stay "
        "grouped by type), so the few nodes that most mini-batches sample share pages and "
        "cache lines on a graph with skewed degrees (about 10 %% more seeds per sampler "
        "CPU-second on the benchmarks' RMAT graph; costs one more pass over the edges, and "
        "the streaming pipeline rewrites the feature files once); 'id' keeps the original "
        "order", choices=list(NODE_ORDERS))
    presample_batches: int = opt(
        16, "mini-batches of training seeds (fanouts 15,10,5, batch 1024) sampled to rank "
        "nodes by hotness for trainers' feature caches (hot_rank.npy); 0 skips it",
        metavar="B")
    out: str = opt(
        "", "output directory of the partition set; must be new or empty (required unless "
        "--raw-out is given). The set is written beside it and renamed into place when "
        "complete", metavar="DIR")
    force: bool = opt(
        False, "replace an existing partition set (or OGB raw directory for --raw-out) at the "
        "output path; only the set's own files are deleted, and a directory holding anything "
        "else is refused", negatable=False)
    seed: int = opt(0, "random seed for --method random and the synthetic / rmat generators")
    add_reverse_edges: bool = opt(
        False, "make a directed dataset (e.g. ogbn-arxiv) bidirected by adding every edge "
        "reversed; no-op for datasets ogb already stores with inverse edges", negatable=False)
    work_dir: str = opt(
        "", "where temporary files go: ogb's processing directory, a generated graph's raw "
        "directory without --raw-out, and the streaming pipeline's edge buckets (~8 bytes per "
        "directed edge; empty: --root for --dataset ogbn-*, the system temp dir otherwise; "
        "streaming: a hidden directory beside --out)", metavar="DIR")
    edge_feat_to_node: str = opt(
        "auto", "node features from edge features: per node, the 'mean' or 'sum' of its "
        "incoming edges' features (raw/edge-feat.csv.gz), appended to any node features "
        "(ogbn-proteins' usual baseline); 'none' never; 'auto': 'mean' for a dataset with edge "
        "features and no node features, 'none' otherwise", choices=["auto", "mean", "sum",
                                                                     "none"])
    node_species: str = opt(
        "none", "ogbn-proteins' node_species (an additional node file): 'none' uses it only "
        "through the 'species' split, as OGB ships it; 'onehot' also appends a one-hot of "
        "each node's species to its features", choices=["none", "onehot"])
    derive_features: str = opt(
        "none", "heterogeneous datasets: features of the featureless node types (ogbn-mag's "
        "author, institution, field_of_study). 'mean': each gets the mean of its neighbours' "
        "features through the first relation joining it to a featured type, derived in rounds "
        "(institution from its derived authors); the relation used is printed and recorded in "
        "the metadata. 'none': their rows stay zeros (learnable embeddings in the trainer)",
        choices=list(DERIVE_FEATURES))
    synthetic: SyntheticConfig = field(
        default_factory=SyntheticConfig,
        metadata={"help": "generated graph (--dataset synthetic or rmat)", "flatten": True})
    no_progress: bool = opt(False, "hide progress bars (shown on stderr otherwise)",
                            negatable=False)

    def validate(self) -> None:
        if bool(self.dataset) == bool(self.dataset_dir):
            raise ConfigError("exactly one of the arguments --dataset --dataset-dir is "
                              "required")
        if self.num_parts < 1:
            raise ConfigError(f"--num-parts {self.num_parts}: the number of parts must be >= 1")
        self._check_memory()
        generated = self.dataset in ("synthetic", "rmat", "synthetic-proteins",
                                     "synthetic-mag")
        self._check_proteins()
        self._check_mag()
        if self.synthetic.given() and not generated:
            raise ConfigError(f"{', '.join(self.synthetic.given())} only apply to --dataset "
                              "synthetic or rmat; remove them")
        if self.dataset == "synthetic" and self.synthetic.given(_RMAT_ONLY):
            raise ConfigError(f"{', '.join(self.synthetic.given(_RMAT_ONLY))} only apply to "
                              "--dataset rmat; remove them")
        if self.dataset == "rmat" and self.synthetic.given(_SYNTHETIC_ONLY):
            raise ConfigError(f"{', '.join(self.synthetic.given(_SYNTHETIC_ONLY))} only apply "
                              "to --dataset synthetic; remove them")
        if self.dataset == "rmat" and self.add_reverse_edges:
            raise ConfigError("--add-reverse-edges does not apply to --dataset rmat (its graph "
                              "already stores both directions of every edge); remove it")
        if self.synthetic.raw_out and not generated:
            raise ConfigError("--raw-out only applies to --dataset synthetic or rmat; remove it "
                              "or use --out")
        if not self.out and not self.synthetic.raw_out:
            raise ConfigError("--out DIR is required (the directory to write the partition set "
                              "to)")
        if generated:
            self._check_synthetic(self.synthetic.resolved(self.dataset))
        elif self.dataset and not self.dataset.startswith("ogbn-"):
            raise ConfigError(
                f"--dataset {self.dataset!r}: expected an ogbn-* name (e.g. ogbn-arxiv), "
                "'synthetic', 'rmat', 'synthetic-proteins' or 'synthetic-mag'; for a local "
                "directory use --dataset-dir DIR")

    def _check_mag(self) -> None:
        """--dataset synthetic-mag: the options it takes; in memory only."""
        if self.dataset in ("synthetic", "rmat", "synthetic-proteins") and (
                self.derive_features != "none"):
            raise ConfigError(f"--derive-features applies to heterogeneous datasets (ogbn-mag, "
                              f"synthetic-mag), not --dataset {self.dataset}; remove it")
        if self.dataset != "synthetic-mag":
            return
        odd = [g for g in self.synthetic.given() if g[2:].replace("-", "_") not in _MAG_OPTS]
        if odd:
            raise ConfigError(f"{', '.join(odd)} do not apply to --dataset synthetic-mag (it "
                              "takes --num-nodes (papers), --feat-dim, --num-classes, "
                              "--train-frac, --valid-frac); remove them")
        if self.streaming() or self.max_memory_gb is not None:
            raise ConfigError(
                "--dataset synthetic-mag is a typed (heterogeneous) graph: it is partitioned in "
                "memory (--method metis or random, no --max-memory-gb); the streaming pipeline "
                "handles homogeneous graphs only")
        if self.edge_feat_to_node != "auto" or self.node_species != "none":
            raise ConfigError("--edge-feat-to-node / --node-species do not apply to --dataset "
                              "synthetic-mag; remove them")

    def _check_proteins(self) -> None:
        """--dataset synthetic-proteins and the options of multi-label datasets."""
        if self.dataset == "synthetic-proteins":
            odd = [g for g in self.synthetic.given()
                   if g[2:].replace("-", "_") not in _PROTEINS_OPTS]
            if odd:
                raise ConfigError(f"{', '.join(odd)} do not apply to --dataset "
                                  "synthetic-proteins (it takes --num-nodes, --avg-degree, "
                                  "--homophily, --num-tasks); remove them")
            if self.streaming() or self.max_memory_gb is not None:
                raise ConfigError(
                    "--dataset synthetic-proteins is multi-label: it is partitioned in memory "
                    "(--method metis or random, no --max-memory-gb); the streaming pipeline "
                    "writes single-task labels only")
            if self.synthetic.resolved(self.dataset).num_tasks < 1:
                raise ConfigError(f"--num-tasks {self.synthetic.num_tasks} must be >= 1")
        elif self.synthetic.num_tasks is not None:
            raise ConfigError("--num-tasks only applies to --dataset synthetic-proteins; "
                              "remove it")
        if self.dataset in ("synthetic", "rmat") and (
                self.edge_feat_to_node != "auto" or self.node_species != "none"):
            raise ConfigError(f"--edge-feat-to-node / --node-species do not apply to --dataset "
                              f"{self.dataset} (a generated graph without edge features or "
                              "species); remove them")

    def streaming(self) -> bool:
        """Whether the streaming pipeline (partition.stream) partitions: --method fennel /
        ldg always, random with --max-memory-gb."""
        return self.method in STREAM_ONLY_METHODS or (
            self.max_memory_gb is not None and self.method != "metis")

    def _check_memory(self) -> None:
        if self.max_memory_gb is not None and not self.max_memory_gb > 0:
            raise ConfigError(f"--max-memory-gb {self.max_memory_gb:g} must be > 0 (GiB); "
                              "leave it out for no limit")
        if self.stream_passes < 1:
            raise ConfigError(f"--stream-passes {self.stream_passes} must be >= 1")
        if self.max_memory_gb is None:
            return
        if self.dataset == "rmat":
            raise ConfigError(
                "--max-memory-gb does not apply to --dataset rmat, which is generated in "
                "memory: write it first (--dataset rmat --raw-out DIR), then partition "
                "--dataset-dir DIR --max-memory-gb GB; or use --dataset synthetic --raw-format "
                "binary, generated by chunks")
        if self.dataset == "synthetic" and (self.synthetic.raw_format or "csv") == "csv":
            raise ConfigError(
                "--max-memory-gb with --dataset synthetic needs --raw-format binary (the csv "
                "generator holds the whole graph in memory; the binary one writes it by "
                "chunks and the partitioner streams it back)")

    def _check_synthetic(self, s: SyntheticConfig) -> None:
        if s.num_nodes < 2:
            raise ConfigError(f"--num-nodes {s.num_nodes}: a synthetic graph needs >= 2 nodes")
        if self.num_parts > s.num_nodes:
            raise ConfigError(f"--num-parts {self.num_parts} exceeds --num-nodes "
                              f"{s.num_nodes}; use fewer parts")
        if not 0.0 <= s.homophily <= 1.0:
            raise ConfigError(f"--homophily {s.homophily} must be within [0, 1]")
        if s.avg_degree < 0 or s.feat_dim < 1 or s.num_classes < 1:
            raise ConfigError(
                "--avg-degree must be >= 0, --feat-dim and --num-classes >= 1 "
                f"(got {s.avg_degree:g}, {s.feat_dim}, {s.num_classes})")
        if not (0 <= s.train_frac and 0 <= s.valid_frac and s.train_frac + s.valid_frac < 1):
            raise ConfigError(
                f"--train-frac {s.train_frac:g} and --valid-frac {s.valid_frac:g} must be >= 0 "
                "with a sum below 1 (the test split is the rest and must not be empty)")
        if self.dataset == "rmat":
            self._check_rmat(s)
            if s.raw_format != "binary":
                raise ConfigError("--dataset rmat is always written in OGB's binary layout; "
                                  "remove --raw-format csv")
        if s.raw_format == "csv" and self.synthetic.given(_BINARY_ONLY):
            raise ConfigError(f"{', '.join(self.synthetic.given(_BINARY_ONLY))} only apply to "
                              "--raw-format binary (the csv generator labels every node and "
                              "writes float32); add --raw-format binary or remove them")
        if not 0.0 < s.labeled_frac <= 1.0:
            raise ConfigError(f"--labeled-frac {s.labeled_frac:g} must be within (0, 1]")

    @staticmethod
    def _check_rmat(s: SyntheticConfig) -> None:
        d = 1.0 - s.rmat_a - s.rmat_b - s.rmat_c
        if not (s.rmat_a > 0 and s.rmat_b >= 0 and s.rmat_c >= 0 and d >= -1e-9):
            raise ConfigError(
                f"--rmat-a {s.rmat_a:g}, --rmat-b {s.rmat_b:g}, --rmat-c {s.rmat_c:g}: the "
                "quadrant probabilities must be >= 0 (a > 0) with a + b + c <= 1 (d = 1 - a - "
                f"b - c, here {d:g})")
        top = min(s.rmat_b, s.rmat_c, (s.rmat_a + max(d, 0.0)) / 2)
        if not 0 <= s.rmat_noise <= top:
            raise ConfigError(
                f"--rmat-noise {s.rmat_noise:g} must be within [0, min(b, c, (a + d) / 2)] = "
                f"[0, {top:g}], or some level's quadrant probabilities go negative")
