"""Local snapshot files written with ``O_DIRECT``: the kernel DMAs from an aligned buffer to the
disk instead of copying every byte into the page cache first.

On the machine these figures come from (2 vCPUs, virtio disk), writing and ``fsync``-ing 48 MiB
cost 30-120 ms of CPU through the page cache (page allocation, dirty accounting, writeback; the
more the cache holds, the more it costs) and about 10 ms with ``O_DIRECT``, at 2-6x the
throughput. On a CPU-bound trainer that CPU is taken from training, so it is most of what a
background snapshot costs. Snapshots are written once and read rarely, so skipping the page cache
also stops them from evicting the training data's cached pages.

``O_DIRECT`` needs the file offset, the length and the memory address of every write aligned to
the device's logical block: bytes are gathered in a page-aligned buffer of :data:`CHUNK_BYTES`
and written when it is full; the tail is padded to :data:`ALIGN_BYTES` and the file truncated to
its real size. Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network and FUSE
filesystems: ``EINVAL`` when the flag is set or at the first write), the same descriptor
continues with ordinary buffered writes; the bytes on disk are the same either way.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Bytes gathered per ``O_DIRECT`` write (reusable page-aligned buffers, one per open file).
CHUNK_BYTES = 8 << 20
#: Alignment of direct writes' lengths and offsets (covers 512-byte and 4 KiB logical blocks).
ALIGN_BYTES = 4096
#: Whether this platform has ``O_DIRECT`` (Linux); elsewhere files are written buffered.
SUPPORTED = hasattr(os, "O_DIRECT")
#: Free buffers kept for reuse (a writer thread per snapshot still reuses them).
_POOL_MAX = 4

_POOL: list[mmap.mmap] = []
_POOL_LOCK = threading.Lock()


def _new_buffer() -> mmap.mmap:
    # private: a process forked later must not share (and scribble on) these pages
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if flags:
        return mmap.mmap(-1, CHUNK_BYTES, flags=flags)  # anonymous mappings are page-aligned
    return mmap.mmap(-1, CHUNK_BYTES)


def _acquire_buffer() -> mmap.mmap:
    with _POOL_LOCK:
        if _POOL:
            return _POOL.pop()
    return _new_buffer()


def _release_buffer(buf: mmap.mmap) -> None:
    with _POOL_LOCK:
        if len(_POOL) < _POOL_MAX:
            _POOL.append(buf)
            return
    try:
        buf.close()
    except BufferError:  # still exported somewhere: unmapped when collected
        pass


def _forget_pool_in_child() -> None:
    global _POOL_LOCK
    _POOL.clear()
    _POOL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _set_direct(fd: int, on: bool) -> bool:
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


def open_for_write(path: str, *, direct: bool = True) -> tuple[int, bool]:
    """Create ``path`` exclusively for writing; ``(fd, direct)`` where ``direct`` says whether
    ``O_DIRECT`` is on.

    The file is created without ``O_DIRECT`` and the flag set afterwards: an ``open(2)`` with
    ``O_DIRECT`` on a filesystem that refuses it fails *after* creating the file.

    Raises:
        OSError: from ``open(2)`` (``EEXIST``, ``ENOSPC``, ``EACCES``, ...).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    if not (direct and SUPPORTED):
        return fd, False
    try:
        on = _set_direct(fd, True)
    except BaseException:
        os.close(fd)
        raise
    if not on:
        logger.debug("O_DIRECT refused for %s; writing through the page cache", path)
    return fd, on


class DirectFile:
    """A write-only binary file over ``fd`` that writes with ``O_DIRECT`` while it can.

    Args:
        fd: an open descriptor (owned: :meth:`close` closes it).
        direct: whether ``fd`` was opened with ``O_DIRECT``.

    Small writes are gathered in this thread's chunk buffer either way, so a ``savefun`` that
    writes many small pieces costs one system call per :data:`CHUNK_BYTES`. ``write`` never
    seeks; :meth:`finish` writes what is still gathered (the tail) and truncates the file to the
    bytes written; call it before ``fsync``.
    """

    def __init__(self, fd: int, direct: bool) -> None:
        self._fd = fd
        self._direct = direct
        self._opened_direct = direct
        self._buf: mmap.mmap | None = _acquire_buffer()
        self._view: memoryview | None = memoryview(self._buf)
        self._fill = 0  # bytes gathered in the buffer
        self.size_bytes = 0  # bytes accepted by write()
        self.closed = False

    @property
    def direct(self) -> bool:
        """Whether writes still bypass the page cache."""
        return self._direct

    def fileno(self) -> int:
        return self._fd

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        """Accept all of ``data`` (gathered; written a chunk at a time); returns its length.

        Raises:
            OSError: from ``write(2)`` (``ENOSPC``, ``EIO``, ...).
            ValueError: the file is closed.
        """
        if self.closed:
            raise ValueError("I/O operation on closed file")
        view = memoryview(data).cast("B")
        n = len(view)
        pos = 0
        while pos < n:
            if not self._direct and not self._fill and n - pos >= CHUNK_BYTES:
                self._write_all(view[pos:])  # buffered and large: no need to gather
                break
            take = min(CHUNK_BYTES - self._fill, n - pos)
            self._copy_in(view[pos:pos + take])
            pos += take
            if self._fill == CHUNK_BYTES:
                self._flush_chunk(CHUNK_BYTES)
        self.size_bytes += n
        return n

    def flush(self) -> None:
        """A no-op: a partial block cannot be written directly until :meth:`finish`."""

    def finish(self) -> None:
        """Write what is gathered (direct: padded to :data:`ALIGN_BYTES`, then truncated away).

        Raises:
            OSError: from ``write(2)`` or ``ftruncate(2)``.
        """
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if self._fill:
            tail = self._fill
            if self._direct:
                padded = -(-tail // ALIGN_BYTES) * ALIGN_BYTES
                assert self._view is not None
                self._view[tail:padded] = bytes(padded - tail)
                self._flush_chunk(padded, real=tail)
            else:
                self._flush_chunk(tail)
        if self._opened_direct:  # drop the padding (also after a fallback mid-file)
            os.ftruncate(self._fd, self.size_bytes)

    def close(self) -> None:
        """Close the descriptor and return the buffer to the pool; idempotent."""
        if not self.closed:
            self.closed = True
            if self._view is not None:
                try:
                    self._view.release()
                except BufferError:  # a slice still exported somewhere: let GC release it
                    pass
            self._view = None
            if self._buf is not None:
                _release_buffer(self._buf)
            self._buf = None
            os.close(self._fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _copy_in(self, part: memoryview) -> None:
        assert self._view is not None
        size = len(part)
        if size >= (1 << 20):  # large: a memcpy that releases the GIL
            dst = np.frombuffer(self._buf, dtype=np.uint8, count=size,  # type: ignore[arg-type]
                                offset=self._fill)
            dst[:] = np.frombuffer(part, dtype=np.uint8)
        else:
            self._view[self._fill:self._fill + size] = part
        self._fill += size

    def _flush_chunk(self, length: int, real: int | None = None) -> None:
        """Write ``length`` bytes of the buffer, ``real`` of them data (the rest: padding)."""
        assert self._view is not None
        real = length if real is None else real
        if not self._direct:
            self._write_all(self._view[:real])
            self._fill = 0
            return
        done = 0
        while done < length:
            try:
                written = os.write(self._fd, self._view[done:length])
            except OSError as e:
                if e.errno != errno.EINVAL or done:
                    raise
                self._fall_back()  # refused outright: nothing of this chunk was written
                self._write_all(self._view[:real])
                self._fill = 0
                return
            if written <= 0:
                raise OSError(errno.EIO, "write(2) wrote 0 bytes")
            done += written
            if done < length and done % ALIGN_BYTES:
                # a short, unaligned direct write (the disk filled up): continue buffered
                self._fall_back()
                self._write_all(self._view[done:real])
                self._fill = 0
                return
        self._fill = 0

    def _write_all(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            written = os.write(self._fd, view[pos:])
            if written <= 0:
                raise OSError(errno.EIO, "write(2) wrote 0 bytes")
            pos += written

    def _fall_back(self) -> None:
        """Clear ``O_DIRECT`` on the descriptor; later writes go through the page cache."""
        logger.debug("O_DIRECT write refused; continuing through the page cache")
        _set_direct(self._fd, False)
        self._direct = False
