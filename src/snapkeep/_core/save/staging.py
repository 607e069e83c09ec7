"""Staging: a consistent CPU copy of a state tree, into buffers reused across snapshots.

After :meth:`Stager.stage` returns, the caller may mutate every tensor of the source in place;
the staged tree keeps the values of the call. Copies go per *storage*, not per tensor, so tensors
that share a storage (tied weights, views) still share one in the staged tree and ``torch.save``
writes exactly what it would have written for the source.

Buffers are allocated once per (tree path, size in bytes) and reused; a different size reallocates
that buffer only. CUDA sources are copied into pinned host buffers with non-blocking copies on a
side stream, synchronised before ``stage`` returns. Buffers can live in shared memory so that a
persistent worker process reads them without another copy.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from snapkeep._core.save.host_memory import COPY_CHUNK_BYTES, HeapAllocator, copy_host

logger = logging.getLogger(__name__)

_Path = tuple[Any, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageStats:
    """What one :meth:`BufferSet.stage` did.

    Attributes:
        tensor_bytes: bytes copied from tensor storages.
        allocated_bytes: bytes of buffers newly allocated by this call (0 once warm).
        num_storages: distinct storages copied.
    """

    tensor_bytes: int
    allocated_bytes: int
    num_storages: int


class BufferSet:
    """One set of reusable staging buffers; holds at most one staged snapshot at a time.

    Args:
        allocator: where buffers live: :class:`HeapAllocator` (default) or a shared-memory arena
            (:class:`snapkeep._core.save.shm.SharedArena`) for a worker process.
    """

    def __init__(self, allocator: Any = None) -> None:
        from snapkeep._core.save.shm import reclaim_dead_arenas

        reclaim_dead_arenas()  # any writer's start frees the staging memory of killed runs
        self.allocator = allocator if allocator is not None else HeapAllocator()

    def stage(self, tree: Any) -> tuple[Any, StageStats]:
        """Copy ``tree`` into this set's buffers and return the staged tree and statistics.

        Containers (dict and subclasses incl. ``OrderedDict`` with ``_metadata``, list, tuple,
        namedtuple) are rebuilt; tensors (any device; dense, strided) become CPU tensors in the
        buffers with the same dtype, shape, stride, storage offset and ``requires_grad``;
        ``nn.Parameter`` stays a Parameter; every other leaf is ``copy.deepcopy``-ed.

        Lazy conjugate/negative bits (``x.conj()``, ``torch._neg_view``) are kept, so the staged
        tree holds exactly the source's values, for every dtype torch can store densely.

        Raises:
            TypeError: a sparse, nested, quantized or meta tensor, naming its key and dtype (save
                those with a :class:`~snapkeep.writing.SimpleWriter`; see
                :func:`refuse_unstageable`).
        """
        sources: dict[tuple[str, int, int], int] = {}
        layout: list[tuple[_Path, int, bool]] = []
        storages: list[torch.UntypedStorage] = []
        _collect(tree, (), sources, layout, storages)
        buffers, allocated = self.allocator.reserve(layout)
        streams: list[Any] = []
        host_copies: list[tuple[int, int, int]] = []
        total = 0
        for src, dst in zip(storages, buffers):
            nbytes = src.nbytes()
            total += nbytes
            if not nbytes:
                continue
            if src.device.type == "cpu":
                host_copies.append((dst.data_ptr(), src.data_ptr(), nbytes))
            else:
                _copy_from_device(src, dst, streams)
        copy_host(host_copies)
        for stream in streams:
            stream.synchronize()
        staged = _rebuild(tree, sources, buffers)
        return staged, StageStats(
            tensor_bytes=total, allocated_bytes=allocated, num_storages=len(buffers)
        )


def _copy_from_device(src: torch.UntypedStorage, dst: torch.UntypedStorage,
                      streams: list[Any]) -> None:
    """Copy the bytes of a non-CPU storage ``src`` into the host buffer ``dst``. CUDA copies
    run non-blocking on a side stream (appended to ``streams``: the caller synchronises them
    before the staged tree is handed on); other devices copy synchronously."""
    src_bytes = torch.empty((0,), dtype=torch.uint8, device=src.device).set_(src)
    dst_bytes = torch.empty((0,), dtype=torch.uint8).set_(dst)
    if src.device.type == "cuda":
        stream = _side_stream(src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst_bytes.copy_(src_bytes, non_blocking=True)
        if stream not in streams:
            streams.append(stream)
    else:
        dst_bytes.copy_(src_bytes)


def stage_split(
    buffers: BufferSet, tree: Any, defer: Any,
) -> tuple[Any, StageStats, list[tuple[tuple[str, int, int], torch.UntypedStorage,
                                       torch.UntypedStorage]]]:
    """:meth:`BufferSet.stage`, except that host storages for which ``defer(ident)`` is true
    (``ident`` = ``(device, address, bytes)``) are not copied: they are returned as
    ``(ident, source, buffer)`` for the caller to copy later (see
    :mod:`snapkeep._core.save.overlap`).
    The staged tree already refers to their buffers. ``StageStats.tensor_bytes`` counts the
    bytes copied now.

    Raises:
        TypeError: as :meth:`BufferSet.stage`.
    """
    sources: dict[tuple[str, int, int], int] = {}
    layout: list[tuple[_Path, int, bool]] = []
    storages: list[torch.UntypedStorage] = []
    _collect(tree, (), sources, layout, storages)
    reserved, allocated = buffers.allocator.reserve(layout)
    idents = {index: ident for ident, index in sources.items()}
    now: list[tuple[int, int, int]] = []
    later = []
    streams: list[Any] = []
    total = 0
    for index, (src, dst) in enumerate(zip(storages, reserved)):
        nbytes = src.nbytes()
        if not nbytes:
            continue
        if src.device.type == "cpu" and defer(idents[index]):
            later.append((idents[index], src, dst))
            continue
        total += nbytes
        if src.device.type == "cpu":
            now.append((dst.data_ptr(), src.data_ptr(), nbytes))
            continue
        _copy_from_device(src, dst, streams)
    copy_host(now)
    for stream in streams:
        stream.synchronize()
    staged = _rebuild(tree, sources, reserved)
    return staged, StageStats(tensor_bytes=total, allocated_bytes=allocated,
                              num_storages=len(reserved)), later


def collect_storages(tree: Any) -> tuple[dict[tuple[str, int, int], int],
                                         list[torch.UntypedStorage]]:
    """The distinct tensor storages of ``tree`` in staging order, and each storage identity's
    ``(device, address, bytes)`` index in that list.

    Raises:
        TypeError: as :meth:`BufferSet.stage`.
    """
    sources: dict[tuple[str, int, int], int] = {}
    layout: list[tuple[_Path, int, bool]] = []
    storages: list[torch.UntypedStorage] = []
    _collect(tree, (), sources, layout, storages)
    return sources, storages


def rebuild_onto(tree: Any, sources: dict[tuple[str, int, int], int],
                 buffers: list[torch.UntypedStorage]) -> Any:
    """``tree`` rebuilt as :meth:`BufferSet.stage` does, each tensor a view of
    ``buffers[sources[its storage identity]]`` (``sources`` from :func:`collect_storages`)."""
    return _rebuild(tree, sources, buffers)


def prefault(buffers: BufferSet, tree: Any) -> int:
    """Allocate ``buffers``' staging buffers for a tree shaped like ``tree`` and fault them in
    (zero-fill every page), so that staging a snapshot of it later only copies. Returns the
    bytes faulted in (0 when the buffers were already there).

    Only layouts (tree paths and storage sizes) are read from ``tree``, never its values, so it
    may be called from a background thread while training runs, as long as ``tree``'s
    containers are not mutated meanwhile (pass a fresh ``state_dict()``). Not thread-safe with
    :meth:`BufferSet.stage` on the same ``buffers``: the caller serialises them.

    Raises:
        TypeError: as :meth:`BufferSet.stage`, for tensors that cannot be staged.
    """
    sources: dict[tuple[str, int, int], int] = {}
    layout: list[tuple[_Path, int, bool]] = []
    storages: list[torch.UntypedStorage] = []
    _collect(tree, (), sources, layout, storages)
    reserved, allocated = buffers.allocator.reserve(layout)
    if not allocated:
        return 0
    chunks = [(buf.data_ptr() + off, min(COPY_CHUNK_BYTES, buf.nbytes() - off))
              for buf in reserved if buf.device.type == "cpu"
              for off in range(0, buf.nbytes(), COPY_CHUNK_BYTES)]
    for ptr, nbytes in chunks:
        ctypes.memset(ptr, 0, nbytes)  # releases the GIL, like the staging copy
    return allocated


def refuse_unstageable(tensor: torch.Tensor, path: _Path) -> None:
    """Refuse a tensor whose bytes are not one dense strided storage, naming its key and kind.

    Staging copies storages byte for byte and rebuilds each view (dtype, size, stride, offset,
    lazy conjugate/negative bits), which is exact for every dense strided tensor of any dtype.
    Sparse, nested, quantized and meta tensors are not that.

    Raises:
        TypeError: naming the key path, the dtype and what is unsupported, and what to do.
    """
    kind = None
    if tensor.is_nested:
        kind = "a nested tensor"
    elif tensor.layout != torch.strided:
        kind = f"layout {tensor.layout} (sparse)" if "sparse" in str(tensor.layout) \
            else f"layout {tensor.layout}"
    elif tensor.is_quantized:
        kind = "a quantized tensor"
    elif tensor.device.type == "meta":
        kind = "a meta tensor (it has no data to save)"
    if kind is None:
        return
    where = "/".join(map(str, path)) or "<root>"
    raise TypeError(
        f"cannot stage the tensor at {where} (dtype {tensor.dtype}): {kind} is not supported by "
        "background writers, which copy dense strided tensors; save it with SimpleWriter "
        "(optionally with a custom savefun), or convert it first (.to_dense(), .dequantize(), "
        "a real device)")


def apply_lazy_bits(tensor: torch.Tensor, *, conj: bool, neg: bool) -> torch.Tensor:
    """``tensor`` with the lazy conjugate/negative bits of its source set again (a view of the
    same storage, as ``x.conj()`` / ``torch._neg_view(x)`` made them): staging copies the raw
    storage, whose values are the source's before those bits apply."""
    if neg:
        tensor = torch._neg_view(tensor)
    if conj:
        tensor = tensor.conj()
    return tensor


def _storage_ident(t: torch.Tensor) -> tuple[str, int, int]:
    s = t.untyped_storage()
    return (str(s.device), s.data_ptr(), s.nbytes())


#: Immutable leaf types: never hold a tensor, shared (not copied) by the staged tree.
_ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None)})


def atomic(node: Any) -> bool:
    """A leaf of an immutable type, or a plain tuple of them (``random.getstate()``'s 625
    ints): nothing to collect, stage or copy."""
    kind = type(node)
    return kind in _ATOMS or (kind is tuple and all(type(v) in _ATOMS for v in node))


def _collect(
    node: Any, path: _Path, sources: dict[tuple[str, int, int], int],
    layout: list[tuple[_Path, int, bool]], storages: list[torch.UntypedStorage],
) -> None:
    if atomic(node):
        return
    if isinstance(node, torch.Tensor):
        refuse_unstageable(node, path)
        ident = _storage_ident(node)
        if ident not in sources:
            storage = node.detach().untyped_storage()
            sources[ident] = len(storages)
            storages.append(storage)
            layout.append((path, storage.nbytes(), storage.device.type == "cuda"))
    elif isinstance(node, dict):
        for key, value in node.items():
            _collect(value, (*path, key), sources, layout, storages)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _collect(value, (*path, i), sources, layout, storages)


def _rebuild(
    node: Any, sources: dict[tuple[str, int, int], int], buffers: list[torch.UntypedStorage]
) -> Any:
    if atomic(node):
        return node
    if isinstance(node, torch.Tensor):
        dst = buffers[sources[_storage_ident(node)]]
        out = torch.empty((0,), dtype=node.dtype)
        out.set_(dst, node.storage_offset(), node.size(), node.stride())  # type: ignore[call-overload]
        if isinstance(node, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=node.requires_grad)
        if node.requires_grad:
            out.requires_grad_(True)
        return apply_lazy_bits(out, conj=node.is_conj(), neg=node.is_neg())
    if isinstance(node, dict):
        out_dict = copy.copy(node)
        if hasattr(node, "__dict__"):
            out_dict.__dict__.update(copy.deepcopy(node.__dict__))
        for key, value in node.items():
            out_dict[key] = _rebuild(value, sources, buffers)
        return out_dict
    if isinstance(node, list):
        return [_rebuild(v, sources, buffers) for v in node]
    if isinstance(node, tuple):
        items = [_rebuild(v, sources, buffers) for v in node]
        if hasattr(node, "_fields"):  # namedtuple
            return type(node)(*items)
        return tuple(items) if type(node) is tuple else type(node)(items)
    return copy.deepcopy(node)


_SIDE_STREAMS: dict[Any, Any] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def _side_stream(device: torch.device) -> Any:
    with _SIDE_STREAMS_LOCK:
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            _SIDE_STREAMS[device] = stream
        return stream


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor leaf of a tree of dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from iter_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from iter_tensors(v)


def has_accelerator_tensor(tree: Any) -> bool:
    return any(t.device.type != "cpu" for t in iter_tensors(tree))
