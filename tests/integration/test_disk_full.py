"""Disk full during a save: a clear error (file, bytes attempted, errno, what to do), previous
snapshots intact, no temp file left; ``on_save_error`` decides whether training stops.

Runs on a real 2 MiB tmpfs and a real 2.2 MiB ext4 image (where snapkeep writes with O_DIRECT)
when they can be mounted (root, loop devices), and always with an injected ENOSPC (a savefun that
fails the way a full disk does)."""

from __future__ import annotations

import errno
import io
import logging
import os
import subprocess

import pytest
import torch

import snapkeep
from snapkeep._core.storage import TEMP_MARKER, resolve_storage
from snapkeep._core.store.files import SnapshotStore
from support.integration import assert_params, listing, make_model, make_run, train

TMPFS_BYTES = 2 << 20
#: Parameters of a model whose snapshot is ~0.8 MiB: two fit into the tmpfs, the third does not.
WIDTH = 450
CHUNK_BYTES = 64 << 10


def _try_mount(directory) -> bool:
    directory.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(directory)],
            capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _try_mount_ext4(directory, image) -> bool:
    """A 2.2 MiB ext4 filesystem in a loop-mounted image file (no journal, 1 KiB blocks)."""
    directory.mkdir()
    try:
        subprocess.run(["truncate", "-s", "2304K", str(image)], check=True, timeout=30)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-b", "1024", "-N", "32",
                        "-m", "0", str(image)], check=True, capture_output=True, timeout=60)
        done = subprocess.run(["mount", "-o", "loop", str(image), str(directory)],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _enospc_savefun(limit_bytes: int):
    """A savefun that fails like a full disk once ``limit_bytes`` have been written in all: it
    encodes with torch.save, then writes the bytes in chunks, raising ENOSPC from ``write``."""
    written = [0]

    def savefun(obj, f):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        for start in range(0, len(data), CHUNK_BYTES):
            chunk = data[start:start + CHUNK_BYTES]
            if written[0] + len(chunk) > limit_bytes:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            f.write(chunk)
            written[0] += len(chunk)

    return savefun


@pytest.fixture(params=["tmpfs", "ext4", "injected"])
def full_disk(request, tmp_path):
    """``(out_dir, snapshot kwargs)`` where the third snapshot runs out of space."""
    if request.param == "ext4":
        out = tmp_path / "small"
        if not _try_mount_ext4(out, tmp_path / "ext4.img"):
            pytest.skip("cannot mount an ext4 image here (needs root and loop devices)")
        yield out, {}
        subprocess.run(["umount", str(out)], capture_output=True, timeout=30, check=False)
    elif request.param == "tmpfs":
        out = tmp_path / "small"
        if not _try_mount(out):
            pytest.skip("cannot mount a tmpfs here (needs root); the injected case covers it")
        yield out, {}
        subprocess.run(["umount", str(out)], capture_output=True, timeout=30, check=False)
    else:
        out = tmp_path / "out"
        snapshot_bytes = _snapshot_bytes(tmp_path / "probe")
        yield out, {"savefun": _enospc_savefun(int(2.5 * snapshot_bytes))}


def _snapshot_bytes(directory) -> int:
    manager, _, model = make_run(directory, model=make_model(WIDTH, WIDTH), autoload=False)
    train(manager, model, 1)
    manager.finalize()
    return os.path.getsize(directory / "snapshot_iter_1")


def _no_temps(directory) -> bool:
    return not [n for n in listing(directory) if TEMP_MARKER in n]


def _verify_all(directory) -> list[str]:
    storage, d = resolve_storage(str(directory))
    catalog = SnapshotStore(storage, d, "snapshot_iter_{step}")
    entries = catalog.entries()
    for entry in entries:
        assert catalog.verify(entry) is not None
    return [e.name for e in entries]


def test_disk_full_stops_training_with_a_clear_error(full_disk):
    out, kwargs = full_disk
    manager, _, model = make_run(out, model=make_model(WIDTH, WIDTH), autoload=False, **kwargs)
    with pytest.raises(snapkeep.SnapshotStorageError) as info:
        train(manager, model, 5)
    error = info.value
    assert manager.iteration == 3  # the third snapshot failed and training stopped there
    assert error.errno == errno.ENOSPC
    assert error.filename == str(out / "snapshot_iter_3")
    assert error.size_bytes and error.size_bytes > 0
    message = str(error)
    assert "snapshot_iter_3" in message and f"{error.size_bytes} bytes" in message
    assert "errno 28" in message and "free space" in message
    assert _verify_all(out) == ["snapshot_iter_1", "snapshot_iter_2"]
    assert _no_temps(out)
    manager.finalize()


def test_disk_full_with_on_save_error_log_continues(full_disk, caplog):
    out, kwargs = full_disk
    manager, _, model = make_run(out, model=make_model(WIDTH, WIDTH), autoload=False,
                                 on_save_error="log", **kwargs)
    with caplog.at_level(logging.ERROR, logger="snapkeep"):
        train(manager, model, 4)
    manager.finalize()
    assert manager.iteration == 4
    assert "snapshot_iter_3" in caplog.text and "on_save_error='log'" in caplog.text
    assert "No space left on device" in caplog.text
    assert _verify_all(out) == ["snapshot_iter_1", "snapshot_iter_2"]
    assert _no_temps(out)

    resumed, _, model = make_run(out, model=make_model(WIDTH, WIDTH), **kwargs)
    assert resumed.iteration == 2
    assert_params(model, 2)
    resumed.finalize()


@pytest.mark.parametrize("on_save_error", ["raise", "log"])
def test_background_writer_disk_full(tmp_path, caplog, on_save_error):
    """With a thread writer the failure surfaces at the next snapshot or at finalize: raised
    once by default, logged with ``on_save_error='log'``."""
    snapshot_bytes = _snapshot_bytes(tmp_path / "probe")
    out = tmp_path / "out"
    writer = snapkeep.writing.ThreadWriter(savefun=_enospc_savefun(int(2.5 * snapshot_bytes)),
                                           out_dir=str(out))
    manager, _, model = make_run(out, model=make_model(WIDTH, WIDTH), writer=writer,
                                 autoload=False, on_save_error=on_save_error)
    with caplog.at_level(logging.ERROR, logger="snapkeep"):
        if on_save_error == "raise":
            with pytest.raises(snapkeep.SnapshotSaveError) as info:
                train(manager, model, 3)
                manager.finalize()
            assert isinstance(info.value.__cause__, snapkeep.SnapshotStorageError)
            assert info.value.__cause__.errno == errno.ENOSPC
        else:
            train(manager, model, 5)
            manager.finalize()
            assert manager.iteration == 5
            assert "on_save_error='log'" in caplog.text
    assert _verify_all(out) == ["snapshot_iter_1", "snapshot_iter_2"]
    assert _no_temps(out)
