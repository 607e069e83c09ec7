"""The local commit protocol: unique temp names, nothing partial ever under the final name,
clean-up on failure, removal of crashed writers' temps only, and temps never listed."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest
import torch

import snapkeep
from snapkeep._core.storage import TEMP_MARKER, resolve_storage
from snapkeep._core.storage._temps import STALE_TEMP_AGE_S
from snapkeep._core.store.files import SnapshotStore


def _storage(directory):
    storage, path = resolve_storage(str(directory))
    return storage, path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def _host() -> str:
    from snapkeep._core.storage import _temps

    return _temps._HOST


def test_temp_names_are_unique_per_writer_and_process(tmp_path):
    storage, d = _storage(tmp_path)
    final = os.path.join(d, "snap")
    a1, a2 = storage.temp_name_for(final, "aaaa"), storage.temp_name_for(final, "aaaa")
    b = storage.temp_name_for(final, "bbbb")
    assert len({a1, a2, b}) == 3
    for name in (a1, a2, b):
        base = os.path.basename(name)
        assert os.path.dirname(name) == d  # same directory: os.replace stays atomic
        assert base.startswith(".snap" + TEMP_MARKER)
        from snapkeep._core.storage._temps import _temp_owner

        host, pid, _token = _temp_owner(base)
        assert (host, pid) == (_host(), os.getpid())


def test_temp_exists_only_during_the_write_and_is_never_listed(tmp_path):
    storage, d = _storage(tmp_path)
    seen = {}

    def write(f):
        f.write(b"x" * 100)
        seen["files"] = sorted(os.listdir(d))
        seen["listed"] = storage.list_names(d)
        seen["entries"] = [e.name for e in SnapshotStore(storage, d, "snap_{step}").entries()]

    storage.write(os.path.join(d, "snap_1"), write)
    temps = [n for n in seen["files"] if TEMP_MARKER in n]
    assert len(temps) == 1 and temps[0].startswith(".snap_1" + TEMP_MARKER)
    assert seen["listed"] == [] and seen["entries"] == []
    assert os.listdir(d) == ["snap_1"]


@pytest.mark.parametrize("error", [RuntimeError("savefun bug"), OSError(errno.EIO, "I/O error")],
                         ids=["raise", "oserror"])
def test_failing_savefun_leaves_no_temp_and_the_previous_file_intact(tmp_path, error):
    storage, d = _storage(tmp_path)
    final = os.path.join(d, "snap")
    storage.write(final, lambda f: f.write(b"old content"))

    def failing(f):
        f.write(b"new partial content" * 1000)
        raise error

    with pytest.raises((RuntimeError, OSError)) as info:
        storage.write(final, failing)
    assert os.listdir(d) == ["snap"]
    with open(final, "rb") as f:
        assert f.read() == b"old content"
    if isinstance(error, OSError):
        assert isinstance(info.value, snapkeep.SnapshotStorageError)
        assert info.value.errno == errno.EIO
        assert info.value.filename == final
        assert info.value.size_bytes == 19000
        assert info.value.__cause__ is error
    else:
        assert info.value is error


def test_failing_savefun_through_a_writer_keeps_the_previous_snapshot(tmp_path):
    writer = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    writer("snap", str(tmp_path), {"x": torch.ones(3)})
    before = sorted(os.listdir(tmp_path)), (tmp_path / "snap").read_bytes()

    def savefun(obj, f):
        torch.save(obj, f)
        raise ValueError("encoder failed after writing")

    with pytest.raises(ValueError, match="encoder failed"):
        writer("snap", str(tmp_path), {"x": torch.zeros(3)}, savefun=savefun)
    writer.finalize()
    assert (sorted(os.listdir(tmp_path)), (tmp_path / "snap").read_bytes()) == before
    assert not [n for n in os.listdir(tmp_path / ".snapkeep") if TEMP_MARKER in n]


def _touch(path, age_s: float = 0.0) -> None:
    with open(path, "wb") as f:
        f.write(b"partial")
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))


def _process_token() -> str:
    from snapkeep._core.storage import _temps

    return _temps._PROCESS_TOKEN


def test_initialize_removes_temps_of_dead_writers_only(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    names = {
        "dead": f".snapshot_iter_3{TEMP_MARKER}w0.{_host()}.{dead}.0a1b2c3d",
        # this process's own temp names carry its token (see the test below for a predecessor's)
        "live": f".snapshot_iter_4{TEMP_MARKER}w1.{_host()}.{live}.{_process_token()}0a1b2c3d",
        "other_host_young": f".snapshot_iter_5{TEMP_MARKER}w2.elsewhere.{dead}.0a1b2c3d",
        "other_host_old": f".snapshot_iter_6{TEMP_MARKER}w3.elsewhere.{dead}.0a1b2c3d",
        "unparsable_old": f".x{TEMP_MARKER}junk",
    }
    for key, name in names.items():
        _touch(tmp_path / name, age_s=2 * STALE_TEMP_AGE_S if key.endswith("old") else 0)
    _touch(tmp_path / "snapshot_iter_2")
    manifest_dir = tmp_path / ".snapkeep"
    manifest_dir.mkdir()
    dead_manifest_temp = f".snapshot_iter_3.json{TEMP_MARKER}w0.{_host()}.{dead}.0a1b2c3d"
    _touch(manifest_dir / dead_manifest_temp)

    writer = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    writer.initialize(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".snapkeep", names["live"], names["other_host_young"], "snapshot_iter_2"])

    # the snapshot extension also cleans the manifest directory (and a template's sub-directory)
    manager, _, _ = _manager(tmp_path, writer)
    with pytest.warns(UserWarning, match="already holds 1 snapshot"):
        manager.start_extensions()
    assert [n for n in os.listdir(manifest_dir) if not n.endswith(".lock")] == []
    manager.finalize()
    for key in ("live", "other_host_young"):  # kept by design; the suite leaves no temps
        os.unlink(tmp_path / names[key])


def _manager(out, writer):
    model = torch.nn.Linear(2, 2)
    manager = snapkeep.training.ExtensionsManager(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 1, iters_per_epoch=1, writer=writer)
    ext = snapkeep.training.extensions.snapshot(autoload=False)
    manager.extend(ext)
    return manager, ext, model


def test_other_files_are_neither_listed_nor_deleted(tmp_path):
    others = ["snapshot_iter_10.bak", "notes.txt", "snapshot_iter_x", "snapshot_iter_",
              "snapshot_iter_7.tmp", "xsnapshot_iter_3", "snapshot_iter_3.json"]
    for name in others:
        _touch(tmp_path / name)
    (tmp_path / "snapshot_iter_99").mkdir()  # a directory that matches the template
    storage, d = _storage(tmp_path)
    catalog = SnapshotStore(storage, d, "snapshot_iter_{step}")
    assert catalog.entries() == []

    writer = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    model = torch.nn.Linear(2, 2)
    manager = snapkeep.training.ExtensionsManager(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 100, iters_per_epoch=1,
        writer=writer)
    manager.extend(snapkeep.training.extensions.snapshot(n_retains=1), trigger=(1, "iteration"))
    for _ in range(3):
        with manager.run_iteration():
            pass
    manager.finalize()
    assert [e.name for e in catalog.entries()] == ["snapshot_iter_3"]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [*others, ".snapkeep", "snapshot_iter_3", "snapshot_iter_99"])


def test_stale_temps_are_told_apart_from_live_ones(tmp_path):
    """Temp files of dead processes, of an earlier process with this pid (a restarted
    container's pid 1) and older than a day go; those of live writers stay."""
    import subprocess
    import sys
    import time

    from snapkeep._core.storage import _temps

    storage, d = resolve_storage(str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    host, me, token = _temps._HOST, os.getpid(), _temps._PROCESS_TOKEN

    def temp(name: str) -> str:
        (tmp_path / name).write_bytes(b"partial")
        return name

    gone = [temp(f".s1{TEMP_MARKER}ab12cd34.{host}.{dead_pid}.0a1b2c3d4e5f6a7b"),
            temp(f".s2{TEMP_MARKER}ab12cd34.{host}.{me}.ffffff00000000"),  # a predecessor
            temp(f".s3{TEMP_MARKER}ab12cd34.otherhost.{me}.0a1b2c3d4e5f6a7b")]
    old = time.time() - 25 * 3600
    os.utime(tmp_path / gone[2], (old, old))
    kept = [temp(f".s4{TEMP_MARKER}ab12cd34.{host}.{me}.{token}00000000"),  # ours, in use
            temp(f".s5{TEMP_MARKER}ab12cd34.{host}.{os.getppid()}.0a1b2c3d4e5f6a7b"),
            temp(f".s6{TEMP_MARKER}ab12cd34.otherhost.{me}.0a1b2c3d4e5f6a7b")]
    removed = storage.remove_stale_temps(d)
    assert sorted(os.path.basename(p) for p in removed) == sorted(gone)
    assert sorted(n for n in os.listdir(tmp_path)) == sorted(kept)
    for name in kept:  # kept by design; the suite leaves no temps
        os.unlink(tmp_path / name)
    # and the names this process makes carry its token
    assert storage.temp_name_for(os.path.join(d, "x"), "t").rsplit(".", 1)[1].startswith(token)
