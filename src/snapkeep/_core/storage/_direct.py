"""Local snapshot files written with ``O_DIRECT``: the kernel DMAs from an aligned buffer to the
disk instead of copying every byte into the page cache first.

On the machine these figures come from (2 vCPUs, virtio disk), writing and ``fsync``-ing 48 MiB
cost 30-120 ms of CPU through the page cache (page allocation, dirty accounting, writeback; the
more the cache holds, the more it costs) and about 10 ms with ``O_DIRECT``, at 2-6x the
throughput. On a CPU-bound trainer that CPU is taken from training, so it is most of what a
background snapshot costs. Snapshots are written once and read rarely, so skipping the page cache
also stops them from evicting the training data's cached pages.

``O_DIRECT`` needs the file offset, the length and the memory address of every write aligned to
the device's logical block. A large write whose file offset and memory address are both aligned
to :data:`ALIGN_BYTES` (snapkeep's staging buffers are page-aligned and :func:`~snapkeep._core.
codec.torch_save` aligns large states' tensor records to 4 KiB in the file) is written *in place*:
the disk reads the caller's memory, with no copy. Everything else is gathered in a page-aligned
buffer of :data:`CHUNK_BYTES` and written when it is full; the tail is padded to
:data:`ALIGN_BYTES` and the file truncated to its real size. A ``hasher`` given to
:class:`DirectFile` is fed every byte in file order, each piece just before it is copied or
written, so the checksum reads bytes that are already in the CPU cache instead of a second pass
over memory. Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network and FUSE
filesystems: ``EINVAL`` when the flag is set or at the first write), the same descriptor
continues with ordinary buffered writes; the bytes on disk are the same either way.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import logging
import mmap
import os
from typing import Any

import numpy as np

from snapkeep._core.storage._direct_resources import (
    CHUNK_BYTES,
    acquire_buffer,
    release_buffer,
    set_direct,
    write_pool,
)

logger = logging.getLogger(__name__)

#: Alignment of direct writes' lengths and offsets (covers 512-byte and 4 KiB logical blocks).
ALIGN_BYTES = 4096
#: Direct writes in flight per file, each from its own chunk buffer, while the next chunk is
#: gathered: 2 measured fastest on this machine's virtio disk (1, 2 and 4 streams in
#: ``benchmarks/bench_write_streams.py``); 1 writes each chunk before gathering the next.
WRITE_STREAMS = 2
#: Smallest aligned write sent to the disk straight from the caller's memory (smaller ones are
#: gathered: one system call per :data:`CHUNK_BYTES` is cheaper than many small direct writes).
IN_PLACE_MIN_BYTES = 1 << 20
#: Environment variable: ``0`` (or ``off``/``false``/``no``) turns in-place writes off, so every
#: byte is copied through the chunk buffer (a troubleshooting switch; read at import, so writer
#: worker processes started later inherit it).
IN_PLACE_ENV = "SNAPKEEP_DIRECT_IN_PLACE"


def _in_place_from_env() -> bool:
    value = os.environ.get(IN_PLACE_ENV, "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value not in ("1", "on", "true", "yes", ""):
        logger.warning("%s=%r is not one of 1/on or 0/off; in-place direct writes stay on",
                       IN_PLACE_ENV, value)
    return True


#: Whether large aligned writes go to the disk from the caller's memory (see :data:`IN_PLACE_ENV`).
IN_PLACE = _in_place_from_env()
#: Bytes hashed then copied (or written) at a time: small enough to stay in a core's L2 cache
#: between the two passes.
_HASH_PIECE_BYTES = 512 << 10
class DirectFile:
    """A write-only binary file over ``fd`` that writes with ``O_DIRECT`` while it can.

    Args:
        fd: an open descriptor (owned: :meth:`close` closes it).
        direct: whether ``fd`` was opened with ``O_DIRECT``.
        streams: direct writes in flight at once (>= 1, default :data:`WRITE_STREAMS`). With
            more than one, each chunk after the first is written by ``pwrite(2)`` at its offset
            in a background thread while the next one is gathered (or hashed); an error of such
            a write is raised by the next ``write`` or by :meth:`finish`.
        hasher: an object with ``update(bytes)`` (e.g. :func:`~snapkeep._core.format.checksum.
            new_hasher`), fed every byte accepted by :meth:`write`, in order.

    Small writes are gathered in this thread's chunk buffer, so a ``savefun`` that writes many
    small pieces costs one system call per :data:`CHUNK_BYTES`. A write of at least
    :data:`IN_PLACE_MIN_BYTES` that starts at an aligned file offset from an aligned address is
    written from the caller's memory (no copy); :meth:`write` returns only once the disk has
    taken those bytes, so the caller may reuse its memory at once. ``write`` never seeks;
    :meth:`finish` writes what is still gathered (the tail) and truncates the file to the bytes
    written; call it before ``fsync``.
    """

    def __init__(self, fd: int, direct: bool, *, streams: int = WRITE_STREAMS,
                 hasher: Any = None) -> None:
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be an int >= 1, got {streams!r}")
        self._fd = fd
        self._direct = direct
        self._opened_direct = direct
        self._streams = streams
        self._hasher = hasher
        self._in_flight: collections.deque[
            tuple[concurrent.futures.Future[None], mmap.mmap | None]] = collections.deque()
        self._offset = 0  # file offset of the gathered chunk once writes are positioned
        self._positioned = False  # pwrite(2) at explicit offsets was used
        self._direct_chunks = 0  # direct writes known to be accepted
        self._buf: mmap.mmap | None = acquire_buffer()
        self._view: memoryview | None = memoryview(self._buf)
        self._fill = 0  # bytes gathered in the buffer
        self.size_bytes = 0  # bytes accepted by write()
        #: bytes written straight from the caller's memory (no copy), for tests and benchmarks
        self.in_place_bytes = 0
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
        """Accept all of ``data`` (gathered and written a chunk at a time, or written in place);
        returns its length.

        Raises:
            OSError: from ``write(2)``/``pwrite(2)`` (``ENOSPC``, ``EIO``, ...).
            ValueError: the file is closed.
        """
        if self.closed:
            raise ValueError("I/O operation on closed file")
        view = memoryview(data).cast("B")
        n = len(view)
        pos = 0
        while pos < n:
            in_place = self._in_place_length(view, pos)
            if in_place:
                self._write_in_place(view[pos:pos + in_place])
                pos += in_place
                continue
            if not self._direct and not self._positioned and not self._fill \
                    and n - pos >= CHUNK_BYTES:
                self._hash(view[pos:])
                self._write_all(view[pos:])  # buffered and large: no need to gather
                pos = n
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
        self._wait_in_flight(0)
        if self._fill and self._positioned:
            self._write_tail_at_offset()
        elif self._fill:
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
            for future, _ in self._in_flight:  # their errors went to finish() or are moot now
                concurrent.futures.wait([future])
            for _, buf in self._in_flight:
                if buf is not None:
                    release_buffer(buf)
            self._in_flight.clear()
            if self._view is not None:
                try:
                    self._view.release()
                except BufferError:  # a slice still exported somewhere: let GC release it
                    pass
            self._view = None
            if self._buf is not None:
                release_buffer(self._buf)
            self._buf = None
            os.close(self._fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _hash(self, part: memoryview) -> None:
        if self._hasher is not None:
            self._hasher.update(part)

    def _copy_in(self, part: memoryview) -> None:
        """Gather ``part`` into the chunk buffer, hashing each piece just before copying it."""
        assert self._view is not None
        size = len(part)
        if size >= (1 << 20):  # large: memcpys that release the GIL
            dst = np.frombuffer(self._buf, dtype=np.uint8, count=size,  # type: ignore[arg-type]
                                offset=self._fill)
            src = np.frombuffer(part, dtype=np.uint8)
            for start in range(0, size, _HASH_PIECE_BYTES):
                stop = min(start + _HASH_PIECE_BYTES, size)
                self._hash(part[start:stop])
                dst[start:stop] = src[start:stop]
        else:
            self._hash(part)
            self._view[self._fill:self._fill + size] = part
        self._fill += size

    def _in_place_length(self, view: memoryview, pos: int) -> int:
        """How many bytes of ``view[pos:]`` can be written from the caller's memory (0: none):
        the aligned prefix, when the file offset and the address are aligned and it is large."""
        if not IN_PLACE or not self._direct or len(view) - pos < IN_PLACE_MIN_BYTES \
                or (self.size_bytes + pos) % ALIGN_BYTES:
            return 0
        address = np.frombuffer(view[pos:pos + 1], dtype=np.uint8).ctypes.data
        if address % ALIGN_BYTES:
            return 0
        return (len(view) - pos) // ALIGN_BYTES * ALIGN_BYTES

    def _write_in_place(self, view: memoryview) -> None:
        """Write ``view`` (aligned address, offset and length) from the caller's memory: the
        gathered bytes first, then :data:`CHUNK_BYTES` pieces, up to ``streams`` in flight,
        each hashed just before it is handed to the disk. Returns once all are written."""
        if not self._positioned:
            self._offset = os.lseek(self._fd, 0, os.SEEK_CUR)
            self._positioned = True
        if self._fill:  # a whole number of blocks: the file offset here is aligned
            self._write_behind(self._fill)
        for start in range(0, len(view), CHUNK_BYTES):
            piece = view[start:start + CHUNK_BYTES]
            self._hash(piece)
            offset = self._offset
            self._offset += len(piece)
            if not self._direct:  # the filesystem refused a direct write on the way
                self._pwrite_chunk(piece, offset)
            elif not self._direct_chunks or self._streams == 1:
                self._pwrite_now(piece, offset)
            else:
                self._wait_in_flight(self._streams - 1)
                self._in_flight.append((write_pool().submit(self._pwrite_chunk, piece, offset),
                                        None))
            self.in_place_bytes += len(piece)
        self._wait_in_flight(0)  # the caller's memory is its own again when write() returns

    def _pwrite_now(self, view: memoryview, offset: int) -> None:
        """A direct ``pwrite`` in this thread; the first one tells whether the filesystem accepts
        ``O_DIRECT`` writes at all (``EINVAL``: continue buffered)."""
        try:
            self._pwrite_chunk(view, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or self._direct_chunks:
                raise
            self._fall_back()
            self._pwrite_chunk(view, offset)
            return
        self._direct_chunks += 1

    def _flush_chunk(self, length: int, real: int | None = None) -> None:
        """Write ``length`` bytes of the buffer, ``real`` of them data (the rest: padding)."""
        assert self._view is not None
        real = length if real is None else real
        if self._positioned or (self._direct and self._streams > 1 and length == CHUNK_BYTES
                                and self._direct_chunks):
            self._write_behind(CHUNK_BYTES)  # the first chunk went synchronously: O_DIRECT works
            return
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
        self._direct_chunks += 1

    def _write_behind(self, length: int) -> None:
        """Hand the first ``length`` gathered bytes (a whole number of blocks) to a background
        ``pwrite`` and gather into another buffer."""
        if not self._positioned:
            self._offset = os.lseek(self._fd, 0, os.SEEK_CUR)
            self._positioned = True
        assert self._buf is not None and self._view is not None
        buf, view, offset = self._buf, self._view[:length], self._offset
        if self._streams == 1 or not self._direct_chunks:
            self._pwrite_now(view, offset)
        else:
            self._in_flight.append((write_pool().submit(self._pwrite_chunk, view, offset),
                                    buf))
            self._buf, self._view = None, None
        self._offset += length
        self._fill = 0
        self._wait_in_flight(self._streams - 1)
        self._buf = acquire_buffer() if self._buf is None else self._buf
        self._view = memoryview(self._buf) if self._view is None else self._view

    def _wait_in_flight(self, keep: int) -> None:
        """Wait until at most ``keep`` writes are in flight, reusing a finished one's buffer;
        raise the first failed write's error."""
        while len(self._in_flight) > keep:
            future, buf = self._in_flight.popleft()
            try:
                future.result()
            except BaseException:
                if buf is not None:
                    release_buffer(buf)
                raise
            if buf is None:
                continue
            if self._buf is None:
                self._buf, self._view = buf, None
            else:
                release_buffer(buf)

    def _write_tail_at_offset(self) -> None:
        """The gathered tail once writes are positioned: padded direct, else buffered."""
        assert self._view is not None
        tail = self._fill
        if self._direct:
            padded = -(-tail // ALIGN_BYTES) * ALIGN_BYTES
            self._view[tail:padded] = bytes(padded - tail)
            self._pwrite_chunk(self._view[:padded], self._offset, real=tail)
        else:
            self._pwrite_chunk(self._view[:tail], self._offset)
        self._offset += tail
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
        set_direct(self._fd, False)
        self._direct = False

    def _pwrite_chunk(self, view: memoryview, offset: int, real: int | None = None) -> None:
        """Write ``view`` at ``offset`` (``real`` bytes of it data, the rest padding), on this
        thread or a pool thread; a short unaligned direct write (the disk filled up) continues
        buffered."""
        real = len(view) if real is None else real
        done = 0
        while done < real:
            written = os.pwrite(self._fd, view[done:] if self._direct else view[done:real],
                                offset + done)
            if written <= 0:
                raise OSError(errno.EIO, "pwrite(2) wrote 0 bytes")
            done += written
            if done < real and self._direct and done % ALIGN_BYTES:
                self._fall_back()


__all__ = ["ALIGN_BYTES", "IN_PLACE", "IN_PLACE_ENV", "IN_PLACE_MIN_BYTES", "WRITE_STREAMS",
           "DirectFile"]
