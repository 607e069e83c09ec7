"""Shared-memory arenas: staging buffers that a worker process reads without another copy.

The trainer stages into one :class:`multiprocessing.shared_memory.SharedMemory` block per buffer
set; the worker opens the same block by name once and rebuilds tensors as zero-copy views of it.
Each staged storage becomes its own ``UntypedStorage`` of exactly its size (via
``torch.frombuffer``), so ``torch.save`` in the worker writes the same file it would write for the
source state. Only metadata and non-tensor leaves cross the pipe. The trainer's own tensors are
never moved into shared memory.

Arenas are named ``snapkeep_<pid>_<start>_<random>`` (pid and process start time of the owner, in
base 36), so that any later run can tell an arena whose owner is dead -- a SIGKILL of the whole
process group takes multiprocessing's resource tracker with it -- and unlink it
(:func:`reclaim_dead_arenas`, called whenever a writer creates staging buffers or starts a worker).
Arenas are not registered with the resource tracker (snapkeep unlinks its own, and reclaims a dead
owner's), so it never warns about "leaked shared_memory objects".
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import sys
import threading
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.save.host_memory import PAGE_ALIGNED_FROM_BYTES
from snapkeep._core.save.staging import apply_lazy_bits
from snapkeep._core.storage import base36, pid_alive

logger = logging.getLogger(__name__)
_ALIGN = 64
_PAGE = 4096


#: Prefix of every arena name (the leak fixture of the test suite and the reclaim rely on it).
ARENA_PREFIX = "snapkeep_"
_SHM_DIR = "/dev/shm"


def _start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc``), None if unknown or
    gone. With the pid it identifies a process even after its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    try:
        if fields[0] in (b"Z", b"X"):  # exited, not reaped: dead for our purpose
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def arena_name() -> str:
    """A fresh arena name carrying this process's pid and start time (<= 31 characters, the
    shortest limit of POSIX shared-memory names, macOS)."""
    pid = os.getpid()
    start = _start_ticks(pid)
    return (f"{ARENA_PREFIX}{base36(pid)}_{base36(start) if start is not None else 'x'}_"
            f"{secrets.token_hex(3)}")


def _owner_alive(name: str) -> bool:
    parts = name[len(ARENA_PREFIX):].split("_")
    if len(parts) != 3:
        return True  # not ours to judge
    try:
        pid = int(parts[0], 36)
    except ValueError:
        return True
    if not pid_alive(pid):  # gone, or a zombie
        return False
    start = _start_ticks(pid)  # alive: the same process, or a later one given its pid?
    if parts[1] == "x" or not os.path.isdir("/proc"):
        return True
    return start is not None and base36(start) == parts[1]


def reclaim_dead_arenas() -> list[str]:
    """Unlink the staging arenas of snapkeep processes that are gone (killed with their whole
    process group, so nobody unlinked them); return their names. Linux (``/dev/shm``) only;
    elsewhere a no-op. Arenas of live processes, and other programs' segments, are left alone."""
    if not sys.platform.startswith("linux") or not os.path.isdir(_SHM_DIR):
        return []
    removed = []
    try:
        names = os.listdir(_SHM_DIR)
    except OSError as e:
        logger.debug("cannot list %s to reclaim staging arenas: %s", _SHM_DIR, e)
        return []
    for name in names:
        if not name.startswith(ARENA_PREFIX) or _owner_alive(name):
            continue
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
        except FileNotFoundError:
            continue
        except OSError as e:
            logger.warning("could not unlink the staging arena %s of a dead process: %s", name, e)
            continue
        removed.append(name)
        logger.info("unlinked shared-memory staging arena %s left by a killed process", name)
    return removed


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Keep ``shm`` away from multiprocessing's resource tracker (Python < 3.13 registers every
    segment, also on attach): snapkeep unlinks its arenas itself and reclaims dead owners'."""
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception as e:  # the tracker is an optimisation here, never a reason to fail
        logger.debug("could not unregister arena %s from the resource tracker: %s", shm.name, e)


def _create_shm(size: int) -> shared_memory.SharedMemory:
    """A new arena of ``size`` bytes whose memory is allocated now (``posix_fallocate``): a
    ``/dev/shm`` too small for it fails here with ``ENOSPC``, not later with a ``SIGBUS`` that
    kills the trainer when the staging copy touches a page tmpfs cannot back.

    Raises:
        SnapshotStorageError: the segment cannot be created or filled (``/dev/shm`` full or
            too small, ``RLIMIT_FSIZE``, out of memory); nothing is left in ``/dev/shm``.
    """
    name = arena_name()
    try:
        if sys.version_info >= (3, 13):
            shm = shared_memory.SharedMemory(name=name, create=True, size=size,
                                              track=False)  # type: ignore[call-arg]
        else:
            shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            _untrack(shm)
    except OSError as e:
        raise _arena_error(e, name, size) from e
    try:
        os.posix_fallocate(shm._fd, 0, size)  # type: ignore[attr-defined]
    except AttributeError:  # not POSIX: no /dev/shm to run out of
        pass
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            logger.debug("posix_fallocate of arena %s refused (%s); pages are allocated on "
                         "first touch", name, e)
        else:
            shm.close()
            _unlink_shm(shm)
            raise _arena_error(e, name, size) from e
    return shm


def _arena_error(e: OSError, name: str, size: int) -> SnapshotStorageError:
    return SnapshotStorageError(
        f"cannot allocate the {size}-byte shared-memory staging arena {_SHM_DIR}/{name} "
        f"({e.strerror or e}): a process writer stages the whole state in {_SHM_DIR}; make it "
        "larger (docker run --shm-size, a bigger tmpfs size=), raise the file-size limit "
        "(ulimit -f), or use ThreadWriter/ThreadQueueWriter, which stage in private memory",
        errno=e.errno, filename=f"{_SHM_DIR}/{name}", size_bytes=size)


def _attach_shm(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False,
                                          track=False)  # type: ignore[call-arg]
    shm = shared_memory.SharedMemory(name=name, create=False)
    _untrack(shm)
    return shm


def _unlink_shm(shm: shared_memory.SharedMemory) -> None:
    """Unlink without telling the resource tracker (it never knew the arena)."""
    try:
        from _posixshmem import shm_unlink  # type: ignore[import-not-found]
    except ImportError:  # not POSIX: the platform frees it with the last handle
        return
    try:
        shm_unlink(shm._name)  # type: ignore[attr-defined]
    except FileNotFoundError:
        pass


def _align(n: int, alignment: int = _ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


def _view(buf: Any, offset: int, nbytes: int) -> torch.UntypedStorage:
    if nbytes == 0:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()


class SharedArena:
    """A growable shared-memory block used as a staging allocator (see ``BufferSet``).

    The block is sized to the state on first use and replaced by a larger one (x1.25) when the
    state grows. Not thread-safe: one arena belongs to one buffer set.
    """

    def __init__(self) -> None:
        reclaim_dead_arenas()
        self._shm: shared_memory.SharedMemory | None = None
        self._offsets: list[int] = []
        self._views: list[torch.UntypedStorage] = []
        self._layout_key: list[tuple[Any, int]] | None = None

    @property
    def name(self) -> str | None:
        return self._shm.name if self._shm is not None else None

    @property
    def total_bytes(self) -> int:
        return self._shm.size if self._shm is not None else 0

    def reserve(
        self, layout: list[tuple[Any, int, bool]]
    ) -> tuple[list[torch.UntypedStorage], int]:
        key = [(path, nbytes) for path, nbytes, _ in layout]
        if key == self._layout_key and self._shm is not None:
            return self._views, 0
        offsets = []
        total = 0
        for _path, nbytes, _ in layout:
            if nbytes >= PAGE_ALIGNED_FROM_BYTES:  # the worker writes it to disk in place
                total = _align(total, _PAGE)
            offsets.append(total)
            total += _align(nbytes)
        allocated = 0
        if self._shm is None or self._shm.size < total:
            self._release_views()
            self.close()
            size = max(_ALIGN, total if self._shm is None else int(total * 1.25))
            self._shm = _create_shm(size)
            allocated = size
            logger.debug("allocated shared staging arena %s of %d bytes", self._shm.name, size)
        self._release_views()
        self._views = [_view(self._shm.buf, off, n) for off, (_p, n, _c) in zip(offsets, layout)]
        self._offsets = offsets
        self._layout_key = key
        return self._views, allocated

    def export(self, staged: Any) -> tuple[Any, list[tuple[int, int]]]:
        """Replace the arena's tensors in ``staged`` by references the worker can resolve.

        Returns:
            ``(skeleton, storages)`` where ``storages[i] = (offset, nbytes)`` in this arena.
        """
        by_ptr = {v.data_ptr(): i for i, v in enumerate(self._views) if v.nbytes()}
        table = [(off, v.nbytes()) for off, v in zip(self._offsets, self._views)]
        return _export(staged, by_ptr), table

    def _release_views(self) -> None:
        self._views = []
        self._layout_key = None

    def close(self) -> None:
        """Unlink the block (the trainer owns it); the worker only closes its mapping."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        self._views = []
        try:
            shm.close()
        except BufferError:  # a staged tree still references it; the mapping dies with it
            logger.debug("shared arena %s still referenced at close", shm.name)
        _unlink_shm(shm)


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor in a shared arena: storage index plus the view's geometry."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    parameter: bool
    conj: bool = False
    neg: bool = False


def _export(node: Any, by_ptr: dict[int, int]) -> Any:
    if isinstance(node, torch.Tensor):
        storage = node.untyped_storage()
        index = by_ptr.get(storage.data_ptr(), -1) if storage.nbytes() else -1
        if index < 0:  # an empty storage: rebuilt as an empty one
            index = -1
        return TensorRef(
            storage=index, dtype=node.dtype, size=tuple(node.size()), stride=tuple(node.stride()),
            offset=int(node.storage_offset()), requires_grad=node.requires_grad,
            parameter=isinstance(node, torch.nn.Parameter), conj=node.is_conj(),
            neg=node.is_neg(),
        )
    if isinstance(node, dict):
        out = {} if type(node) is dict else _copy_dict_shell(node)
        for key, value in node.items():
            out[key] = _export(value, by_ptr)
        return out
    if isinstance(node, list):
        return [_export(v, by_ptr) for v in node]
    if isinstance(node, tuple):
        items = [_export(v, by_ptr) for v in node]
        if hasattr(node, "_fields"):
            return type(node)(*items)
        return tuple(items) if type(node) is tuple else type(node)(items)
    return node


def _copy_dict_shell(node: dict[Any, Any]) -> dict[Any, Any]:
    import copy

    shell = copy.copy(node)
    shell.clear()
    return shell


class ArenaReader:
    """Worker-side: opens arenas by name once and rebuilds tensors as views of them."""

    def __init__(self) -> None:
        self._open: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()

    def rebuild(self, name: str, skeleton: Any, storages: list[tuple[int, int]]) -> Any:
        with self._lock:
            shm = self._open.get(name)
            if shm is None:
                # the trainer owns and unlinks the block; not tracked here (see _untrack)
                shm = _attach_shm(name)
                self._open[name] = shm
        views = [_view(shm.buf, off, n) for off, n in storages]
        return _resolve(skeleton, views)

    def forget_except(self, keep: set[str]) -> None:
        """Close mappings of arenas the trainer replaced."""
        with self._lock:
            for name in [n for n in self._open if n not in keep]:
                shm = self._open.pop(name)
                try:
                    shm.close()
                except BufferError:
                    logger.debug("arena %s still referenced; left mapped", name)


def _resolve(node: Any, views: list[torch.UntypedStorage]) -> Any:
    if isinstance(node, TensorRef):
        storage = views[node.storage] if node.storage >= 0 else torch.UntypedStorage(0)
        out = torch.empty((0,), dtype=node.dtype)
        out.set_(storage, node.offset, node.size, node.stride)  # type: ignore[call-overload]
        if node.parameter:
            return torch.nn.Parameter(out, requires_grad=node.requires_grad)
        if node.requires_grad:
            out.requires_grad_(True)
        return apply_lazy_bits(out, conj=node.conj, neg=node.neg)
    if isinstance(node, dict):
        for key, value in list(node.items()):
            node[key] = _resolve(value, views)
        return node
    if isinstance(node, list):
        return [_resolve(v, views) for v in node]
    if isinstance(node, tuple):
        items = [_resolve(v, views) for v in node]
        if hasattr(node, "_fields"):
            return type(node)(*items)
        return tuple(items) if type(node) is tuple else type(node)(items)
    return node
