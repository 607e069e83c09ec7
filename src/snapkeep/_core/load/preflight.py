"""Checks made when training starts, so that a fault is found before the first snapshot (with an
async writer, a whole snapshot interval of training would otherwise be lost first)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.storage import Storage


def check_timeout_s(timeout_s: object, *, none_ok: bool = False) -> float | None:
    """``timeout_s`` as a float, or an error naming the argument: a finite number of seconds
    > 0 (an int or a float; ``None`` too when ``none_ok``).

    Raises:
        TypeError: not a number (a str, a bool).
        ValueError: not finite or not > 0 (0, negative, NaN, infinity).
    """
    accepted = "a finite number of seconds > 0" + (" or None" if none_ok else "")
    if timeout_s is None and none_ok:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be {accepted}, got {type(timeout_s).__name__} "
                        f"{timeout_s!r}")
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be {accepted}, got {timeout_s!r}")
    return float(timeout_s)


def check_writable(
    storage: Storage, directory: str, *,
    access: Callable[[str, int], bool] = os.access,
    statvfs: Callable[[str], Any] = os.statvfs,
) -> None:
    """Fail now when a local ``directory`` cannot take snapshots: on a read-only mount, or
    without write and search permission for this process. Nothing is written.

    Object stores and ``fs=`` adapters are not probed (a probe object would need a delete
    permission to clean up after itself); their permissions show at the first snapshot, and
    their reachability when the snapshot extension lists the directory at start.

    Args:
        storage: the writer's storage.
        directory: the output directory on it (created by the writer before this check).
        access, statvfs: ``os.access`` and ``os.statvfs``, injectable for tests.

    Raises:
        SnapshotStorageError: the directory is not writable; the message names it, the reason
            and what to do (``errno`` is ``EROFS`` or ``EACCES``).
    """
    if not storage.is_local or not os.path.isdir(directory):
        return  # a missing directory fails in the writer's makedirs, naming it
    if statvfs(directory).f_flag & os.ST_RDONLY:
        reason, code = "it is on a read-only filesystem", errno.EROFS
    elif not access(directory, os.W_OK | os.X_OK):
        reason, code = "this process may not create files in it", errno.EACCES
    else:
        return
    raise SnapshotStorageError(
        f"output directory {storage.url(directory)!r} is not writable: {reason}, so every "
        "snapshot would fail. Fix its permissions or mount, or choose another directory",
        errno=code, filename=storage.url(directory))
