"""The start-up check of the output directory (before the first snapshot, nothing written)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from snapkeep import SnapshotStorageError
from snapkeep._core.load.preflight import check_writable
from snapkeep._core.storage import resolve_storage


def _statvfs(read_only: bool) -> Any:
    return lambda path: SimpleNamespace(f_flag=os.ST_RDONLY if read_only else 0)


@pytest.mark.parametrize(
    ("read_only", "allowed", "code", "reason"),
    [
        (True, True, errno.EROFS, "read-only filesystem"),
        (False, False, errno.EACCES, "may not create files in it"),
    ],
)
def test_unwritable_local_directory(tmp_path: Path, read_only: bool, allowed: bool, code: int,
                                    reason: str) -> None:
    storage, path = resolve_storage(str(tmp_path))
    with pytest.raises(SnapshotStorageError) as info:
        check_writable(storage, path, access=lambda p, mode: allowed,
                       statvfs=_statvfs(read_only))
    assert info.value.errno == code and info.value.filename == str(tmp_path)
    message = str(info.value)
    assert f"output directory {str(tmp_path)!r} is not writable" in message and reason in message
    assert "choose another directory" in message
    assert list(tmp_path.iterdir()) == []


def test_writable_directory_passes_and_writes_nothing(tmp_path: Path) -> None:
    storage, path = resolve_storage(str(tmp_path))
    check_writable(storage, path)
    assert list(tmp_path.iterdir()) == []


def test_object_stores_are_not_probed() -> None:
    storage, path = resolve_storage("memory://preflight/run")
    check_writable(storage, path, access=lambda p, mode: False, statvfs=_statvfs(True))
    assert not storage.fs.exists(path)
