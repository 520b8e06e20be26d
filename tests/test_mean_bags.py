"""Block.mean_bags_t, the mean's backward bags: the native transpose (common/native.c's
mfg_transpose_csc) gives exactly the stable-argsort path's bags, edges and weights, in the
same order; a CSC naming a source outside the block, or whose rows do not rise from 0 to its
edge count, is refused with the block's shape named; where the native path does not apply
(other weight dtypes, the library switched off) the torch path runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import native
from common.mfg import Block
from tests.test_model import random_block

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


def _torch_path(b: Block, dtype=torch.float32):
    fresh = Block(b.indptr, b.indices, b.num_src_nodes(), b.num_dst_nodes())
    fresh._transpose_native = lambda w: None  # the stable argsort
    return fresh.mean_bags_t(dtype)


@pytest.mark.skipif(native.load() is None, reason="native library not built here")
@pytest.mark.parametrize("num_src,num_dst,max_deg,seed", [
    (50, 20, 6, 0),      # repeated sources, empty destinations
    (3000, 400, 15, 1),  # sources no edge names
    (7, 7, 0, 2),        # no edges at all
    (1, 5, 4, 3),        # one source
    (0, 0, 0, 4),        # an empty block
])
def test_native_transpose_equals_the_stable_argsort(num_src, num_dst, max_deg, seed):
    b = random_block(num_src, num_dst, max_deg, seed)
    want = _torch_path(b)
    got = b.mean_bags_t()
    assert b._transpose_native(b.mean_bags()[2]) is not None  # the native path ran
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    # the backward's embedding_bag over these bags is the mean's transpose
    x = torch.randn(num_dst, 3, dtype=torch.float64)
    idx, off, wt = got
    back = torch.nn.functional.embedding_bag(idx, x, off, mode="sum",
                                             per_sample_weights=wt.double(),
                                             include_last_offset=True)
    dense = torch.zeros(num_dst, num_src, dtype=torch.float64)
    fw_idx, fw_off, fw_w = b.mean_bags()
    for d in range(num_dst):
        for e in range(int(fw_off[d]), int(fw_off[d + 1])):
            dense[d, fw_idx[e]] += float(fw_w[e])
    assert torch.allclose(back, dense.T @ x)


@pytest.mark.skipif(native.load() is None, reason="native library not built here")
def test_a_source_outside_the_block_is_refused():
    b = Block(torch.tensor([0, 2, 3]), torch.tensor([0, 5, 1]), 4, 2)
    with pytest.raises(ValueError, match=r"sources in \[0, 4\)"):
        b.mean_bags_t()
    short = Block(torch.tensor([0, 2, 4]), torch.tensor([0, 1, 1]), 4, 2)  # indptr past the end
    with pytest.raises(ValueError, match="rising from 0 to 3 edges"):
        short._transpose_native(torch.ones(3))
    # ends at the edge count but falls on the way: row 0 would read past the indices
    falling = Block(torch.tensor([0, 5, 3]), torch.tensor([0, 1, 1]), 4, 2)
    with pytest.raises(ValueError, match="rising from 0 to 3 edges"):
        falling._transpose_native(torch.ones(3))


def test_other_dtypes_take_the_torch_path():
    b = random_block(40, 10, 5, 7)
    got = b.mean_bags_t(torch.float64)
    assert b._transpose_native(b.mean_bags(torch.float64)[2]) is None
    for g, w in zip(got, _torch_path(b, torch.float64)):
        assert torch.equal(g, w)


def test_without_the_native_library_the_torch_path_gives_the_same_bags(tmp_path):
    code = ("import torch; from common.mfg import Block; from common import native; "
            "b = Block(torch.tensor([0, 2, 2, 5]), torch.tensor([1, 0, 2, 1, 1]), 3, 3); "
            "i, o, w = b.mean_bags_t(); assert native.load() is None; "
            "print(i.tolist(), o.tolist(), [round(v, 4) for v in w.tolist()])")
    env = {**os.environ, "MFGSERVE_NATIVE": "0"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    # source 0: dst 0; source 1: dst 0, then dst 2 twice; source 2: dst 2
    assert proc.stdout.split("\n")[0] == ("[0, 0, 2, 2, 2] [0, 1, 4, 5] "
                                          "[0.5, 0.5, 0.3333, 0.3333, 0.3333]")
