"""partition/npzio.py: .npz archives read and written one member chunk at a time.

Round trips against numpy's own ``np.savez`` / ``np.savez_compressed`` / ``np.load`` (stored
and deflated members, float16, [2, E] edge_index read by two readers), the column-chunk
writer, clear DatasetErrors naming the file for missing / truncated / corrupt archives,
and -- in a fresh subprocess, measured with its own VmHWM and psutil -- that reading
a stored member by chunks does not materialise it, that writing one keeps one chunk in
memory, and that the map's pages leave the resident set again on ``release()``."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from procs import REPO, clean_env

from partition.graph_data import DatasetError
from partition.npzio import NpyMemberReader, NpzWriteError, NpzWriter, npy_member_info

RNG = np.random.default_rng(12)
E = 10_007
N = 1_003
EDGE_INDEX = RNG.integers(0, N, size=(2, E), dtype=np.int64)
FEAT32 = RNG.standard_normal((N, 13)).astype(np.float32)
FEAT16 = FEAT32.astype(np.float16)
FLAGS = RNG.random(N) < 0.5
LABEL = np.where(RNG.random((N, 1)) < 0.3, np.nan, RNG.integers(0, 5, (N, 1)).astype(np.float64))


def _arrays() -> dict[str, np.ndarray]:
    return {"edge_index": EDGE_INDEX, "node_feat": FEAT32, "node_feat16": FEAT16,
            "node_label": LABEL, "num_nodes_list": np.array([N], dtype=np.int64),
            "scalar": np.array(3.5), "empty": np.zeros((0, 4), dtype=np.int32),
            "flags": FLAGS}


@pytest.fixture(scope="module", params=["savez", "savez_compressed", "NpzWriter"])
def archive(request, tmp_path_factory) -> Path:
    """The same arrays written three ways: numpy stored, numpy deflated, and NpzWriter by
    chunks (edge_index by column chunks)."""
    path = tmp_path_factory.mktemp("npz") / f"{request.param}.npz"
    arrays = _arrays()
    if request.param == "savez":
        np.savez(path, **arrays)
    elif request.param == "savez_compressed":
        np.savez_compressed(path, **arrays)
    else:
        with NpzWriter(path) as w:
            for name, a in arrays.items():
                if name == "edge_index":
                    with w.member_columns(name, a.shape, a.dtype) as m:
                        for s in range(0, a.shape[1], 999):
                            m.write_rows(a[0, s:s + 999], a[1, s:s + 999])
                elif a.ndim >= 1 and a.shape[0] > 10:
                    with w.member(name, a.shape, a.dtype) as m:
                        for s in range(0, a.shape[0], 97):
                            m.write(a[s:s + 97])
                else:
                    w.add(name, a)
    return path


def _eq(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


# ------------------------------------------------------------------------------ reading


@pytest.mark.timeout(60)
def test_round_trip_against_np_load(archive):
    stored = "compressed" not in archive.name
    with np.load(archive) as z:
        assert sorted(z.files) == sorted(_arrays())
        for name, want in _arrays().items():
            assert _eq(z[name], want), name
            shape, dtype, is_stored, off = npy_member_info(archive, name)
            assert (shape, dtype, is_stored) == (want.shape, want.dtype, stored)
            assert (off is None) == (not stored)
            with NpyMemberReader(archive, name + ".npy") as r:
                assert r.shape == want.shape and r.dtype == want.dtype and r.stored == stored
                if want.ndim == 0:
                    continue
                got = list(r.iter_rows(101))
                assert all(c.shape[0] <= 101 for c in got)
                whole = np.concatenate(got) if got else np.empty((0, *want.shape[1:]),
                                                                  want.dtype)
                assert _eq(whole, want), name
    if archive.name == "NpzWriter.npz":
        assert zipfile.ZipFile(archive).testzip() is None  # every member's CRC-32 is right
        for name in _arrays():  # array data 64-byte aligned
            assert npy_member_info(archive, name)[3] % 64 == 0
        if shutil.which("unzip"):
            out = subprocess.run(["unzip", "-t", str(archive)], capture_output=True, text=True)
            assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_edge_index_rows_by_two_readers(archive):
    """Row 0 and row 1 of edge_index streamed side by side by two readers, in chunks, as a
    streaming pass over the edges reads them (for a deflated member each is one stream)."""
    with NpyMemberReader(archive, "edge_index") as r0, \
            NpyMemberReader(archive, "edge_index") as r1:
        pairs = list(zip(r0.iter_row_slices(0, 1000), r1.iter_row_slices(1, 1000)))
        assert len(pairs) == (E + 999) // 1000
        assert np.array_equal(np.concatenate([s for s, _ in pairs]), EDGE_INDEX[0])
        assert np.array_equal(np.concatenate([d for _, d in pairs]), EDGE_INDEX[1])
        # forward random reads, then a read behind the position (a deflated stream restarts)
        assert np.array_equal(r1.row_slice(1, 5000, 5100), EDGE_INDEX[1, 5000:5100])
        assert np.array_equal(r1.row_slice(0, 10, 20), EDGE_INDEX[0, 10:20])
        assert np.array_equal(r1.read_row_slice(1, E - 3, E), EDGE_INDEX[1, E - 3:])
        with pytest.raises(IndexError):
            r0.row_slice(2, 0, 1)
        with pytest.raises(IndexError):
            r0.row_slice(0, 0, E + 1)


@pytest.mark.timeout(60)
def test_rows_views_and_copies(archive):
    stored = "compressed" not in archive.name
    with NpyMemberReader(archive, "node_feat16") as r:
        view = r.rows(100, 250)
        assert view.shape == (150, 13) and view.dtype == np.float16
        assert np.array_equal(view, FEAT16[100:250])
        # stored: a zero-copy view of the map; deflated: a new array
        assert view.flags.owndata is (not stored)
        copy = r.read_rows(0, 7)
        assert copy.flags.owndata and np.array_equal(copy, FEAT16[:7])
        assert list(r.iter_rows(50, start=990, stop=N))[-1].shape == (13, 13)
        if stored:
            ids = RNG.integers(0, N, 500)
            assert np.array_equal(r.take(ids), FEAT16[ids])
            r.release()
            assert np.array_equal(view, FEAT16[100:250])  # views survive release()
        else:
            with pytest.raises(DatasetError, match="deflated"):
                r.take([1, 2])
        del view


# ------------------------------------------------------------------------------ errors


@pytest.mark.timeout(60)
def test_bad_archives_name_the_file(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        NpyMemberReader(tmp_path / "nope.npz", "x")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not a zip file" * 100)
    with pytest.raises(DatasetError, match=str(junk)):
        NpyMemberReader(junk, "x")
    good = tmp_path / "good.npz"
    np.savez(good, edge_index=EDGE_INDEX)
    with pytest.raises(DatasetError, match=r"no member 'node_feat' \(it has \['edge_index'\]"):
        npy_member_info(good, "node_feat")
    # a download cut short: the tail (central directory) is missing
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DatasetError, match=f"{cut}.*truncated"):
        NpyMemberReader(cut, "edge_index")


@pytest.mark.timeout(60)
def test_corrupt_deflated_member(tmp_path):
    """Damaged compressed bytes fail as a DatasetError naming the file and member, while
    streaming (zlib error or CRC-32 mismatch at the member's end)."""
    path = tmp_path / "c.npz"
    np.savez_compressed(path, edge_index=EDGE_INDEX)
    info = zipfile.ZipFile(path).getinfo("edge_index.npy")
    blob = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + 200  # inside the deflate stream
    for i in range(start, start + 64):
        blob[i] ^= 0x5A
    path.write_bytes(bytes(blob))
    with pytest.raises(DatasetError, match=rf"{path} member 'edge_index'.*corrupt"):
        with NpyMemberReader(path, "edge_index") as r:
            for _ in r.iter_row_slices(1, 4096):
                pass


@pytest.mark.timeout(60)
def test_deflated_member_cut_inside(tmp_path):
    """A deflated member whose compressed bytes end early (size fields say more)."""
    path = tmp_path / "c.npz"
    np.savez_compressed(path, node_feat=FEAT32, edge_index=EDGE_INDEX)
    z = zipfile.ZipFile(path)
    feat = z.getinfo("node_feat.npy")
    blob = bytearray(path.read_bytes())
    data0 = feat.header_offset + 30 + len(feat.filename) + len(feat.extra)
    # zero the second half of node_feat's compressed data: the stream breaks or the CRC fails
    mid = data0 + feat.compress_size // 2
    blob[mid: data0 + feat.compress_size] = bytes(data0 + feat.compress_size - mid)
    path.write_bytes(bytes(blob))
    with pytest.raises(DatasetError, match=rf"{path} member 'node_feat'"):
        with NpyMemberReader(path, "node_feat") as r:
            for _ in r.iter_rows(100):
                pass


# ------------------------------------------------------------------------------ writing


@pytest.mark.timeout(60)
def test_writer_checks_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "w.npz"
    with pytest.raises(NpzWriteError, match="needs 30 elements but 20"):
        with NpzWriter(path) as w:
            with w.member("a", (10, 3), np.float32) as m:
                m.write(np.zeros((5, 4)))
    assert not path.exists() and not list(tmp_path.iterdir())
    with pytest.raises(NpzWriteError, match="would bring it to 40"):
        with NpzWriter(path) as w, w.member("a", (10, 3), np.float32) as m:
            m.write(np.zeros((10, 4)))
    with pytest.raises(NpzWriteError, match="cannot be cast"):
        with NpzWriter(path) as w, w.member("a", (3,), np.int32) as m:
            m.write(np.zeros(3, dtype=np.float64))
    with pytest.raises(NpzWriteError, match="needs 10 columns but 4"):
        with NpzWriter(path) as w, w.member_columns("ei", (2, 10), np.int64) as m:
            m.write(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(NpzWriteError, match=r"column chunks of shape \(2, k\)"):
        with NpzWriter(path) as w, w.member_columns("ei", (2, 10), np.int64) as m:
            m.write(np.zeros((3, 4), dtype=np.int64))
    with pytest.raises(NpzWriteError, match="still open"):
        with NpzWriter(path) as w, w.member("a", (1,), np.int64):
            w.add("b", np.zeros(1))
    with pytest.raises(RuntimeError, match="boom"):
        with NpzWriter(path) as w:
            w.add("a", np.arange(5))
            raise RuntimeError("boom")
    assert not path.exists() and not list(tmp_path.iterdir())
    # a same_kind cast is allowed (float64 chunks into a float16 member)
    with NpzWriter(path) as w, w.member("f", (4,), np.float16) as m:
        m.write(np.array([0.5, 1.0]))
        m.write(np.array([2.0, -1.0]))
    with np.load(path) as z:
        assert z["f"].dtype == np.float16 and z["f"].tolist() == [0.5, 1.0, 2.0, -1.0]


# ------------------------------------------------------------------------------ memory

_MEMORY_SCRIPT = r"""
import json, sys
import numpy as np, psutil
from partition.npzio import NpyMemberReader, NpzWriter

path, mode, rows, cols, chunk = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
proc = psutil.Process()
from partition.partitioner import peak_rss_bytes as peak  # this process's own peak
block = np.arange(chunk * cols, dtype=np.float32).reshape(chunk, cols)
base = peak()
out = {}
if mode == "write":
    with NpzWriter(path) as w:
        with w.member("node_feat", (rows, cols), np.float32) as m:
            for s in range(0, rows, chunk):
                m.write(block[: min(chunk, rows - s)])
        e = rows * cols // 2
        with w.member_columns("edge_index", (2, e), np.int64) as m:
            for s in range(0, e, chunk * cols // 2):
                k = min(chunk * cols // 2, e - s)
                m.write_rows(np.arange(s, s + k, dtype=np.int64), np.zeros(k, np.int64))
    out["write_growth"] = peak() - base
else:
    with NpyMemberReader(path, "node_feat") as r:
        total = 0.0
        now = proc.memory_info().rss
        high = now
        for c in r.iter_rows(chunk):
            total += float(c[:, 0].sum(dtype=np.float64))
            high = max(high, proc.memory_info().rss)  # sampled while a chunk is alive
        out["iter_growth"] = max(peak() - base, high - now)
        out["sum"] = total
        if r.stored:
            view = r.rows(0, rows)  # the whole member as a view: nothing read yet
            out["view_nbytes"] = int(view.nbytes)
            out["after_view"] = proc.memory_info().rss - base
            view.sum(dtype=np.float64)  # touch every page of the map
            out["after_touch"] = proc.memory_info().rss - base
            r.release()
            out["after_release"] = proc.memory_info().rss - base
print(json.dumps(out))
"""

ROWS, COLS, CHUNK = 786_432, 64, 16_384  # a 192 MiB float32 member read by 4 MiB chunks
MEMBER = ROWS * COLS * 4
COL0_SUM = float((np.arange(CHUNK, dtype=np.float64) * COLS).sum() * (ROWS // CHUNK))


def _measure(path: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(path), mode, str(ROWS),
                          str(COLS), str(CHUNK)], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_chunked_io_does_not_materialise_members(tmp_path):
    """A 192 MiB float32 member (and a 384 MiB edge_index by column chunks) written and
    read by 4 MiB chunks in a fresh process: its peak RSS grows by a few chunks, not by the
    member; a view over the whole stored member costs nothing until touched, and
    release() gives the touched pages back."""
    path = tmp_path / "big.npz"
    w = _measure(path, "write")
    assert w["write_growth"] < 32 << 20, w
    with NpyMemberReader(path, "edge_index") as r:
        assert r.shape == (2, MEMBER // 8)
        assert np.array_equal(r.read_row_slice(0, 1000, 1010), np.arange(1000, 1010))
        assert not r.read_row_slice(1, 5, 10).any()
    r = _measure(path, "read")
    assert r["sum"] == COL0_SUM
    assert r["iter_growth"] < 32 << 20, r
    assert r["view_nbytes"] == MEMBER and r["after_view"] < 16 << 20, r
    assert r["after_touch"] > MEMBER // 2, r  # mapped pages do count in RSS ...
    assert r["after_release"] < 32 << 20, r   # ... until release() drops them


@pytest.mark.timeout(120)
def test_deflated_member_streams_in_bounded_memory(tmp_path):
    """The same member deflated (as np.savez_compressed stores it; written here by zipfile
    in chunks so the test itself stays small) streams through iter_rows without being
    inflated whole."""
    path = tmp_path / "big_deflated.npz"
    block = np.arange(CHUNK * COLS, dtype=np.float32).reshape(CHUNK, COLS)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": (ROWS, COLS)})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z, \
            z.open("node_feat.npy", "w", force_zip64=True) as f:
        f.write(header.getvalue())
        for _ in range(ROWS // CHUNK):
            f.write(block.tobytes())
    assert npy_member_info(path, "node_feat")[2] is False
    d = _measure(path, "read")
    assert d["sum"] == COL0_SUM
    assert d["iter_growth"] < 48 << 20, d


def test_writer_refuses_a_name_without_npz(tmp_path):
    with pytest.raises(NpzWriteError, match=r"\.npz suffix"):
        NpzWriter(tmp_path / "data.bin")
