"""Where a partition set is written: checks on ``--out``, the atomic write, and ``--force``.

A set is written into a fresh hidden directory beside ``out`` (``.OUTNAME.tmp-<random>`` in the
same parent) and renamed to ``out`` only once it is complete. Replacing an existing set
(``overwrite=True``, ``--force``) renames the old set aside (``.OUTNAME.old-<random>``), renames
the new one into place, then deletes the old one. Any failure removes the temporary directory
(and parent directories it created), so a failed write leaves nothing behind and the old set,
if any, untouched.

``--force`` only ever deletes what a set's metadata.json lists: its parts' directories
(``parts[i].dir``) holding the layout's ``.npy`` files, and the known top-level files. A
directory holding anything else is refused, naming the unexpected entries.

One exception: when ``out`` is an existing directory that is a mount point, or whose parent is
not writable, the set is written directly into it (a rename could not move it there); an old
set there is then deleted first, and on failure whatever was written is removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from common.errors import MfgServeError
from partition import layout

__all__ = ["PartitionError", "is_partition_set", "clear_partition_set", "check_out",
           "staged_out", "describe_os_error"]

KNOWN_FILES = (layout.METADATA_FILE, "orig_to_new.npy", layout.HOT_RANK_FILE,
               layout.NODE_TYPE_FILE, layout.METADATA_FILE + ".tmp")
_PART_FILES = frozenset(f"{a}.npy" for a in
                        layout.PART_ARRAYS + layout.HALO_ARRAYS + layout.TYPED_ARRAYS)


class PartitionError(MfgServeError, ValueError):
    """Partitioning cannot proceed; the message names the cause and what to change."""


def is_partition_set(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a ``metadata.json`` of this layout (any version)."""
    return _read_metadata(Path(path)) is not None


def _read_metadata(root: Path) -> dict | None:
    try:
        raw = json.loads((root / layout.METADATA_FILE).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == layout.FORMAT_NAME else None


def _listed_part_dirs(raw: dict) -> set[str]:
    """The ``parts[i].dir`` names of a metadata dict: plain names only, never a path."""
    dirs = set()
    for p in raw.get("parts") or []:
        d = p.get("dir") if isinstance(p, dict) else None
        if isinstance(d, str) and d not in ("", ".", "..") and "/" not in d and os.sep not in d:
            dirs.add(d)
    return dirs


def unexpected_entries(root: Path) -> list[str]:
    """Entries of the set at ``root`` that its metadata does not account for (sorted)."""
    raw = _read_metadata(root) or {}
    dirs = _listed_part_dirs(raw)
    odd = []
    for child in root.iterdir():
        if child.name in dirs and child.is_dir() and not child.is_symlink():
            odd += [f"{child.name}/{f.name}" for f in child.iterdir()
                    if f.name not in _PART_FILES or not f.is_file() or f.is_symlink()]
        elif child.name not in KNOWN_FILES or child.is_dir():
            odd.append(child.name + ("/" if child.is_dir() else ""))
    return sorted(odd)


def clear_partition_set(path: str | os.PathLike) -> None:
    """Delete a partition set's files (metadata.json first, so it never looks complete).

    Only what the metadata lists is deleted; a set holding anything else is refused."""
    root = Path(path)
    raw = _read_metadata(root)
    if raw is None:
        raise PartitionError(f"{root} is not a partition set; refusing to delete anything in it")
    odd = unexpected_entries(root)
    if odd:
        raise PartitionError(_unexpected_message(root, odd))
    (root / layout.METADATA_FILE).unlink()
    for d in _listed_part_dirs(raw):
        if (root / d).is_dir():
            shutil.rmtree(root / d)
    for name in KNOWN_FILES:
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()


def _unexpected_message(out: Path, odd: list[str]) -> str:
    shown = ", ".join(odd[:8]) + (f" (and {len(odd) - 8} more)" if len(odd) > 8 else "")
    return (f"--out {out} holds entries that are not part of its partition set: {shown}; "
            "--force replaces only a partition set's own files and never deletes anything "
            "else: move those entries elsewhere, or choose another --out")


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _direct(out: Path) -> bool:
    """Write straight into ``out`` (an existing dir a rename cannot replace)?"""
    if not out.is_dir():
        return False
    parent = Path(os.path.abspath(out)).parent
    return os.path.ismount(out) or not os.access(parent, os.W_OK | os.X_OK)


def check_out(out: str | os.PathLike, overwrite: bool) -> None:
    """Raise :class:`PartitionError` unless a set can be written at ``out``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PartitionError(f"--out {out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()):
        if not is_partition_set(out):
            raise PartitionError(
                f"--out {out} is not empty and is not a partition set; refusing to write into "
                "it: choose an empty or new directory")
        if not overwrite:
            raise PartitionError(
                f"--out {out} already holds a partition set; pass --force to overwrite it, or "
                "choose another --out")
        odd = unexpected_entries(out)
        if odd:
            raise PartitionError(_unexpected_message(out, odd))
    where = out if _direct(out) else _nearest_existing(Path(os.path.abspath(out)).parent)
    if not where.is_dir():
        raise PartitionError(
            f"--out {out}: {where} is a file, not a directory, so nothing can be created under "
            "it; choose another --out")
    if not os.access(where, os.W_OK | os.X_OK):
        raise PartitionError(
            f"--out {out}: {where} is not writable (a read-only filesystem, or no permission); "
            "choose an --out on a filesystem and in a directory you can write to")


def describe_os_error(e: OSError, what: str) -> str:
    """One line: what failed, on which path, why, and what to change."""
    hints = {
        errno.ENOSPC: "the filesystem is full: free space there, or choose a path on another "
                      "filesystem",
        errno.EDQUOT: "the disk quota is exhausted: free space, or choose another path",
        errno.EROFS: "the filesystem is read-only: choose a path on a writable filesystem",
        errno.EACCES: "no permission to write there: choose a directory you can write to",
        errno.EPERM: "no permission to write there: choose a directory you can write to",
        errno.ENOTDIR: "a component of the path is a regular file: choose another path",
        errno.EEXIST: "something already exists at that path: choose another path",
    }
    where = f" ({e.filename})" if e.filename else ""
    hint = hints.get(e.errno or 0, "check that path, its free space and permissions, or choose "
                              "another path")
    return f"{what}: {e.strerror or e}{where}; {hint}"


def _make_parents(parent: Path, created: list[Path]) -> None:
    """``mkdir -p parent``, appending each directory it creates (outermost first) to
    ``created``, so that a failure half-way can still remove them."""
    missing = []
    p = Path(os.path.abspath(parent))
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir()
        created.append(d)


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    if not (out.is_dir() and any(out.iterdir())):
        os.replace(tmp, out)  # out is new, or an empty directory
        return
    check_out(out, overwrite)  # still a set we may replace (it may have changed meanwhile)
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    try:
        clear_partition_set(old)
        old.rmdir()
    except (OSError, PartitionError) as e:
        print(f"warning: the replaced partition set, moved aside to {old}, could not be "
              f"deleted ({e}); delete it yourself", file=sys.stderr)


@contextlib.contextmanager
def staged_out(out: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yield the directory to write a set into; on success it becomes ``out`` (module doc).

    On failure nothing written is left behind; an OSError becomes a :class:`PartitionError`
    saying what failed and what to change."""
    shown = Path(out)
    check_out(shown, overwrite)
    # absolute (so that "--out ." has a name and a parent); a symlink: write where it points,
    # never replace the link itself
    out = Path(os.path.realpath(shown) if shown.is_symlink() else os.path.abspath(shown))
    direct = _direct(out)
    created: list[Path] = []
    cleared = False
    tmp = out if direct else out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        if direct:
            if any(out.iterdir()):
                cleared = True
                clear_partition_set(out)
        else:
            _make_parents(out.parent, created)
            os.mkdir(tmp)
        yield tmp
        if not direct:
            _move_into_place(tmp, out, overwrite)
    except BaseException as e:
        _discard(tmp, direct, created)
        if isinstance(e, OSError):
            left = ("its old set was deleted first, as a rename cannot replace it there; "
                    "nothing new was left behind" if cleared else "nothing was left behind")
            raise PartitionError(describe_os_error(
                e, f"writing the partition set to --out {shown} failed ({left})")) from e
        raise


def _discard(tmp: Path, direct: bool, created: list[Path]) -> None:
    if direct:  # empty before we wrote into it (an old set was cleared first)
        for child in list(tmp.iterdir()) if tmp.is_dir() else []:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    child.unlink()
        return
    shutil.rmtree(tmp, ignore_errors=True)
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()
