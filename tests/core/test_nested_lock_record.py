"""Records snapkeep reads that anyone who can write the directory can write (issue 32): a lock
file's holder record nested thousands deep answers with snapkeep's error, never
``RecursionError`` (the alias and marker cases: tests/doors/test_lightning.py, test_hf.py)."""

from __future__ import annotations

import fcntl
import os
import pathlib

import pytest

from snapkeep.errors import StoreLockedError
from snapkeep.store import StoreLock


def test_a_deeply_nested_lock_holder_record_still_gives_store_locked_error(
        tmp_path: pathlib.Path) -> None:
    first = StoreLock.acquire(str(tmp_path), str(tmp_path), what="ckpt_{.iteration}")
    lock_path = first.path
    first.release()
    with open(lock_path, "wb") as f:  # the holder record, written by whoever holds it
        f.write(b"[" * 4000)
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by another open file description
        with pytest.raises(StoreLockedError, match="in use by another trainer"):
            StoreLock.acquire(str(tmp_path), str(tmp_path), what="ckpt_{.iteration}")
    finally:
        os.close(fd)
