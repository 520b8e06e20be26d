"""common/native.c's mfg_copy_rows and PartitionStore.gather's use of it: the same rows as
``index_select`` for every dtype, row width and alignment, streamed (non-temporal stores) or
not; an id outside the matrix is an error before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common import native
from sampler_server import partition_store
from sampler_server.partition_store import PartitionStore

pytestmark = pytest.mark.timeout(120)


def _lib():
    lib = native.load()
    assert lib is not None, native.status()
    return lib


def _copy(lib, feat, ids, out, stream):
    return lib.mfg_copy_rows(feat.data_ptr(), feat.shape[1] * feat.element_size(), feat.shape[0],
                             ids.data_ptr(), ids.numel(), out.data_ptr(), stream)


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 100), (torch.float16, 100),
                                       (torch.float32, 3), (torch.bfloat16, 64),
                                       (torch.float64, 1)])
@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("shift", [0, 1])  # 1: out starts one element past 16-byte alignment
def test_rows_equal_index_select(dtype, dim, stream, shift):
    lib = _lib()
    g = torch.Generator().manual_seed(dim)
    feat = torch.randn(5000, dim, generator=g).to(dtype)
    ids = torch.randint(0, 5000, (3001,), generator=g)
    ids[-1] = 4999
    buf = torch.full((ids.numel() * dim + 16,), -7.0, dtype=dtype)
    out = buf[shift:shift + ids.numel() * dim].view(ids.numel(), dim)
    assert _copy(lib, feat, ids, out, stream) == ids.numel()
    assert torch.equal(out, feat.index_select(0, ids))
    assert (buf[shift + ids.numel() * dim:] == -7).all() and (buf[:shift] == -7).all()


def test_an_id_outside_the_matrix_writes_nothing():
    lib = _lib()
    feat = torch.randn(100, 8)
    out = torch.zeros(3, 8)
    for bad in (100, -1):
        ids = torch.tensor([0, bad, 5])
        assert _copy(lib, feat, ids, out, 1) == native.BAD_ID
        assert (out == 0).all()


def test_no_rows():
    lib = _lib()
    feat = torch.randn(10, 4)
    out = torch.empty(0, 4)
    assert _copy(lib, feat, torch.zeros(0, dtype=torch.int64), out, 1) == 0


@pytest.mark.parametrize("stream_min", [0, 1 << 40])
def test_store_gather_into_a_buffer(synth_parts1, monkeypatch, stream_min):
    """The store's gather into a caller's buffer (a ring slot) gives index_select's rows,
    streamed or not; a node outside the part is refused."""
    monkeypatch.setattr(partition_store, "STREAM_MIN_BYTES", stream_min)
    store = PartitionStore(str(synth_parts1), 0)
    n = store.feat.shape[0]
    nodes = torch.from_numpy(np.sort(np.random.default_rng(0).choice(n, 700, replace=False)))
    out = torch.empty(700, store.feat.shape[1], dtype=store.feat.dtype)
    feat, label = store.gather(nodes + store.start, True, True, out)
    assert feat.data_ptr() == out.data_ptr()
    assert torch.equal(out, store.feat.index_select(0, nodes))
    assert torch.equal(label, store.label.index_select(0, nodes))
    with pytest.raises(IndexError, match="outside this part"):
        store._copy_rows(torch.tensor([0, n]), torch.empty(2, store.feat.shape[1]))
