"""Read and write numpy ``.npz`` archives one member -- and one chunk -- at a time.

OGB ships its large datasets (ogbn-papers100M) in a *binary* raw layout: ``raw/data.npz``
holds ``edge_index [2, E]`` and ``node_feat [N, F]`` as members of one zip archive.
``np.load(...)["node_feat"]`` inflates a whole member into memory (57 GB for papers100M);
this module never does.

Reading (:class:`NpyMemberReader`):

* a **stored** member (``np.savez``: ``ZIP_STORED``, the bytes of the ``.npy`` file lie
  uncompressed in the archive) is located at its data offset and read from there:
  :meth:`~NpyMemberReader.rows` / :meth:`~NpyMemberReader.row_slice` return zero-copy views
  of a read-only memory map; :meth:`~NpyMemberReader.iter_rows` /
  :meth:`~NpyMemberReader.iter_row_slices` / :meth:`~NpyMemberReader.read_rows` read with
  plain ``readinto`` calls into a fresh chunk, so pages never accumulate in the process's
  resident set (mapped file pages count in RSS until unmapped; plain reads only touch the
  page cache, which does not). :meth:`~NpyMemberReader.take` gathers rows by id through the
  map and drops the touched pages again (``madvise(MADV_DONTNEED)``; the file is read-only,
  so that loses nothing).
* a **deflated** member (``np.savez_compressed``) cannot be addressed: it is inflated
  through :mod:`zipfile` in order. Reads must go forward (a read before the current
  position restarts the stream from the member's start: correct but costly). For an
  ``edge_index [2, E]`` member open two readers, one streaming row 0 and one row 1 (the
  row-1 reader inflates and discards row 0 once). The member's CRC-32 is checked when a
  reader reaches its end.

Writing (:class:`NpzWriter`): an uncompressed (``ZIP_STORED``), zip64 archive that
``np.load`` reads, written member by member and chunk by chunk (peak memory: one chunk).
Every member's sizes are known up front (``shape`` x ``itemsize``), so the local header is
written first with its final sizes and only the CRC-32 is patched in at the end. Each
member's array data starts at a multiple of 64 bytes in the file (a padding extra field),
so memory-mapped reads are aligned. :meth:`NpzWriter.member_columns` writes an
``[R, C]`` member by *column* chunks (``edge_index`` [2, E] produced as edge chunks): every
chunk's rows go straight to their positions in the member, and the CRC-32 is computed by
one sequential read of the finished member (in page-cache-sized pieces), so no row is ever
staged in a temporary file or in memory. The archive is written to ``path + ".tmp"`` and
renamed on success, so a failed writer never leaves a half-written ``.npz`` behind.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import time
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from partition.graph_data import DatasetError

__all__ = ["npy_member_info", "NpyMemberReader", "NpzWriter", "NpzWriteError"]

_IO_BYTES = 16 << 20  # bytes per read / CRC step / skip step
_ALIGN = 64  # array data offset alignment in archives written here (numpy's ARRAY_ALIGN)
_U32 = 0xFFFFFFFF

# zip structures (APPNOTE.TXT 6.3): little-endian, no padding
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_LOCAL_SIG = 0x04034B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_CENTRAL_SIG = 0x02014B50
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes
_EOCD64_SIG = 0x06064B50
_LOCATOR64 = struct.Struct("<IIQI")  # zip64 end of central directory locator, 20 bytes
_LOCATOR64_SIG = 0x07064B50
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory record, 22 bytes
_EOCD_SIG = 0x06054B50
_ZIP64_ID = 0x0001
_PAD_ID = 0xD935  # the extra-field id Android's zipalign pads with; readers skip it
_VERSION = 45  # zip64


class NpzWriteError(DatasetError):
    """An :class:`NpzWriter` was used wrongly (a chunk of the wrong shape or dtype, a member
    not filled exactly, two members open at once); the message says what to change."""


# ---------------------------------------------------------------------------------------
# reading


def _member_name(member: str) -> str:
    return member if member.endswith(".npy") else member + ".npy"


def _read_npy_header(f, where: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    try:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read(f)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as e:
        raise DatasetError(f"{where}: cannot read its .npy header ({type(e).__name__}: {e}); "
                           "the archive is truncated or corrupt, or the member is not a .npy "
                           "array: re-download it or rewrite it with numpy.savez") from e
    if dtype.hasobject:
        raise DatasetError(f"{where}: holds Python objects (dtype {dtype}); only plain numeric "
                           "arrays can be streamed: rewrite it with a numeric dtype")
    return tuple(int(s) for s in shape), dtype, bool(fortran)


def _open_zip(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except FileNotFoundError as e:
        raise DatasetError(f"{path} does not exist; pass the path of a numpy .npz archive") \
            from e
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        raise DatasetError(f"cannot read {path} as a numpy .npz archive ({e}); it is truncated "
                           "or not a zip file: re-download or rewrite it (numpy.savez)") from e


def _zip_info(z: zipfile.ZipFile, path: Path, member: str) -> zipfile.ZipInfo:
    name = _member_name(member)
    try:
        return z.getinfo(name)
    except KeyError:
        have = sorted(n[:-4] for n in z.namelist() if n.endswith(".npy"))
        raise DatasetError(f"{path} has no member {member!r} (it has {have}); check the file "
                           "or the member name") from None


def _member_layout(z: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path, where: str):
    """``(shape, dtype, fortran, stored, data_offset | None)`` of one ``.npy`` member."""
    if info.flag_bits & 0x1:
        raise DatasetError(f"{where} is encrypted; decrypt the archive first")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise DatasetError(f"{where} uses zip compression method {info.compress_type}; only "
                           "stored (numpy.savez) and deflated (numpy.savez_compressed) members "
                           "are supported: rewrite it with numpy.savez")
    try:
        with z.open(info) as f:
            shape, dtype, fortran = _read_npy_header(f, where)
            header_len = f.tell()
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise DatasetError(f"{where}: cannot read the member ({e}); the archive is corrupt: "
                           "re-download or rewrite it") from e
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if info.file_size != header_len + nbytes:
        raise DatasetError(f"{where}: the .npy header says shape {shape} {dtype} "
                           f"({nbytes} bytes of data) but the member holds "
                           f"{info.file_size - header_len}; the archive is corrupt: rewrite it")
    if info.compress_type != zipfile.ZIP_STORED:
        return shape, dtype, fortran, False, None
    fp = z.fp
    assert fp is not None
    fp.seek(info.header_offset)
    raw = fp.read(_LOCAL.size)
    if len(raw) != _LOCAL.size or _LOCAL.unpack(raw)[0] != _LOCAL_SIG:
        raise DatasetError(f"{where}: bad local zip header at byte {info.header_offset}; the "
                           "archive is corrupt: re-download or rewrite it")
    fields = _LOCAL.unpack(raw)
    data_offset = info.header_offset + _LOCAL.size + fields[9] + fields[10] + header_len
    file_size = os.fstat(fp.fileno()).st_size
    if data_offset + nbytes > file_size:
        raise DatasetError(f"{where}: the member's data ends at byte {data_offset + nbytes} "
                           f"but the file has {file_size} bytes; it is truncated: re-download "
                           "or rewrite it")
    return shape, dtype, fortran, True, data_offset


def npy_member_info(npz_path, member: str):
    """``(shape, dtype, stored, data_offset)`` of ``member`` (with or without ``.npy``) of
    the archive ``npz_path``, read from the zip directory and the ``.npy`` header only.
    ``stored`` is True for an uncompressed member; ``data_offset`` is the file offset of
    its first array byte then (None for a deflated member). Raises :class:`DatasetError`
    naming the file on a missing member or a corrupt / truncated archive."""
    path = Path(npz_path)
    with _open_zip(path) as z:
        info = _zip_info(z, path, member)
        shape, dtype, _, stored, off = _member_layout(z, info, path, f"{path} member {member!r}")
    return shape, dtype, stored, off


class NpyMemberReader:
    """Chunked access to one array member of an ``.npz`` archive (see the module docstring).

    ``shape``, ``dtype``, ``stored`` (uncompressed member), ``data_offset`` (file offset of
    the array data when stored), ``nbytes``. The first axis is the row axis: ``rows(a, b)``
    is ``arr[a:b]``; for a 2-D ``[R, C]`` member ``row_slice(r, lo, hi)`` is
    ``arr[r, lo:hi]`` (one row of ``edge_index [2, E]``). Fortran-order members are readable
    when stored (as a map) and refused when deflated.
    """

    def __init__(self, npz_path, member: str):
        self.path = Path(npz_path)
        self.member = member[:-4] if member.endswith(".npy") else member
        self.where = f"{self.path} member {self.member!r}"
        self._zip: zipfile.ZipFile | None = None
        self._stream: IO[bytes] | None = None  # deflated: the open ZipExtFile
        self._pos = 0  # deflated: byte position in the array data of _stream
        self._mmap: mmap.mmap | None = None
        self._arr: np.ndarray | None = None
        self._fd: int | None = None
        z = _open_zip(self.path)
        try:
            self._info = _zip_info(z, self.path, self.member)
            shape, dtype, fortran, stored, off = _member_layout(z, self._info, self.path,
                                                                self.where)
        except BaseException:
            z.close()
            raise
        self.shape: tuple[int, ...] = shape
        self.dtype: np.dtype = dtype
        self.fortran_order = fortran
        self.stored = stored
        self.data_offset: int | None = off
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if stored:
            z.close()
            self._fd = os.open(self.path, os.O_RDONLY)
        else:
            if fortran and len(shape) > 1:
                z.close()
                raise DatasetError(f"{self.where} is a deflated Fortran-order array; it cannot "
                                   "be streamed by rows: rewrite it in C order (numpy.savez of "
                                   "np.ascontiguousarray(a))")
            self._zip = z

    # -- geometry ------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    def _check_range(self, start: int, stop: int, n: int, what: str) -> tuple[int, int]:
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= n:
            raise IndexError(f"{self.where}: {what} [{start}, {stop}) is outside [0, {n})")
        return start, stop

    def _check_2d(self, r: int) -> None:
        if len(self.shape) != 2 or not 0 <= r < self.shape[0]:
            raise IndexError(f"{self.where}: row_slice({r}, ...) needs a 2-D member and a row "
                             f"in [0, {self.shape[0] if self.shape else 0}); shape is "
                             f"{self.shape}")

    # -- stored: memory map ---------------------------------------------------------------
    def _map(self) -> np.ndarray:
        """The whole member as a read-only array over a private map (created once)."""
        if self._arr is None:
            assert self._fd is not None and self.data_offset is not None
            gran = mmap.ALLOCATIONGRANULARITY
            base = self.data_offset - self.data_offset % gran
            length = self.data_offset - base + self.nbytes
            if length == 0 or self.nbytes == 0:
                self._arr = np.empty(self.shape, dtype=self.dtype)
            else:
                self._mmap = mmap.mmap(self._fd, length, access=mmap.ACCESS_READ, offset=base)
                self._arr = np.ndarray(self.shape, dtype=self.dtype, buffer=self._mmap,
                                       offset=self.data_offset - base,
                                       order="F" if self.fortran_order else "C")
        return self._arr

    def release(self) -> None:
        """Drop the pages that views from :meth:`rows` / :meth:`row_slice` touched from this
        process's resident set (they stay in the page cache; later access re-reads them).
        Views stay valid. A no-op for deflated members."""
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def _pread_into(self, out: np.ndarray, offset: int) -> None:
        """Fill ``out`` (C-contiguous) from file offset ``offset`` with plain reads."""
        assert self._fd is not None
        view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        done = 0
        while done < view.nbytes:
            step = min(_IO_BYTES, view.nbytes - done)
            got = os.preadv(self._fd, [view[done: done + step]], offset + done)
            if got <= 0:
                raise DatasetError(f"{self.where}: the file ended at byte {offset + done}; it "
                                   "is truncated: re-download or rewrite it")
            done += got

    # -- deflated: stream -----------------------------------------------------------------
    def _wrap(self, e: BaseException, action: str) -> DatasetError:
        return DatasetError(f"{self.where}: {action} failed ({type(e).__name__}: {e}); the "
                            "archive is truncated or corrupt: re-download or rewrite it")

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _seek(self, pos: int) -> IO[bytes]:
        """The inflating stream positioned at array byte ``pos`` (restarted from the
        member's start when ``pos`` lies behind it)."""
        assert self._zip is not None
        try:
            if self._stream is None or pos < self._pos:
                self._drop_stream()
                self._stream = self._zip.open(self._info)
                _read_npy_header(self._stream, self.where)
                self._pos = 0
            stream = self._stream
            while self._pos < pos:  # inflate and discard
                step = min(_IO_BYTES, pos - self._pos)
                got = stream.read(step)
                if len(got) != step:
                    raise EOFError(f"member data ended at byte {self._pos + len(got)}")
                self._pos += step
            return stream
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            self._drop_stream()
            raise self._wrap(e, f"inflating up to byte {pos}") from e

    def _stream_into(self, out: np.ndarray, pos: int) -> None:
        stream = self._seek(pos)
        view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        done = 0
        try:
            while done < view.nbytes:
                step = min(_IO_BYTES, view.nbytes - done)
                got = stream.readinto(view[done: done + step])  # type: ignore[attr-defined]
                if not got:
                    raise EOFError(f"member data ended at byte {pos + done} of {self.nbytes}")
                done += got
            self._pos = pos + done
            if self._pos == self.nbytes:  # at the end: make zipfile check the CRC-32
                if stream.read(1):
                    raise zipfile.BadZipFile("data continues past the array's end")
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            self._drop_stream()
            raise self._wrap(e, f"reading bytes {pos}..{pos + view.nbytes}") from e

    # -- reading --------------------------------------------------------------------------
    def _read_bytes_at(self, out: np.ndarray, pos: int) -> np.ndarray:
        if out.nbytes:
            if self.stored:
                assert self.data_offset is not None
                self._pread_into(out, self.data_offset + pos)
            else:
                self._stream_into(out, pos)
        return out

    def rows(self, start: int, stop: int) -> np.ndarray:
        """``arr[start:stop]``. Stored: a zero-copy view of the map (its pages count in RSS
        once touched, until :meth:`release`); deflated: a new array, read forward from the
        stream's position."""
        start, stop = self._check_range(start, stop, self.num_rows, "rows")
        if self.stored:
            return self._map()[start:stop]
        return self.read_rows(start, stop)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """``arr[start:stop]`` as a new array (plain reads; nothing stays mapped)."""
        start, stop = self._check_range(start, stop, self.num_rows, "rows")
        if self.fortran_order and len(self.shape) > 1:
            return np.array(self._map()[start:stop], order="C")
        out = np.empty((stop - start, *self.row_shape), dtype=self.dtype)
        return self._read_bytes_at(out, start * self.row_bytes)

    def row_slice(self, r: int, lo: int, hi: int) -> np.ndarray:
        """``arr[r, lo:hi]`` of a 2-D member (a view when stored, see :meth:`rows`)."""
        self._check_2d(r)
        lo, hi = self._check_range(lo, hi, self.shape[1], f"row {r} columns")
        if self.stored:
            return self._map()[r, lo:hi]
        return self.read_row_slice(r, lo, hi)

    def read_row_slice(self, r: int, lo: int, hi: int) -> np.ndarray:
        """``arr[r, lo:hi]`` as a new array."""
        self._check_2d(r)
        lo, hi = self._check_range(lo, hi, self.shape[1], f"row {r} columns")
        if self.fortran_order:
            return np.array(self._map()[r, lo:hi])
        out = np.empty(hi - lo, dtype=self.dtype)
        return self._read_bytes_at(out, (r * self.shape[1] + lo) * self.dtype.itemsize)

    def iter_rows(self, chunk: int, start: int = 0, stop: int | None = None
                  ) -> Iterator[np.ndarray]:
        """Consecutive new arrays ``arr[s:s + chunk]`` over ``[start, stop)`` (default: all
        rows). Memory: one chunk; works for stored and deflated members alike."""
        stop = self.num_rows if stop is None else stop
        start, stop = self._check_range(start, stop, self.num_rows, "rows")
        chunk = max(1, int(chunk))
        for s in range(start, stop, chunk):
            yield self.read_rows(s, min(stop, s + chunk))

    def iter_row_slices(self, r: int, chunk: int, lo: int = 0, hi: int | None = None
                        ) -> Iterator[np.ndarray]:
        """Consecutive new arrays ``arr[r, s:s + chunk]`` of a 2-D member over
        ``[lo, hi)``. For ``edge_index`` open one reader per row: a deflated member is one
        stream, and two rows read alternately from one reader would restart it each time."""
        self._check_2d(r)
        hi = self.shape[1] if hi is None else hi
        lo, hi = self._check_range(lo, hi, self.shape[1], f"row {r} columns")
        chunk = max(1, int(chunk))
        for s in range(lo, hi, chunk):
            yield self.read_row_slice(r, s, min(hi, s + chunk))

    def take(self, ids: np.ndarray, block: int = 1 << 16) -> np.ndarray:
        """``arr[ids]`` (rows) as a new array; stored members only. Gathers through the map
        by blocks of ids and drops the touched pages after each block (:meth:`release`), so
        RSS grows by the result only."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not self.stored:
            raise DatasetError(f"{self.where} is deflated (numpy.savez_compressed): rows cannot "
                               "be gathered at random; stream it with iter_rows, or rewrite "
                               "the archive uncompressed (numpy.savez)")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            raise IndexError(f"{self.where}: ids span [{ids.min()}, {ids.max()}] outside "
                             f"[0, {self.num_rows})")
        arr = self._map()
        out = np.empty((ids.shape[0], *self.row_shape), dtype=self.dtype)
        for s in range(0, ids.shape[0], block):
            np.take(arr, ids[s: s + block], axis=0, out=out[s: s + block])
            self.release()
        return out

    def close(self) -> None:
        """Close the file, map and stream (views from :meth:`rows` must not be used after)."""
        self._drop_stream()
        if self._zip is not None:
            self._zip.close()
            self._zip = None
        self._arr = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still alive: the map closes when it dies
                pass
            self._mmap = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> NpyMemberReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        kind = "stored" if self.stored else "deflated"
        return f"NpyMemberReader({self.where}, shape={self.shape}, dtype={self.dtype}, {kind})"


# ---------------------------------------------------------------------------------------
# writing


def _npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The ``.npy`` header bytes (magic, version, padded dict) for a C-order array."""
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
         "shape": tuple(shape)}
    buf = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buf, d)
    except ValueError:  # header longer than 64 KiB: format 2.0
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, d)
    return buf.getvalue()


def _dos_time(t: float) -> tuple[int, int]:
    lt = time.localtime(t)
    year = max(lt.tm_year, 1980)
    dos_date = ((year - 1980) << 9) | (lt.tm_mon << 5) | lt.tm_mday
    dos_time = (lt.tm_hour << 11) | (lt.tm_min << 5) | (lt.tm_sec // 2)
    return dos_time, dos_date


class _Entry:
    __slots__ = ("name", "header_offset", "size", "crc")

    def __init__(self, name: bytes, header_offset: int, size: int):
        self.name, self.header_offset, self.size, self.crc = name, header_offset, size, 0


class _MemberBase:
    """A member being written: header laid out, data filled by the subclass."""

    def __init__(self, writer: NpzWriter, name: str, shape, dtype):
        self.writer = writer
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in self.shape):
            raise NpzWriteError(f"{writer.path}: member {name!r} shape {self.shape} has a "
                                "negative dimension")
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject:
            raise NpzWriteError(f"{writer.path}: member {name!r} dtype {self.dtype} holds "
                                "Python objects; write a numeric dtype")
        self.count = int(np.prod(self.shape, dtype=np.int64))
        self.header = _npy_header(self.shape, self.dtype)
        self.entry, self.data_start = writer._begin(name, len(self.header),
                                                    self.count * self.dtype.itemsize)
        self.written = 0  # elements
        self.crc = zlib.crc32(self.header)
        writer._f.write(self.header)

    def _as_chunk(self, chunk) -> np.ndarray:
        a = np.asarray(chunk)
        if a.dtype != self.dtype:
            if not np.can_cast(a.dtype, self.dtype, casting="same_kind"):
                raise NpzWriteError(f"{self.writer.path}: member {self.name!r} is {self.dtype}; "
                                    f"a chunk of dtype {a.dtype} cannot be cast to it safely")
            a = a.astype(self.dtype)
        return np.ascontiguousarray(a)

    def _finish(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.writer._abort_member()
            return
        self._finish()


class _Member(_MemberBase):
    """C-order chunks appended in order; see :meth:`NpzWriter.member`."""

    def write(self, chunk) -> None:
        """Append the elements of ``chunk`` (C order; typically ``[r, *shape[1:]]`` rows)."""
        a = self._as_chunk(chunk)
        if self.written + a.size > self.count:
            raise NpzWriteError(f"{self.writer.path}: member {self.name!r} of shape "
                                f"{self.shape} holds {self.count} elements; this chunk of "
                                f"{a.size} would bring it to {self.written + a.size}")
        buf = memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        self.crc = zlib.crc32(buf, self.crc)
        self.writer._f.write(buf)
        self.written += a.size

    def _finish(self) -> None:
        if self.written != self.count:
            self.writer._abort_member()
            raise NpzWriteError(f"{self.writer.path}: member {self.name!r} of shape "
                                f"{self.shape} needs {self.count} elements but {self.written} "
                                "were written")
        self.writer._end(self.entry, self.crc)


class _ColumnMember(_MemberBase):
    """A 2-D ``[R, C]`` member written by column chunks; see :meth:`NpzWriter.member_columns`."""

    def __init__(self, writer, name, shape, dtype):
        if len(tuple(shape)) != 2:
            raise NpzWriteError(f"{writer.path}: member_columns({name!r}) needs a 2-D shape "
                                f"such as (2, E), got {tuple(shape)}")
        super().__init__(writer, name, shape, dtype)
        self.columns = 0
        self.writer._f.truncate(self.data_start + self.count * self.dtype.itemsize)

    def write(self, chunk) -> None:
        """Append columns: ``chunk`` is ``[R, k]`` (e.g. ``np.stack([src, dst])``)."""
        a = self._as_chunk(chunk)
        r, c = self.shape
        if a.ndim != 2 or a.shape[0] != r:
            raise NpzWriteError(f"{self.writer.path}: member {self.name!r} takes column chunks "
                                f"of shape ({r}, k); got {a.shape}")
        self._put(a)

    def write_rows(self, *rows) -> None:
        """Append columns given as one 1-D array per row (``write_rows(src, dst)``)."""
        r = self.shape[0]
        if len(rows) != r:
            raise NpzWriteError(f"{self.writer.path}: member {self.name!r} has {r} rows; "
                                f"write_rows got {len(rows)} arrays")
        arrs = [self._as_chunk(x).reshape(-1) for x in rows]
        if len({x.shape[0] for x in arrs}) != 1:
            raise NpzWriteError(f"{self.writer.path}: member {self.name!r}: write_rows arrays "
                                f"differ in length ({[x.shape[0] for x in arrs]})")
        self._put(arrs)

    def _put(self, rows) -> None:
        r, c = self.shape
        k = rows[0].shape[0]
        if self.columns + k > c:
            raise NpzWriteError(f"{self.writer.path}: member {self.name!r} has {c} columns; "
                                f"this chunk of {k} would bring it to {self.columns + k}")
        f = self.writer._f
        item = self.dtype.itemsize
        for i in range(r):
            f.seek(self.data_start + (i * c + self.columns) * item)
            f.write(memoryview(np.ascontiguousarray(rows[i]).view(np.uint8)))  # type: ignore[arg-type]
        self.columns += k
        self.written = self.columns * r

    def _finish(self) -> None:
        r, c = self.shape
        if self.columns != c:
            self.writer._abort_member()
            raise NpzWriteError(f"{self.writer.path}: member {self.name!r} of shape "
                                f"{self.shape} needs {c} columns but {self.columns} were "
                                "written")
        f = self.writer._f
        f.flush()
        fd = f.fileno()
        end = self.data_start + self.count * self.dtype.itemsize
        crc = self.crc
        pos = self.data_start
        buf = bytearray(min(_IO_BYTES, max(1, end - pos)))
        view = memoryview(buf)
        while pos < end:  # one sequential pass over the finished member for its CRC-32
            step = min(len(buf), end - pos)
            got = os.preadv(fd, [view[:step]], pos)
            if got <= 0:
                raise NpzWriteError(f"{self.writer.path}: re-reading member {self.name!r} for "
                                    f"its CRC-32 stopped at byte {pos} of {end}")
            crc = zlib.crc32(view[:got], crc)
            pos += got
        f.seek(end)
        self.writer._end(self.entry, crc)


class NpzWriter:
    """Write an uncompressed (``ZIP_STORED``), zip64 ``.npz`` archive member by member.

    ::

        with NpzWriter(out / "data.npz") as w:
            w.add("num_nodes_list", np.array([n], dtype=np.int64))
            with w.member("node_feat", (n, d), np.float32) as m:
                for block in blocks:          # [r, d] each, in node order
                    m.write(block)
            with w.member_columns("edge_index", (2, e), np.int64) as m:
                for src, dst in edge_chunks:  # columns in edge order
                    m.write_rows(src, dst)

    ``np.load`` (and :class:`NpyMemberReader`) read the result. One member is open at a
    time; a member must receive exactly ``prod(shape)`` elements (checked when its ``with``
    block ends). The archive appears at ``path`` only when the writer closes without error
    (it is written to ``path + ".tmp"`` and renamed); on an exception the temporary file
    is removed. Chunks of another dtype are cast when numpy's ``same_kind`` rule allows it.
    """

    def __init__(self, path):
        self.path = Path(path)
        if self.path.suffix != ".npz":
            raise NpzWriteError(f"{self.path}: an npz archive needs a .npz suffix (np.load "
                                "and ogb look for e.g. data.npz)")
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._f = open(self._tmp, "w+b")  # noqa: SIM115 -- closed in close()/abort()
        self._entries: list[_Entry] = []
        self._names: set[str] = set()
        self._open: _MemberBase | None = None
        self._time = _dos_time(time.time())
        self._closed = False
        self._failed = False

    # -- members --------------------------------------------------------------------------
    def _begin(self, name: str, header_len: int, data_len: int) -> tuple[_Entry, int]:
        """Write the local header of member ``name`` (npy header + data = its size); return
        its entry and the file offset where the array data will start."""
        size = header_len + data_len
        if self._closed:
            raise NpzWriteError(f"{self.path}: the writer is closed")
        if self._open is not None:
            raise NpzWriteError(f"{self.path}: member {self._open.name!r} is still open; finish "
                                f"its with-block before starting {name!r}")
        if not name or "/" in name or name in self._names:
            raise NpzWriteError(f"{self.path}: member name {name!r} is empty, has a '/', or is "
                                "already written")
        fname = _member_name(name).encode("utf-8")
        offset = self._f.seek(0, os.SEEK_END)
        zip64 = struct.pack("<HHQQ", _ZIP64_ID, 16, size, size)
        base = offset + _LOCAL.size + len(fname) + len(zip64) + 4
        pad = (-base) % _ALIGN  # array data of a 64-padded .npy header lands 64-aligned
        extra = zip64 + struct.pack("<HH", _PAD_ID, pad) + b"\0" * pad
        t, d = self._time
        self._f.write(_LOCAL.pack(_LOCAL_SIG, _VERSION, 0, zipfile.ZIP_STORED, t, d, 0,
                                  _U32, _U32, len(fname), len(extra)))
        self._f.write(fname)
        self._f.write(extra)
        entry = _Entry(fname, offset, size)
        self._names.add(name)
        return entry, self._f.tell() + header_len

    def member(self, name: str, shape, dtype) -> _Member:
        """A context manager whose ``write(chunk)`` appends C-order chunks to the member
        ``name`` of the given shape and dtype (see the class docstring)."""
        m = _Member(self, name, shape, dtype)
        self._open = m
        return m

    def member_columns(self, name: str, shape, dtype) -> _ColumnMember:
        """A context manager for a 2-D ``[R, C]`` member (``edge_index [2, E]``) written by
        column chunks: ``write(chunk [R, k])`` or ``write_rows(row0, row1, ...)`` puts each
        row's ``k`` values at their place in the member. The CRC-32 is computed by one
        sequential read of the member when the block ends."""
        m = _ColumnMember(self, name, shape, dtype)
        self._open = m
        return m

    def add(self, name: str, array) -> None:
        """Write a whole (small) array as member ``name``."""
        a = np.asarray(array)
        if a.dtype.hasobject:
            raise NpzWriteError(f"{self.path}: member {name!r} holds Python objects")
        with self.member(name, a.shape, a.dtype) as m:
            m.write(a)

    def _end(self, entry: _Entry, crc: int) -> None:
        entry.crc = crc & _U32
        here = self._f.tell()
        self._f.seek(entry.header_offset + 14)  # the local header's CRC-32 field
        self._f.write(struct.pack("<I", entry.crc))
        self._f.seek(here)
        self._entries.append(entry)
        self._open = None

    def _abort_member(self) -> None:
        self._open = None
        self._failed = True

    # -- finishing ------------------------------------------------------------------------
    def close(self) -> None:
        """Write the central directory and move the archive into place."""
        if self._closed:
            return
        if self._open is not None or self._failed:
            self.abort()
            raise NpzWriteError(f"{self.path}: a member was left unfinished; the archive was "
                                "not written")
        f = self._f
        cd_start = f.seek(0, os.SEEK_END)
        t, d = self._time
        for e in self._entries:
            extra = struct.pack("<HHQQQ", _ZIP64_ID, 24, e.size, e.size, e.header_offset)
            f.write(_CENTRAL.pack(_CENTRAL_SIG, _VERSION, _VERSION, 0, zipfile.ZIP_STORED, t, d,
                                  e.crc, _U32, _U32, len(e.name), len(extra), 0, 0, 0,
                                  0o644 << 16, _U32))
            f.write(e.name)
            f.write(extra)
        cd_end = f.tell()
        n = len(self._entries)
        f.write(_EOCD64.pack(_EOCD64_SIG, _EOCD64.size - 12, _VERSION, _VERSION, 0, 0, n, n,
                             cd_end - cd_start, cd_start))
        f.write(_LOCATOR64.pack(_LOCATOR64_SIG, 0, cd_end, 1))
        f.write(_EOCD.pack(_EOCD_SIG, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                           min(cd_end - cd_start, _U32), min(cd_start, _U32), 0))
        f.close()
        os.replace(self._tmp, self.path)
        self._closed = True

    def abort(self) -> None:
        """Discard the archive (the temporary file is removed; ``path`` is untouched)."""
        if self._closed:
            return
        self._closed = True
        self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> NpzWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
