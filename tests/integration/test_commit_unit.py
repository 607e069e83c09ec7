"""A snapshot and its manifest commit together or not at all.

- A manifest that cannot be written (disk full on a real tmpfs; an injected storage that fails
  manifests) takes its snapshot back out: no snapshot stays committed without a manifest.
- A name whose manifest name (name + '.json') cannot exist is refused before any byte is
  written, naming the filesystem's limit.
- Retention deletes files this run committed even when their manifest is missing, so with
  n_retains=1 on a disk that holds the working set, snapshots keep succeeding.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

import snapkeep
from snapkeep._core.save.commit import commit_job
from snapkeep._core.save.job import SaveJob
from snapkeep._core.storage import RenameCommit, ReplaceCommit, Storage, resolve_storage
from support.integration import listing, make_model, make_run, train

WIDTH = 300  # a snapshot of ~0.35 MiB


def _mount_tmpfs(directory, size_bytes: int) -> bool:
    directory.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(directory)],
            capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(name: str, size_bytes: int):
        path = tmp_path / name
        if not _mount_tmpfs(path, size_bytes):
            pytest.skip("cannot mount a tmpfs here (needs root); the injected cases cover it")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], capture_output=True, timeout=30, check=False)


class _ManifestsFail(ReplaceCommit):
    """The local commit strategy, but manifests fail like a full disk (data files succeed)."""

    def write(self, fs, target, write_fn):
        if ".json" in os.path.basename(target.url):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target.url)
        return super().write(fs, target, write_fn)


class _ObjectStoreManifestsFail(Storage):
    """A storage without the two-file publish (as object stores) whose manifests fail."""

    def __init__(self, fs):
        super().__init__(fs, RenameCommit())
        self.strategy = _PlainReplace()

    def write_bytes(self, path, data, *, tag="w"):
        if path.endswith(".json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super().write_bytes(path, data, tag=tag)


class _PlainReplace:
    """Not a ReplaceCommit: commits one file at a time (as a rename-only filesystem)."""

    real_directories = True

    def write(self, fs, target, write_fn):
        return ReplaceCommit(direct_io=False).write(fs, target, write_fn)


def _job(storage, path, **kwargs) -> SaveJob:
    return SaveJob(storage=storage, path=path, savefun=torch.save, step=1, **kwargs)


@pytest.mark.parametrize("failing", [
    pytest.param(lambda fs: Storage(fs, _ManifestsFail()), id="local-two-temps"),
    pytest.param(_ObjectStoreManifestsFail, id="one-file-at-a-time"),
])
def test_a_manifest_that_cannot_be_written_leaves_no_snapshot(tmp_path, failing):
    base, d = resolve_storage(str(tmp_path))
    storage = failing(base.fs)
    commit_job(_job(base, os.path.join(d, "keep_1")), {"x": torch.ones(3)})
    with pytest.raises(OSError) as info:
        commit_job(_job(storage, os.path.join(d, "snap_2")), {"x": torch.ones(3)})
    assert info.value.errno == errno.ENOSPC
    assert listing(tmp_path) == [".snapkeep/keep_1.json", "keep_1"]


def test_a_failed_manifest_leaves_the_previous_file_of_that_name_intact(tmp_path):
    """Both temps are written before either is published: saving a name again when its
    manifest cannot be written keeps the old snapshot and its manifest, byte for byte."""
    base, d = resolve_storage(str(tmp_path))
    commit_job(_job(base, os.path.join(d, "snap")), {"x": torch.zeros(3)})
    before = {p: (tmp_path / p).read_bytes() for p in listing(tmp_path)}
    with pytest.raises(OSError):
        commit_job(_job(Storage(base.fs, _ManifestsFail()), os.path.join(d, "snap")),
                   {"x": torch.ones(3)})
    assert {p: (tmp_path / p).read_bytes() for p in listing(tmp_path)} == before


def test_manifest_enospc_on_a_real_full_tmpfs(tmp_path, tmpfs):
    """The data file fits exactly; the manifest does not: nothing stays committed."""
    state = {"w": torch.arange(50_000, dtype=torch.float32)}
    probe = tmp_path / "probe"
    probe.mkdir()
    writer = snapkeep.writing.SimpleWriter(out_dir=str(probe))
    writer("s", str(probe), state)
    writer.finalize()
    data_pages = -(-os.path.getsize(probe / "s") // 4096)

    out = tmpfs("small", 1 << 20)
    (out / ".snapkeep").mkdir()
    stat = os.statvfs(out)
    (out / "filler").write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - data_pages * 4096))
    writer = snapkeep.writing.SimpleWriter(out_dir=str(out))
    with pytest.raises(snapkeep.SnapshotStorageError) as info:
        writer("snap_1", str(out), state)
    writer.finalize()
    assert info.value.errno == errno.ENOSPC and "snap_1.json" in str(info.value)
    assert listing(out) == ["filler"]  # neither the snapshot nor a temp file stays


def test_a_name_whose_manifest_name_cannot_exist_is_refused_before_writing(tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    name = "s" * (limit - 3)  # the name fits; name + '.json' does not
    writer = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    written = []

    def savefun(obj, f):
        written.append(obj)
        torch.save(obj, f)

    with pytest.raises(ValueError, match=f"NAME_MAX of {limit} bytes") as info:
        writer(name, str(tmp_path), {"x": torch.ones(1)}, savefun=savefun)
    writer.finalize()
    assert name in str(info.value) and written == []
    assert [p for p in listing(tmp_path) if not p.startswith(".snapkeep/")] == []


def _drop_manifest(out, step: int) -> None:
    (out / ".snapkeep" / f"snapshot_iter_{step}.json").unlink()


def test_retention_deletes_this_runs_files_whose_manifest_is_gone(tmp_path):
    manager, _, model = make_run(tmp_path, autoload=False, n_retains=1)
    train(manager, model, 2)
    _drop_manifest(tmp_path, 2)  # committed by this run; its metadata is gone
    train(manager, model, 2)
    manager.finalize()
    assert listing(tmp_path) == [".snapkeep/snapshot_iter_4.json", "snapshot_iter_4"]


def test_n_retains_1_keeps_succeeding_on_a_disk_that_holds_the_working_set(tmp_path, tmpfs):
    probe = tmp_path / "probe"
    manager, _, model = make_run(probe, model=make_model(WIDTH, WIDTH), autoload=False)
    train(manager, model, 1)
    manager.finalize()
    size = os.path.getsize(probe / "snapshot_iter_1")
    out = tmpfs("small", int(2.6 * size) + (64 << 10))  # two snapshots + manifests, not three

    manager, _, model = make_run(out, model=make_model(WIDTH, WIDTH), autoload=False,
                                 n_retains=1)
    train(manager, model, 2)
    _drop_manifest(out, 2)
    train(manager, model, 6)  # without deleting snapshot_iter_2, the 4th save hits ENOSPC
    manager.finalize()
    assert manager.iteration == 8
    assert listing(out) == [".snapkeep/snapshot_iter_8.json", "snapshot_iter_8"]
