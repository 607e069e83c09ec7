"""Every directory the storage creates is fsynced in its parent (its entry is durable), observed
through the interpreter's audit events (``os.mkdir``, and the ``open`` of the parent that
``fsync`` needs), with real directories."""

from __future__ import annotations

import os
import sys

import torch

import snapkeep
from snapkeep._core.storage import resolve_storage

_EVENTS: list[tuple[str, str, int]] | None = None


def _hook(event: str, args: tuple) -> None:
    if _EVENTS is None:
        return
    if event == "os.mkdir":
        _EVENTS.append(("mkdir", os.path.abspath(os.fsdecode(args[0])), 0))
    elif event == "open" and isinstance(args[0], (str, bytes)) and isinstance(args[2], int):
        _EVENTS.append(("open", os.path.abspath(os.fsdecode(args[0])), args[2]))


sys.addaudithook(_hook)


def _record(fn) -> list[tuple[str, str, int]]:
    global _EVENTS
    _EVENTS = []
    try:
        fn()
        return list(_EVENTS)
    finally:
        _EVENTS = None


def _unsynced(events, created) -> list[str]:
    """Created directories whose parent was not opened read-only (to fsync it) after the mkdir."""
    bad = []
    for directory in created:
        at = next(i for i, e in enumerate(events) if e[:2] == ("mkdir", directory))
        parent = os.path.dirname(directory)
        if not any(kind == "open" and path == parent and flags & os.O_ACCMODE == os.O_RDONLY
                   for kind, path, flags in events[at + 1:]):
            bad.append(directory)
    return bad


def test_storage_makedirs_fsyncs_each_new_directory_in_its_parent(tmp_path):
    storage, d = resolve_storage(str(tmp_path))
    target = os.path.join(d, "a", "b", "c")
    events = _record(lambda: storage.makedirs(target))
    created = [p for kind, p, _ in events if kind == "mkdir"]
    expected = [str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(tmp_path / "a" / "b" / "c")]
    assert created == expected
    assert _unsynced(events, created) == []
    assert os.path.isdir(target)
    assert [e for e in _record(lambda: storage.makedirs(target)) if e[0] == "mkdir"] == []


def test_a_snapshot_into_new_directories_fsyncs_them(tmp_path):
    out = tmp_path / "run" / "ckpt"
    writer = snapkeep.writing.SimpleWriter()

    def save() -> None:
        writer("sub/snap", str(out), {"x": torch.ones(2)})

    try:
        events = _record(save)
    finally:
        writer.finalize()
    created = [p for kind, p, _ in events if kind == "mkdir"]
    assert set(created) >= {str(tmp_path / "run"), str(out), str(out / "sub"),
                            str(out / "sub" / ".snapkeep")}
    assert _unsynced(events, created) == []


def test_sync_file_opens_a_regular_file_and_refuses_a_fifo_without_blocking(tmp_path) -> None:
    """``Storage.sync_file`` (a framework's own file made durable before a marker names it):
    the file is opened (read-only, to fsync it); a FIFO is refused at once; memory:// has
    nothing to sync."""
    import errno

    import pytest

    storage, _ = resolve_storage(str(tmp_path))
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x" * 10)
    events = _record(lambda: storage.sync_file(str(path)))
    assert [e[:2] for e in events if e[0] == "open"] == [("open", str(path))]
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError) as caught:
        storage.sync_file(str(tmp_path / "fifo"))
    assert caught.value.errno == errno.EINVAL
    memory, where = resolve_storage("memory://sync-file-test")
    memory.sync_file(memory.join(where, "absent"))  # no-op, no error
