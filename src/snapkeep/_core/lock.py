"""The directory lock of a snapshot store: one trainer per output directory and template.

``fcntl.flock`` on ``<dir>/.snapkeep/<template>.lock``, taken without waiting. The kernel releases
a flock when its holder's last descriptor closes, so a lock of a killed process (SIGKILL, OOM,
node reboot) never blocks a restart: there is no stale-lock detection to get wrong. The lock file
holds the holder's pid, host and start time (JSON) for the error message of a refused process;
it is never deleted (deleting a flock'ed file would let two processes lock two different files).

What is locked: local filesystems (and network filesystems whose flock is coherent across hosts,
e.g. NFSv4, Lustre, GPFS with the right mount options). Object stores (``s3://``, ``gs://``,
``memory://``) and pfio-style objects have no lock: the store returns ``None`` and two trainers
on one prefix are not detected there.

Forked children never hold the lock: a ``fork`` child (DataLoader workers, ``multiprocessing``
with the fork start method, ``os.fork``) shares the parent's open file description, so its copy
of the descriptor would keep the flock alive after the trainer is killed, and a restart would be
refused naming a dead pid. A handler registered with :func:`os.register_at_fork` closes the
child's copies at once (closing a child's copy does not release the parent's flock); exec'd
children never get the descriptor (``O_CLOEXEC``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from typing import Any

from snapkeep._core.errors import SnapshotStorageError, StoreLockedError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# lock file (real path) -> the StoreLock of this process that holds it
_HELD: dict[str, StoreLock] = {}
_HELD_GUARD = threading.Lock()


def _close_in_forked_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: drop this process's copies of held locks.

    Runs in the single thread of a new fork child. The guard is replaced rather than taken: a
    thread of the parent may have held it at the fork, and it would never be released here.
    """
    global _HELD_GUARD
    _HELD_GUARD = threading.Lock()
    for lock in list(_HELD.values()):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


def lock_file_name(template: str) -> str:
    """``<readable part of template>-<hash>.lock``: distinct templates get distinct locks."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", template)[:60]
    digest = hashlib.sha256(template.encode()).hexdigest()[:12]
    return f"{readable}-{digest}.lock"


class StoreLock:
    """A held lock; :meth:`release` (idempotent) or leave the ``with`` block to let it go.

    Attributes:
        path: the lock file.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: str, template: str, where: str,
                key: str | None = None) -> StoreLock:
        """Lock ``template`` in ``directory`` (the store's manifest directory) or fail at once.

        Raises:
            StoreLockedError: another process (or another store object of this process) holds
                it; the message names its pid, host and since when, and what to do.
            SnapshotStorageError: the lock file cannot be created.
        """
        # the lock file is named after ``key`` (the set of names the template matches, see
        # FilenameTemplate.lock_key) so that equivalent spellings share one lock
        path = os.path.join(directory, lock_file_name(key if key is not None else template))
        with _HELD_GUARD:
            held = _HELD.get(os.path.realpath(path))
            if held is not None and held._fd is not None:
                # an earlier trainer object of this process that was never finalized (a notebook
                # cell run again): flock cannot tell them apart, so the newer one takes over
                logger.warning("this process already holds %s (an earlier manager or extension "
                               "that was not finalized?); the new one takes it over", path)
                fd, held._fd = held._fd, None
                lock = cls(path, fd)
                _HELD[os.path.realpath(path)] = lock
                return lock
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise SnapshotStorageError(
                f"cannot create the snapshot lock file {path}: {e}", errno=e.errno,
                filename=path, size_bytes=0) from e
        if fcntl is None:  # pragma: no cover
            return cls(path, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            error = StoreLockedError(
                f"snapshots of {template!r} in {where!r} are in use by another trainer "
                f"({holder}; lock file {path}). Two trainers on one output directory and "
                "template would delete and overwrite each other's snapshots. Stop the other "
                "trainer (or wait for it to finish), or give this run another output directory "
                "or filename template. A killed trainer never holds this lock.")
            error.holder = holder
            raise error from None
        except OSError as e:
            os.close(fd)
            raise SnapshotStorageError(
                f"cannot lock {path}: {e}", errno=e.errno, filename=path, size_bytes=0) from e
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since_unix_s": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError as e:  # the lock holds; only the description for others is missing
            logger.warning("could not record the lock holder in %s: %s", path, e)
        logger.debug("locked %s (pid %d)", path, os.getpid())
        lock = cls(path, fd)
        with _HELD_GUARD:
            _HELD[os.path.realpath(path)] = lock
        return lock

    @classmethod
    def acquire_existing(cls, directory: str, template: str, where: str,
                         key: str | None = None) -> StoreLock | None:
        """:meth:`acquire`, for a tool beside trainers (``snapkeep prune``): None, creating
        nothing, when no trainer ever locked ``template`` here (no lock file).

        Raises:
            StoreLockedError, SnapshotStorageError: as :meth:`acquire`.
        """
        path = os.path.join(directory, lock_file_name(key if key is not None else template))
        if not os.path.exists(path):
            return None
        return cls.acquire(directory, template, where, key=key)

    def release(self) -> None:
        """Let the lock go (closing the descriptor releases the flock); idempotent."""
        with _HELD_GUARD:
            fd, self._fd = self._fd, None
            if _HELD.get(os.path.realpath(self.path)) is self:
                del _HELD[os.path.realpath(self.path)]
        if fd is not None:
            os.close(fd)
            logger.debug("released %s", self.path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:  # closing a descriptor is no I/O on the file; the kernel unlocks
            try:
                os.close(fd)
            except OSError:
                logger.debug("lock descriptor of %s already closed", self.path)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data.decode()) if data else {}
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):  # a hostile record
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    since = holder.get("since_unix_s")
    when = "unknown time"
    if isinstance(since, (int, float)):
        when = datetime.datetime.fromtimestamp(since, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {when}"
