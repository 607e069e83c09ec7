"""The directory lock of a snapshot store: one trainer owns a snapshot directory.

The rule (docs/guarantees.md): **one trainer per snapshot directory**, whatever filename
template, Lightning ``filename``, door or spelling of the path names its files. The snapshot
directory is the one the snapshot files (or sharded directories, or ``checkpoint-N``
directories) actually live in: for ``Checkpointer(D, "snap/iter_{step}")`` it is ``D/snap``,
the same as for ``Checkpointer(D/snap, "iter_{step}")``. The stores of one process share the
lock (the doors of one run: a ppe manager's ``snapshot`` and ``snapshot_object`` extensions, a
Lightning ``ModelCheckpoint`` and its ``CheckpointIO``); another process is refused.

``fcntl.flock`` on ``<snapshot directory>/.snapkeep/owner.lock``, taken without waiting. flock
locks the file itself (its inode), so ``D/./snap``, a symlink to ``D`` or a relative path meet
the same lock; within this process the holders are counted per resolved real path of the lock
file, and the descriptor is closed (the flock released) when the last holder lets go. The kernel
releases a flock when its holder's last descriptor closes, so a lock of a killed process
(SIGKILL, OOM, node reboot) never blocks a restart: there is no stale-lock detection to get
wrong. The lock file holds the holder's pid, host and start time (JSON) for the error message of
a refused process; it is never deleted (deleting a flock'ed file would let two processes lock two
different files).

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
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from snapkeep._core.errors import SnapshotStorageError, StoreLockedError
from snapkeep._core.format.json_records import (
    RecordError,
    int_field,
    number_field,
    parse_json,
    str_field,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: The lock file's name, in the manifest directory (``.snapkeep``) of the snapshot directory.
LOCK_NAME = "owner.lock"


class _Held:
    """The flock'ed descriptor of one lock file in this process, and how many hold it."""

    def __init__(self, path: str, fd: int | None) -> None:
        self.path = path
        self.fd = fd
        self.holders = 0


# lock file (real path) -> this process's descriptor of it; reentrant: a StoreLock's __del__
# (run by the garbage collector, possibly inside a guarded section of the same thread) takes it
_HELD: dict[str, _Held] = {}
_HELD_GUARD = threading.RLock()


def _close_in_forked_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: drop this process's copies of held locks.

    Runs in the single thread of a new fork child. The guard is replaced rather than taken: a
    thread of the parent may have held it at the fork, and it would never be released here.
    """
    global _HELD_GUARD
    _HELD_GUARD = threading.RLock()
    for held in list(_HELD.values()):
        fd, held.fd = held.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


def lock_path(directory: str) -> str:
    """The lock file of the snapshot directory whose manifest directory is ``directory``."""
    return os.path.join(directory, LOCK_NAME)


class StoreLock:
    """One holder's share of a held directory lock; :meth:`release` (idempotent) or leave the
    ``with`` block to let it go (the flock goes with the process's last holder).

    Attributes:
        path: the lock file.
    """

    def __init__(self, path: str, held: _Held) -> None:
        self.path = path
        self._held: _Held | None = held

    @classmethod
    def acquire(cls, directory: str, where: str, *, what: str = "") -> StoreLock:
        """Lock the snapshot directory whose manifest directory (``.snapkeep``) is
        ``directory``, or fail at once. A store of this process that holds it already shares
        it (see the module docstring).

        Args:
            directory: the manifest directory of the snapshot directory (created if missing).
            where: the snapshot directory as the user named it, for messages.
            what: what the caller writes there (its template), for messages.

        Raises:
            StoreLockedError: another process holds it; the message names its pid, host and
                since when, and what to do.
            SnapshotStorageError: the lock file cannot be created.
        """
        path = lock_path(directory)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise SnapshotStorageError(
                f"cannot create the snapshot lock file {path}: {e}", errno=e.errno,
                filename=path, size_bytes=0) from e
        real = os.path.realpath(path)
        with _HELD_GUARD:
            held = _HELD.get(real)
            if held is not None and held.fd is not None:
                held.holders += 1
                logger.info("this process already holds %s; shared (%d holders)", path,
                            held.holders)
                return cls(path, held)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                raise SnapshotStorageError(
                    f"cannot create the snapshot lock file {path}: {e}", errno=e.errno,
                    filename=path, size_bytes=0) from e
            if fcntl is not None:
                _flock(fd, path, where, what)
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "since_unix_s": time.time()}
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(info).encode(), 0)
            except OSError as e:  # the lock holds; only the description for others is missing
                logger.warning("could not record the lock holder in %s: %s", path, e)
            logger.debug("locked %s (pid %d)", path, os.getpid())
            held = _Held(path, fd)
            held.holders = 1
            _HELD[real] = held
            return cls(path, held)

    @classmethod
    def acquire_existing(cls, directory: str, where: str, *,
                         what: str = "") -> StoreLock | None:
        """:meth:`acquire`, for a tool beside trainers (``snapkeep prune``): None, creating
        nothing, when no trainer ever locked the directory here (no lock file).

        Raises:
            StoreLockedError, SnapshotStorageError: as :meth:`acquire`.
        """
        if not os.path.exists(lock_path(directory)):
            return None
        return cls.acquire(directory, where, what=what)

    def release(self) -> None:
        """Let this share go (the process's last share closes the descriptor, releasing the
        flock); idempotent."""
        fd = None
        with _HELD_GUARD:
            held, self._held = self._held, None
            if held is None:
                return
            held.holders -= 1
            if held.holders <= 0:
                fd, held.fd = held.fd, None
                real = os.path.realpath(held.path)
                if _HELD.get(real) is held:
                    del _HELD[real]
        if fd is not None:
            os.close(fd)
            logger.debug("released %s", self.path)

    @property
    def held(self) -> bool:
        held = self._held
        return held is not None and held.fd is not None

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # closing a descriptor is no I/O on the file; the kernel unlocks with the last share
        if getattr(self, "_held", None) is not None:
            try:
                self.release()
            except OSError:
                logger.debug("lock descriptor of %s already closed", self.path)


def _flock(fd: int, path: str, where: str, what: str) -> None:
    """flock ``fd`` without waiting; closes it and raises when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe(_read_holder(fd))
        os.close(fd)
        asked = f" (asked for {what!r})" if what else ""
        error = StoreLockedError(
            f"snapshot directory {where!r}{asked} is in use by another trainer ({holder}; lock "
            f"file {path}). One trainer owns a snapshot directory, whatever its filename "
            "template or door: two would delete and overwrite each other's snapshots. Stop "
            "the other trainer (or wait for it to finish), or give this run another output "
            "directory. A killed trainer never holds this lock.")
        error.holder = holder
        raise error from None
    except OSError as e:
        os.close(fd)
        raise SnapshotStorageError(
            f"cannot lock {path}: {e}", errno=e.errno, filename=path, size_bytes=0) from e


def _read_holder(fd: int) -> dict[str, Any]:
    """The holder's line (at most 4 KiB of bounded JSON, anyone may have written it): its
    ``pid``, ``host`` and ``since_unix_s`` where each is in range, else {} or without that
    field (the lock itself does not depend on it)."""
    try:
        data = os.pread(fd, 4096, 0)
        holder = parse_json(data, max_bytes=4096, max_depth=4) if data else {}
    except (OSError, RecordError):
        return {}
    if not isinstance(holder, dict):
        return {}
    checked: dict[str, Any] = {}
    for name, check in (("pid", lambda: int_field(holder, "pid", high=1 << 31)),
                        ("host", lambda: str_field(holder, "host", max_chars=255)),
                        ("since_unix_s", lambda: number_field(holder, "since_unix_s"))):
        try:
            checked[name] = check()
        except RecordError:
            continue
    return checked


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    since = holder.get("since_unix_s")
    when = "unknown time"
    if isinstance(since, float):
        when = datetime.datetime.fromtimestamp(since, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
    host = "".join(c if c.isprintable() else "?" for c in holder.get("host", "?"))
    return f"pid {holder.get('pid', '?')} on host {host}, since {when}"
