"""The options of ``partition-ogbn`` (:mod:`partition.cli`): one dataclass, its command line
built by :func:`common.config.add_config_args`. Checks that need no filesystem live in
``validate``; the paths are checked by the CLI before any work starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.config import opt
from common.errors import ConfigError


@dataclass
class SyntheticConfig:
    """The generated graph of ``--dataset synthetic``. ``None``: not given (its ``fallback``
    applies; given with another dataset, it is an error)."""

    num_nodes: int | None = opt(None, "number of nodes", metavar="N", fallback=100_000)
    avg_degree: float | None = opt(
        None, "average number of directed edges per node, both directions of an undirected "
        "edge counted", metavar="D", fallback=20.0)
    feat_dim: int | None = opt(None, "node feature dimension", metavar="D", fallback=100)
    num_classes: int | None = opt(None, "number of classes", metavar="C", fallback=47)
    homophily: float | None = opt(
        None, "fraction of edges joining nodes of the same class, in [0, 1]", metavar="H",
        fallback=0.8)
    raw_out: str = opt(
        "", "write the synthetic graph in OGB's raw layout to DIR (readable with --dataset-dir "
        "DIR); with --out as well, also partition it", metavar="DIR")

    def given(self) -> list[str]:
        """The graph options set (not None), as flags."""
        return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(self)
                if "fallback" in f.metadata and getattr(self, f.name) is not None]

    def resolved(self) -> SyntheticConfig:
        """A copy with every option not given set to its fallback."""
        return dataclasses.replace(self, **{
            f.name: f.metadata["fallback"] for f in dataclasses.fields(self)
            if "fallback" in f.metadata and getattr(self, f.name) is None})


@dataclass
class PartitionConfig:
    """partition-ogbn: a dataset in, a partition set out (see docs/partitions.md)."""

    dataset: str = opt(
        "", "an OGB node-property dataset name (ogbn-arxiv, ogbn-products, ogbn-papers100M; "
        "downloaded into --root when missing), or 'synthetic' for a generated power-law graph. "
        "Exactly one of --dataset / --dataset-dir is required.", metavar="NAME",
        mutex="source", mutex_required=True)
    dataset_dir: str = opt(
        "", "a directory in OGB's raw layout (raw/*.csv.gz, split/, RELEASE_v1.txt, "
        "meta.json), e.g. ../shared/datasets/cora; it is only read, never written",
        metavar="DIR", mutex="source", mutex_required=True)
    root: str = opt(
        "./data/ogb", "ogb download/cache directory for --dataset ogbn-*; offline, unzip the "
        "dataset to DIR/ogbn_<name>/ yourself", metavar="DIR")
    num_parts: int = opt(1, "number of partitions, >= 1", metavar="N")
    method: str = opt(
        "metis", "node assignment: 'metis' minimises the edge cut and balances nodes and "
        "training seeds (needs DGL with METIS; no silent fallback), 'random' deals nodes out "
        "evenly", choices=["metis", "random"])
    halo_hops: int = opt(
        0, "also store, per part, the complete in-edges and features of other parts' nodes "
        "within K in-hops (0-3), so sampling hops 2..K+1 and their features need no "
        "server-to-server request when they stay inside the halo; costs the halo's size (0: "
        "the first hop is always local)", metavar="K")
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
    seed: int = opt(0, "random seed for --method random and the synthetic generator")
    add_reverse_edges: bool = opt(
        False, "make a directed dataset (e.g. ogbn-arxiv) bidirected by adding every edge "
        "reversed; no-op for datasets ogb already stores with inverse edges", negatable=False)
    work_dir: str = opt(
        "", "where ogb's temporary processing directory goes (empty: --root for --dataset "
        "ogbn-*, the system temp dir for --dataset-dir)", metavar="DIR")
    synthetic: SyntheticConfig = field(
        default_factory=SyntheticConfig,
        metadata={"help": "synthetic graph (--dataset synthetic)", "flatten": True})
    no_progress: bool = opt(False, "hide progress bars (shown on stderr otherwise)",
                            negatable=False)

    def validate(self) -> None:
        if bool(self.dataset) == bool(self.dataset_dir):
            raise ConfigError("exactly one of the arguments --dataset --dataset-dir is "
                              "required")
        if self.num_parts < 1:
            raise ConfigError(f"--num-parts {self.num_parts}: the number of parts must be >= 1")
        synthetic = self.dataset == "synthetic"
        if self.synthetic.given() and not synthetic:
            raise ConfigError(f"{', '.join(self.synthetic.given())} only apply to --dataset "
                              "synthetic; remove them")
        if self.synthetic.raw_out and not synthetic:
            raise ConfigError("--raw-out only applies to --dataset synthetic; remove it or use "
                              "--out")
        if not self.out and not self.synthetic.raw_out:
            raise ConfigError("--out DIR is required (the directory to write the partition set "
                              "to)")
        if synthetic:
            self._check_synthetic(self.synthetic.resolved())
        elif self.dataset and not self.dataset.startswith("ogbn-"):
            raise ConfigError(
                f"--dataset {self.dataset!r}: expected an ogbn-* name (e.g. ogbn-arxiv) or "
                "'synthetic'; for a local directory use --dataset-dir DIR")

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
