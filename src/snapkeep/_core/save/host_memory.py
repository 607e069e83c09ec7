"""Host memory for staging: page-aligned buffers and copies spread over this rank's CPUs.

:class:`HeapAllocator` gives each staged storage its own buffer (those of at least
:data:`PAGE_ALIGNED_FROM_BYTES` page-aligned, so the local ``O_DIRECT`` commit writes them to
disk in place); :func:`copy_host` copies between host buffers with up to :func:`copy_threads`
threads. :mod:`~snapkeep._core.save.staging` decides *what* is copied; this module only where to and
how fast.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from typing import Any

import torch

_Path = tuple[Any, ...]


#: Host buffers of at least this many bytes are page-aligned (their own anonymous mapping), so
#: the local ``O_DIRECT`` commit writes them to disk without a copy.
PAGE_ALIGNED_FROM_BYTES = 1 << 20


def _host_buffer(nbytes: int) -> torch.UntypedStorage:
    """An uninitialised CPU storage of ``nbytes``; page-aligned from
    :data:`PAGE_ALIGNED_FROM_BYTES` (torch's allocator aligns to 64 bytes only)."""
    if nbytes < PAGE_ALIGNED_FROM_BYTES:
        return torch.UntypedStorage(nbytes)
    import mmap

    # private: a process forked later must not share (and scribble on) these pages
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mapped = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    # the storage holds the mapping's buffer: unmapped when the storage is freed
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes).untyped_storage()


class HeapAllocator:
    """Private (not shared) host buffers, one ``UntypedStorage`` per staged storage (those of at
    least :data:`PAGE_ALIGNED_FROM_BYTES` page-aligned).

    Args:
        pin_memory: pin buffers whose source is a CUDA tensor (when CUDA is available).
    """

    def __init__(self, *, pin_memory: bool = True) -> None:
        self._pin_memory = pin_memory
        self._buffers: dict[_Path, torch.UntypedStorage] = {}

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes() for b in self._buffers.values())

    def reserve(
        self, layout: list[tuple[_Path, int, bool]]
    ) -> tuple[list[torch.UntypedStorage], int]:
        """Buffers for ``layout`` entries ``(path, nbytes, source_is_cuda)``; bytes allocated."""
        out: list[torch.UntypedStorage] = []
        allocated = 0
        wanted = set()
        for path, nbytes, is_cuda in layout:
            wanted.add(path)
            buf = self._buffers.get(path)
            if buf is None or buf.nbytes() != nbytes:
                if is_cuda and self._pin_memory and torch.cuda.is_available():
                    buf = torch.UntypedStorage(nbytes).pin_memory()  # page-aligned by CUDA
                else:
                    buf = _host_buffer(nbytes)
                self._buffers[path] = buf
                allocated += nbytes
            out.append(buf)
        for stale in set(self._buffers) - wanted:  # the state shrank: free what it no longer uses
            del self._buffers[stale]
        return out, allocated


#: Host-to-host staging copies are cut into chunks of this many bytes, handed out one at a time
#: to up to :func:`copy_threads` threads (the caller's included).
COPY_CHUNK_BYTES = 16 << 20
#: At most this many threads copy at once (more rarely add memory bandwidth).
MAX_COPY_THREADS = 4
_COPY_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_COPY_POOL_LOCK = threading.Lock()


def copy_host(copies: list[tuple[int, int, int]]) -> None:
    """Copy ``(dst_ptr, src_ptr, nbytes)`` ranges between host buffers, each fully, in parallel.

    ``Tensor.copy_`` splits a copy statically across its OpenMP threads and waits for the
    slowest; on a busy machine (a background writer on one of two cores) that made staging 3-4x
    slower than one ``memcpy``. Here chunks are taken dynamically, so a descheduled thread only
    delays its current chunk. ``ctypes.memmove`` releases the GIL while it copies.
    """
    chunks = [(dst + off, src + off, min(COPY_CHUNK_BYTES, nbytes - off))
              for dst, src, nbytes in copies for off in range(0, nbytes, COPY_CHUNK_BYTES)]
    helpers = min(copy_threads(), len(chunks)) - 1
    if helpers <= 0:
        for chunk in chunks:
            ctypes.memmove(*chunk)
        return
    pending = iter(chunks)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                chunk = next(pending, None)
            if chunk is None:
                return
            ctypes.memmove(*chunk)

    futures = [_copy_pool().submit(work) for _ in range(helpers)]
    work()
    for future in futures:
        future.result()


def copy_threads() -> int:
    """Threads for a staging copy the training thread waits for (its own included).

    At least ``torch.get_num_threads()``; when a script runs torch with fewer threads than the
    CPUs it may use (one torch thread per rank leaves cores to the data loader, or idle while an
    accelerator computes), up to :data:`MAX_COPY_THREADS` of this rank's share of them
    (``len(os.sched_getaffinity(0))`` divided by torchrun's ``LOCAL_WORLD_SIZE``): the caller is
    blocked for the copy anyway, and a core that is busy only delays the chunk it holds.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(torch.get_num_threads(), min(MAX_COPY_THREADS, cpus // local_ranks))


def _forget_copy_pool_in_child() -> None:
    """A forked child has the pool object but not its threads: start a new one when needed."""
    global _COPY_POOL, _COPY_POOL_LOCK
    _COPY_POOL = None
    _COPY_POOL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_copy_pool_in_child)


def _copy_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _COPY_POOL
    with _COPY_POOL_LOCK:
        if _COPY_POOL is None:
            _COPY_POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, copy_threads() - 1),
                thread_name_prefix="snapkeep-stage")
        return _COPY_POOL
