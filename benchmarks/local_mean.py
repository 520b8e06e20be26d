"""The input layer's mean over rows read in place, one part against several
(``--local-features``; trainer_client/model.py ``mean_and_self_rows``).

    python -m benchmarks.local_mean [--nodes 2000000] [--dim 100] [--parts 2] [--rounds 2]

Random rows and a random block (``--sources`` sources, ``--dests`` destinations, up to
``--fanout`` in-edges each); prints, per round, the median milliseconds of the mean over one
matrix, over the same rows split into ``--parts`` matrices, and over the parts written as
``feat.npy`` files and mapped as one matrix (common/joined_rows.py, what a trainer of a
multi-part set on its host reads; the ids' rebasing included), and a JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common.joined_rows import join
from common.mfg import Block, SourceRows
from trainer_client.model import mean_and_self_rows


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[repeats // 2] * 1e3, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.local_mean", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2_000_000, help="rows of the feature matrix")
    p.add_argument("--dim", type=int, default=100, help="feature width")
    p.add_argument("--parts", type=int, default=2, help="parts the rows are split into")
    p.add_argument("--sources", type=int, default=400_000, help="the block's source nodes")
    p.add_argument("--dests", type=int, default=80_000, help="the block's destinations")
    p.add_argument("--fanout", type=int, default=10, help="most in-edges per destination")
    p.add_argument("--repeats", type=int, default=9, help="timed calls per figure")
    p.add_argument("--rounds", type=int, default=2, help="rounds (the first warms the pages)")
    a = p.parse_args(argv)
    if a.parts < 1 or a.nodes < a.sources or a.sources < a.dests:
        p.error("need --parts >= 1 and --nodes >= --sources >= --dests")
    g = torch.Generator().manual_seed(0)
    full = torch.randn(a.nodes, a.dim, generator=g)
    offsets = [a.nodes * i // a.parts for i in range(a.parts + 1)]
    mats = [full[lo:hi] for lo, hi in zip(offsets, offsets[1:])]
    ids = torch.randperm(a.nodes, generator=g)[:a.sources]
    deg = torch.randint(1, a.fanout + 1, (a.dests,), generator=g)
    indptr = torch.zeros(a.dests + 1, dtype=torch.int64)
    torch.cumsum(deg, 0, out=indptr[1:])
    block = Block(indptr, torch.randint(0, a.sources, (int(indptr[-1]),), generator=g),
                  a.sources, a.dests)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="local-mean-") as tmp:
        maps = []
        for p_, m in enumerate(mats):
            np.save(Path(tmp) / f"feat{p_}.npy", m.numpy())
            maps.append(np.load(Path(tmp) / f"feat{p_}.npy", mmap_mode="r"))
        joined, why = join(maps, offsets)
        if joined is None:
            print(f"the parts cannot be joined here ({why}): no joined figure",
                  file=sys.stderr)
        for r in range(a.rounds):
            row = {
                "parts_ms": _median_ms(lambda: mean_and_self_rows(
                    block, SourceRows(mats, ids, offsets), a.dests), a.repeats),
                "one_part_ms": _median_ms(lambda: mean_and_self_rows(
                    block, SourceRows(full, ids), a.dests), a.repeats),
                "joined_ms": None if joined is None else _median_ms(
                    lambda: mean_and_self_rows(block, joined.source_rows(ids), a.dests),
                    a.repeats)}
            print(f"round {r + 1}: {a.parts} parts {row['parts_ms']} ms, one part "
                  f"{row['one_part_ms']} ms, {a.parts} files joined {row['joined_ms']} ms",
                  file=sys.stderr)
            rounds.append(row)
    print(json.dumps({"edges": block.num_edges(), "parts": a.parts, "rounds": rounds,
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
