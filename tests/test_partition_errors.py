"""Bad inputs to the partition tool and to partition loading (issue #9), with real processes.

Every bad input makes ``partition-ogbn`` (or ``sampler-server``) exit with code 2 and a message
naming the file, never a traceback; a failed write leaves nothing behind and a later run
works; ``--force`` deletes only the partition set's own files; every written set carries a
fresh ``set_id``.

Read-only and full filesystems are real mounts in a private mount namespace (``unshare -m``,
root); where that is unavailable those tests are skipped.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from partition.graph_data import DatasetError, GraphData
from partition.layout import PartitionFormatError, PartitionSetMeta, load_hot_rank, load_partition
from partition.partitioner import partition_graph
from partition.synthetic import generate, write_ogb_raw

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--dataset", "synthetic", "--num-nodes", "200", "--avg-degree", "4", "--feat-dim", "4",
         "--num-classes", "3", "--method", "random", "--presample-batches", "0", "--no-progress"]
# ~1 MiB of features: more than the 1 MiB tmpfs of the full-filesystem test holds
BIG = [*SMALL[:2], "--num-nodes", "4000", *SMALL[4:6], "--feat-dim", "64", *SMALL[8:]]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _cli(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "partition.cli", *map(str, args)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _assert_exit_2(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "partition-ogbn: error:" in r.stderr, r.stderr[-3000:]
    for needle in needles:
        assert needle in r.stderr, f"{needle!r} not in:\n{r.stderr[-3000:]}"


def _summary(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _tiny_raw(path: Path) -> Path:
    """A 40-node dataset in OGB raw layout."""
    rng = np.random.default_rng(0)
    n = 40
    g = GraphData(name="tiny", num_nodes=n, src=rng.integers(0, n, 120),
                  dst=rng.integers(0, n, 120),
                  feat=rng.standard_normal((n, 3)).astype(np.float32),
                  label=rng.integers(0, 3, n), train=np.arange(20), valid=np.arange(20, 30),
                  test=np.arange(30, 40), num_classes=3)
    write_ogb_raw(g, path, progress=False)
    return path


def _split_dir(raw: Path) -> Path:
    return raw / "split" / str(json.loads((raw / "meta.json").read_text())["split"])


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d],
                           capture_output=True, timeout=30)
    return r.returncode == 0


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs `unshare -m` and mount (root)")


def _in_mount_ns(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "-m", "sh", "-ec", script], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# ----------------------------------------------------------------------- 1. non-finite features


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", ["nan", "-inf"])
def test_non_finite_feature_rejected_naming_file_and_row(tmp_path, bad):
    raw = _tiny_raw(tmp_path / "raw")
    feat_file = raw / "raw" / "node-feat.csv.gz"
    with gzip.open(feat_file, "rt") as f:
        lines = f.read().splitlines()
    lines[17] = f"0.5,{bad},1.0"
    lines[30] = "nan,nan,nan"  # only the first bad row is named
    with gzip.open(feat_file, "wt") as f:
        f.write("\n".join(lines) + "\n")
    r = _cli("--dataset-dir", raw, "--method", "random", "--presample-batches", "0",
             "--out", tmp_path / "parts")
    _assert_exit_2(r, str(feat_file), "row 17", "non-finite")
    assert not (tmp_path / "parts").exists()


@pytest.mark.timeout(30)
def test_non_finite_check_is_chunked(monkeypatch):
    """The check walks the rows in chunks; the first bad row is found past the first chunk."""
    import partition.graph_data as gd

    monkeypatch.setattr(gd, "_FINITE_CHUNK", 8)  # 2 rows of 4 values per step
    g = generate(50, avg_degree=2, feat_dim=4, num_classes=2, progress=False)
    g.feat[37, 2] = np.inf
    g.feat[45, 0] = np.nan
    g.feat_source = "/data/x/node-feat.csv.gz"
    with pytest.raises(DatasetError, match=r"/data/x/node-feat.csv.gz: row 37 .*column 2"):
        g.validate()


# ----------------------------------------------------------------------- 2. exit code 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content", [b"", gzip.compress(b"")], ids=["zero-bytes", "empty-gzip"])
def test_empty_split_file_exit_2(tmp_path, content):
    raw = _tiny_raw(tmp_path / "raw")
    train = _split_dir(raw) / "train.csv.gz"
    train.write_bytes(content)
    r = _cli("--dataset-dir", raw, "--method", "random", "--out", tmp_path / "parts")
    _assert_exit_2(r, str(train), "empty", "one per line")
    assert not (tmp_path / "parts").exists()


@pytest.mark.timeout(60)
def test_out_under_a_regular_file_exit_2(tmp_path):
    (tmp_path / "somefile").write_text("not a directory")
    r = _cli(*SMALL, "--out", tmp_path / "somefile" / "parts")
    _assert_exit_2(r, str(tmp_path / "somefile"), "not a directory", "choose another --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somefile"]


@needs_mount
@pytest.mark.timeout(120)
def test_out_on_read_only_filesystem_exit_2(tmp_path):
    """A read-only bind mount: a new --out below it, and --force over a set on it."""
    ro = tmp_path / "ro"
    _summary(_cli(*SMALL, "--out", ro / "set"))
    before = (ro / "set" / "metadata.json").read_text()
    py = f"{sys.executable} -m partition.cli {' '.join(SMALL)}"
    script = (f"mount --bind {ro} {ro}; mount -o remount,bind,ro {ro}\n"
              f"{py} --out {ro}/new 2> {tmp_path}/new.err || echo new=$?\n"
              f"{py} --out {ro}/set --force 2> {tmp_path}/force.err || echo force=$?\n")
    r = _in_mount_ns(script)
    assert r.returncode == 0, r.stderr
    assert "new=2" in r.stdout and "force=2" in r.stdout, r.stdout
    for name in ("new", "force"):
        err = (tmp_path / f"{name}.err").read_text()
        assert "read-only" in err and str(ro) in err and "Traceback" not in err, err
    assert sorted(p.name for p in ro.iterdir()) == ["set"]
    assert (ro / "set" / "metadata.json").read_text() == before


@needs_mount
@pytest.mark.timeout(120)
def test_full_filesystem_leaves_nothing_behind(tmp_path):
    """ENOSPC mid-write on a 1 MiB tmpfs: exit 2, no temporary files, the old set untouched,
    and later runs (with and without --force) work."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    py = f"{sys.executable} -m partition.cli"
    small, big = " ".join(SMALL), " ".join(BIG)
    script = (f"mount -t tmpfs -o size=1m tmpfs {mnt}\n"
              f"{py} {small} --out {mnt}/x > {tmp_path}/first.json\n"
              f"cp {mnt}/x/metadata.json {tmp_path}/first-meta.json\n"
              f"{py} {big} --out {mnt}/x --force 2> {tmp_path}/force.err || echo force=$?\n"
              f"ls -A {mnt} {mnt}/x > {tmp_path}/after-force.ls\n"
              f"cp {mnt}/x/metadata.json {tmp_path}/kept.json\n"
              f"{py} {big} --out {mnt}/y/z 2> {tmp_path}/new.err || echo new=$?\n"
              f"ls -A {mnt} > {tmp_path}/after-new.ls\n"
              f"{py} {small} --out {mnt}/y/z > {tmp_path}/again.json\n"
              f"{py} {small} --out {mnt}/x --force > {tmp_path}/forced.json\n")
    r = _in_mount_ns(script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "force=2" in r.stdout and "new=2" in r.stdout, r.stdout
    for name, out in (("force", f"{mnt}/x"), ("new", f"{mnt}/y/z")):
        err = (tmp_path / f"{name}.err").read_text()
        assert "No space left on device" in err and out in err, err
        assert "nothing was left behind" in err and "Traceback" not in err, err
    assert (tmp_path / "after-force.ls").read_text().split() == [
        f"{mnt}:", "x", f"{mnt}/x:", "metadata.json", "orig_to_new.npy", "part-0"]
    assert (tmp_path / "after-new.ls").read_text().split() == ["x"]  # y/ removed as well
    assert (tmp_path / "kept.json").read_text() == (tmp_path / "first-meta.json").read_text()
    assert (tmp_path / "again.json").read_text().strip()
    first = json.loads((tmp_path / "first.json").read_text().splitlines()[-1])
    forced = json.loads((tmp_path / "forced.json").read_text().splitlines()[-1])
    assert forced["set_id"] != first["set_id"]


# ----------------------------------------------------------------------- 3. --force


@pytest.mark.timeout(60)
def test_force_never_deletes_unlisted_entries(tmp_path):
    out = tmp_path / "parts"
    _summary(_cli(*SMALL, "--out", out))
    first = (out / "metadata.json").read_text()
    (out / "part-backup").mkdir()
    (out / "part-backup" / "important.txt").write_text("mine")
    (out / "part-0" / "notes.txt").write_text("also mine")
    r = _cli(*SMALL, "--out", out, "--force")
    _assert_exit_2(r, "part-backup/", "part-0/notes.txt", "never deletes")
    assert (out / "part-backup" / "important.txt").read_text() == "mine"
    assert (out / "part-0" / "notes.txt").read_text() == "also mine"
    assert (out / "metadata.json").read_text() == first
    load_partition(out, 0)
    shutil.move(out / "part-backup", tmp_path / "part-backup")
    (out / "part-0" / "notes.txt").unlink()
    _summary(_cli(*SMALL, "--num-parts", "2", "--out", out, "--force"))
    assert sorted(p.name for p in out.iterdir()) == [
        "metadata.json", "orig_to_new.npy", "part-0", "part-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-backup", "parts"]


# ----------------------------------------------------------------------- 4. corrupt parts


@pytest.fixture(scope="module")
def small_set(tmp_path_factory) -> Path:
    g = generate(300, avg_degree=4, feat_dim=4, num_classes=3, seed=0, progress=False)
    out = tmp_path_factory.mktemp("set") / "parts"
    partition_graph(g, 2, out, method="random", progress=False, presample_batches=0)
    return out


def _truncate(f: Path) -> None:
    os.truncate(f, f.stat().st_size // 2)


def _garble(f: Path) -> None:
    f.write_bytes(b"this is not a numpy file\n" * 8)


def _short_label(f: Path) -> None:
    np.save(f, np.load(f)[:-1])


def _version_1(f: Path) -> None:
    raw = json.loads(f.read_text())
    raw["version"] = 1
    raw.pop("set_id", None)
    f.write_text(json.dumps(raw))


SERVER_CASES = {  # name: (file, damage, words stderr must contain)
    "truncated-feat": ("part-0/feat.npy", _truncate, ["corrupt or truncated"]),
    "garbage-indices": ("part-0/indices.npy", _garble, ["corrupt or truncated"]),
    "short-label": ("part-0/label.npy", _short_label, ["has shape", "metadata.json"]),
    "garbage-hot-rank": ("hot_rank.npy", _garble, ["corrupt or truncated"]),
    "version-1": ("metadata.json", _version_1, ["version 1", "re-partition"]),
}


@pytest.mark.timeout(180)
def test_server_exits_2_naming_a_corrupt_file(small_set, tmp_path):
    """All cases at once (each server imports torch and DGL); each exit code checked."""
    procs = {}
    try:
        for name, (rel, damage, _) in SERVER_CASES.items():
            root = tmp_path / name
            shutil.copytree(small_set, root)
            damage(root / rel)
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "sampler_server.main", "--parts", str(root),
                 "--part-id", "0", "--bind", f"ipc://{tmp_path}/{name}.sock",
                 "--ready-file", str(tmp_path / f"{name}.ready")],
                cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
        results = {name: (*p.communicate(timeout=150), p.returncode) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for name, (rel, _, needles) in SERVER_CASES.items():
        _, err, code = results[name]
        assert code == 2, f"{name}: exit code {code}:\n{err[-3000:]}"
        assert "sampler-server: error:" in err and "Traceback" not in err, err[-3000:]
        for needle in [str(tmp_path / name / rel), "partition-ogbn", *needles]:
            assert needle in err, f"{name}: {needle!r} not in:\n{err[-3000:]}"
        assert not (tmp_path / f"{name}.ready").exists()


@pytest.mark.timeout(60)
def test_load_partition_names_bad_files(small_set, tmp_path):
    cases = [
        ("part-1/train.npy", lambda f: f.unlink(), "is missing"),
        ("part-1/valid.npy", lambda f: f.write_bytes(b""), "corrupt or truncated"),
        ("part-1/indices.npy", _truncate, "corrupt or truncated"),
        ("part-1/feat.npy", lambda f: np.save(f, np.zeros((3, 4), np.float32)), "has shape"),
        ("part-1/indptr.npy", lambda f: np.save(f, np.load(f) + 1), "spans edges"),
    ]
    for rel, damage, needle in cases:
        root = tmp_path / rel.replace("/", "_")
        shutil.copytree(small_set, root)
        damage(root / rel)
        load_partition(root, 0)
        with pytest.raises(PartitionFormatError, match=needle) as e:
            load_partition(root, 1, mmap=rel.endswith("indices.npy"))
        assert str(root / rel) in str(e.value) and "partition-ogbn" in str(e.value)
    (tmp_path / "hot").mkdir()
    shutil.copytree(small_set, tmp_path / "hot" / "s")
    assert load_hot_rank(tmp_path / "hot" / "s") is None
    np.save(tmp_path / "hot" / "s" / "hot_rank.npy", np.arange(5))
    with pytest.raises(PartitionFormatError, match="hot_rank.npy has shape"):
        load_hot_rank(tmp_path / "hot" / "s")


# ----------------------------------------------------------------------- 5. set identity


@pytest.mark.timeout(60)
def test_set_id_fresh_per_write_and_required(tmp_path):
    out = tmp_path / "parts"
    a = _summary(_cli(*SMALL, "--out", out))["set_id"]
    assert len(a) == 32 and int(a, 16) >= 0
    meta = PartitionSetMeta.load(out)
    assert meta.version == 2 and meta.set_id == a == load_partition(out, 0).meta.set_id
    b = _summary(_cli(*SMALL, "--out", out, "--force"))["set_id"]
    assert b != a and PartitionSetMeta.load(out).set_id == b
    raw = json.loads((out / "metadata.json").read_text())
    for set_id in ("", None):
        (out / "metadata.json").write_text(json.dumps({**raw, "set_id": set_id}))
        with pytest.raises(PartitionFormatError, match="no set_id"):
            PartitionSetMeta.load(out)
    del raw["set_id"]
    (out / "metadata.json").write_text(json.dumps(raw))
    with pytest.raises(PartitionFormatError, match="no set_id"):
        PartitionSetMeta.load(out)
    (out / "metadata.json").write_text(json.dumps({**raw, "version": 1}))
    with pytest.raises(PartitionFormatError, match="version 1.*re-partition"):
        PartitionSetMeta.load(out)
