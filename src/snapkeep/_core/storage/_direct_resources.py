"""What ``O_DIRECT`` writing needs from the system: a descriptor with the flag set (or refused),
page-aligned chunk buffers reused across files and threads, and the threads that write chunks in
the background. :class:`~._direct.DirectFile` is the file built on them.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import mmap
import os
import threading

logger = logging.getLogger(__name__)

#: Bytes gathered per ``O_DIRECT`` write (reusable page-aligned buffers, one per open file).
CHUNK_BYTES = 8 << 20
#: Whether this platform has ``O_DIRECT`` (Linux); elsewhere files are written buffered.
SUPPORTED = hasattr(os, "O_DIRECT")
#: Free buffers kept for reuse (a writer thread per snapshot still reuses them).
_POOL_MAX = 8
_WRITE_POOL: concurrent.futures.ThreadPoolExecutor | None = None

_POOL: list[mmap.mmap] = []
_POOL_LOCK = threading.Lock()


def _new_buffer() -> mmap.mmap:
    # private: a process forked later must not share (and scribble on) these pages
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if flags:
        return mmap.mmap(-1, CHUNK_BYTES, flags=flags)  # anonymous mappings are page-aligned
    return mmap.mmap(-1, CHUNK_BYTES)


def acquire_buffer() -> mmap.mmap:
    with _POOL_LOCK:
        if _POOL:
            return _POOL.pop()
    return _new_buffer()


def release_buffer(buf: mmap.mmap) -> None:
    with _POOL_LOCK:
        if len(_POOL) < _POOL_MAX:
            _POOL.append(buf)
            return
    try:
        buf.close()
    except BufferError:  # still exported somewhere: unmapped when collected
        pass


def _forget_pool_in_child() -> None:
    global _POOL_LOCK, _WRITE_POOL
    _POOL.clear()
    _POOL_LOCK = threading.Lock()
    _WRITE_POOL = None  # its threads did not survive the fork


def write_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _WRITE_POOL
    with _POOL_LOCK:
        if _WRITE_POOL is None:
            _WRITE_POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="snapkeep-direct-write")
        return _WRITE_POOL


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def set_direct(fd: int, on: bool) -> bool:
    """Set or clear ``O_DIRECT`` on ``fd``; False when the filesystem refuses it."""
    import fcntl  # POSIX only; never reached where O_DIRECT does not exist

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True


def open_for_write(path: str, *, direct: bool = True, mode: int = 0o644) -> tuple[int, bool]:
    """Create ``path`` exclusively for writing (permissions ``mode``, less the umask; a
    symlink in its place is never followed: ``O_EXCL``); ``(fd, direct)`` where ``direct`` says
    whether ``O_DIRECT`` is on.

    The file is created without ``O_DIRECT`` and the flag set afterwards: an ``open(2)`` with
    ``O_DIRECT`` on a filesystem that refuses it fails *after* creating the file.

    Raises:
        OSError: from ``open(2)`` (``EEXIST``, ``ENOSPC``, ``EACCES``, ...).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    if not (direct and SUPPORTED):
        return fd, False
    try:
        on = set_direct(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if not on:
        logger.debug("O_DIRECT refused for %s; writing through the page cache", path)
    return fd, on
