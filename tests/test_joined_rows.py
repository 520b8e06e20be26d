"""Several parts' ``feat.npy`` mapped as one matrix (common/joined_rows.py): each part's
rows where :func:`layout` put them, the same rows as the files, ids rebased alike natively
and in torch, ids outside the set refused, the range unmapped when the last view is freed,
and a clear reason wherever the parts cannot be joined."""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
import torch

from common import mfg
from common.joined_rows import join, layout

PAGE = mmap.PAGESIZE


def test_layout_starts_each_part_on_a_page_a_whole_number_of_rows_on():
    for headers, rows, row_bytes in [([128, 128, 128], [1000, 1, 2345], 400),
                                     ([128, 192, 128, 256], [5, 0, 7, 3], 14),
                                     ([128, 128], [3, 3], 4096), ([80, 96], [10, 10], 24)]:
        starts, map_at, size = layout(headers, rows, row_bytes)
        assert starts[0] == 0 and map_at[0] == 0 and size % PAGE == 0
        end = 0
        for p, (h, n) in enumerate(zip(headers, rows)):
            assert starts[p] >= end and map_at[p] % PAGE == 0
            # the file's first row lands on the joined matrix's row starts[p]
            assert map_at[p] + h == headers[0] + starts[p] * row_bytes
            if p:  # after the previous file's mapping, never over it
                assert map_at[p] >= headers[0] + end * row_bytes
            end = starts[p] + n
        assert size >= headers[0] + end * row_bytes
    # 4096-byte rows keep every header's offset within a page: 128 and 192 never meet
    assert layout([128, 192], [10, 10], 4096) is None
    assert layout([128], [0], 0) is None and layout([], [], 4) is None


def _parts(tmp_path, rows: list[int], dim: int, dtype) -> tuple[list[np.ndarray], list[int]]:
    arrays = []
    rng = np.random.default_rng(dim)
    for p, n in enumerate(rows):
        path = tmp_path / f"p{p}-{dim}-{np.dtype(dtype).name}.npy"
        np.save(path, rng.standard_normal((n, dim)).astype(dtype))
        arrays.append(np.load(path, mmap_mode="r"))
    return arrays, np.concatenate([[0], np.cumsum(rows)]).astype(int).tolist()


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.mark.parametrize("dim,dtype", [(100, np.float32), (7, np.float16), (1024, np.float32),
                                       (3, np.float64)])
def test_join_reads_each_part_as_its_file(tmp_path, monkeypatch, dim, dtype):
    arrays, offsets = _parts(tmp_path, [1000, 1, 0, 2345], dim, dtype)
    joined, why = join(arrays, offsets)
    assert joined is not None and why == "", why
    full = torch.from_numpy(np.concatenate([np.asarray(a) for a in arrays]))
    for a, start in zip(arrays, joined.starts):
        assert torch.equal(joined.matrix[start:start + a.shape[0]], torch.from_numpy(np.array(a)))
    g = torch.Generator().manual_seed(dim)
    ids = torch.cat([torch.randint(0, offsets[-1], (3000,), generator=g),
                     torch.tensor([0, offsets[1] - 1, offsets[1], offsets[-1] - 1])])
    rows = joined.rows_of(ids)
    src = joined.source_rows(ids)
    assert src.num_parts == 1 and torch.equal(src.gather(), full[ids])
    with pytest.raises(ValueError, match="outside the parts"):
        joined.rows_of(torch.tensor([offsets[-1]]))
    with pytest.raises(ValueError, match="outside the parts"):
        joined.rows_of(torch.tensor([-1]))
    monkeypatch.setattr(mfg.native, "load", lambda: None)  # torch's rebasing
    assert torch.equal(joined.rows_of(ids), rows)
    with pytest.raises(ValueError, match="outside the parts"):
        joined.rows_of(torch.tensor([offsets[-1]]))
    address = joined.matrix.data_ptr()
    assert _mapped(address)
    del joined, src, rows
    gc.collect()
    assert not _mapped(address)  # the whole range unmapped with its last view


def test_join_names_why_not(tmp_path):
    arrays, offsets = _parts(tmp_path, [10, 20], 8, np.float32)
    assert join(arrays[:1], offsets[:2]) == (None, "one part")
    joined, why = join(arrays, [0, 11, 30])
    assert joined is None and "node offsets" in why
    other, _ = _parts(tmp_path, [20], 9, np.float32)
    joined, why = join([arrays[0], other[0]], offsets)
    assert joined is None and "one dtype and width" in why
    joined, why = join([np.zeros((10, 8), np.float32), arrays[1]], offsets)  # not a map
    assert joined is None and "maps" in why
    # rows of 4096 bytes: headers 64 bytes apart (a longer header, as another writer may
    # pad it) never meet on a page
    wide = []
    for p, header_bytes in enumerate([128, 192]):
        data = np.random.default_rng(p).standard_normal((4, 1024)).astype(np.float32)
        path = tmp_path / f"wide{p}.npy"
        _save_with_header(path, data, header_bytes)
        wide.append(np.load(path, mmap_mode="r"))
        assert wide[-1].offset == header_bytes and np.array_equal(wide[-1], data)
    joined, why = join(wide, [0, 4, 8])
    assert joined is None and "no page-aligned start" in why, why


def _save_with_header(path, data: np.ndarray, header_bytes: int) -> None:
    """``data`` as a version 1.0 .npy file whose header (padded with spaces, as the format
    allows) is ``header_bytes`` long."""
    text = repr({"descr": np.lib.format.dtype_to_descr(data.dtype), "fortran_order": False,
                 "shape": data.shape})
    text = text.ljust(header_bytes - 10 - 1) + "\n"
    with open(path, "wb") as f:
        f.write(np.lib.format.magic(1, 0) + len(text).to_bytes(2, "little") + text.encode())
        f.write(data.tobytes())
