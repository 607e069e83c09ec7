"""Incremental single-file snapshots: large tensor storages stored once, as content-addressed
blobs, and every snapshot still standalone for snapkeep's readers.

What is written (the commit, :func:`encode`, wherever the writer runs): each tensor storage of
at least ``min_blob_bytes`` becomes a blob of the template's area
(:mod:`snapkeep._core.tiers.blobs`),
published and made durable *before* the snapshot; the snapshot file itself is a small
``torch.save`` file, the *skeleton*: the state tree with those tensors replaced by
:class:`TensorRef` (storage number, dtype, shape, stride, offset, ``requires_grad``, whether it
was an ``nn.Parameter``, lazy conjugate/negative bits), the table of storages (digest and size of
each), and where the area is. Smaller tensors and every other value stay inline. Tensors that
shared a storage share one again when loaded (storages are numbered by identity at save time,
never merged by content). The manifest lists every blob the snapshot needs with its size; the
blob's name is its XXH3-128 checksum.

What is not written again (the training thread, :class:`IncrementalTracker`): a storage whose
tensors' version counters, storage identity and layout are those recorded when the lineage's
last snapshot committed is *unchanged*: it is neither staged nor written; the snapshot refers to
the blob of that commit. Before the write, in the trainer process (:meth:`IncrementalPlan.confirm`,
in the writer's thread), its live bytes are hashed and must hash to that blob:

- same digest: the snapshot refers to the blob, which must hold the right bytes
  (:meth:`~snapkeep._core.tiers.blobs.BlobArea.intact`: proven unchanged since this process wrote or
  verified it, or read and hashed); a missing, damaged or replaced blob is written again from
  those bytes;
- another digest, and a counter moved since the call: an in-place write *after* the call (an EMA
  updated right after the snapshot call); the counters at the call vouch for the blob's bytes, as
  they do for an overlapped staging copy (:mod:`snapkeep._core.save.overlap`);
- another digest, counters unmoved: the tensor changed behind its version counter (a write
  through ``.data``, a raw pointer, another process). The snapshot is dropped
  (:class:`StagingRaceError`, never written) and the tracker forgets the storage, so the next
  snapshot stages and writes it in full.

A changed storage is staged (the staging copy and the overlap are unchanged) and written. Where
the tracker knew it and its counter moved, it is written and hashed in one pass; where the
tracker has no record (the first snapshot of a process, a resumed run), it is hashed first and
written only when its blob is not there yet or does not hold the right bytes (a resumed run
rewrites nothing unchanged: the blobs it loaded are proven).

Reading: :func:`materialise` (called by :func:`snapkeep._core.load.loading.load_file` for every
reader) reads each blob into a new storage, verifying its size and digest while it reads, and
rebuilds the tree; a missing or corrupt blob makes the snapshot corrupt (readers fall back).

A bare ``torch.load(path)``: with ``weights_only=True`` (torch's default) torch refuses the
global ``snapkeep._core.tiers.incremental.open_incremental_snapshot``; with ``weights_only=False``
unpickling calls it, and it raises :class:`IncrementalSnapshotError` saying to load the file with
snapkeep or to run ``snapkeep convert``. Either way nothing of the state is returned.
"""

from __future__ import annotations

import concurrent.futures
import copy
import ctypes
import dataclasses
import logging
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, NoReturn

import torch

from snapkeep._core.errors import (
    IncrementalSnapshotError,
    SnapshotCorruptError,
    StagingRaceError,
)
from snapkeep._core.format.manifest import MANIFEST_DIR
from snapkeep._core.save.staging import apply_lazy_bits, atomic
from snapkeep._core.storage import Storage, new_hasher
from snapkeep._core.tiers.blobs import BLOBS_DIR, BlobArea, BlobLedger, area_directory, ledger_for

logger = logging.getLogger(__name__)

#: The format of a skeleton (checked when it is opened).
FORMAT = "snapkeep.incremental/1"
#: Storages of at least this many bytes become blobs by default; smaller ones stay inline.
DEFAULT_MIN_BLOB_BYTES = 1 << 20
#: Bytes per write and per hash update of a blob.
_CHUNK_BYTES = 64 << 20
#: Most blobs one commit publishes at once.
PUBLISH_THREADS = 4

_Path = tuple[Any, ...]


# -- the file format -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorRef:
    """A tensor of a skeleton whose storage is a blob.

    Attributes:
        storage: index into :attr:`Skeleton.storages`.
        dtype: the tensor's dtype name (``'float32'``).
        shape: its sizes.
        stride: its strides, in elements.
        offset: its storage offset, in elements.
        requires_grad: as saved.
        parameter: it was an ``nn.Parameter``.
        conj: lazy conjugate bit (``x.conj()``).
        neg: lazy negative bit.
    """

    storage: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool = False
    parameter: bool = False
    conj: bool = False
    neg: bool = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return tensor_ref, (self.storage, self.dtype, self.shape, self.stride, self.offset,
                            self.requires_grad, self.parameter, self.conj, self.neg)


def tensor_ref(storage: Any, dtype: Any, shape: Any, stride: Any, offset: Any,
               requires_grad: Any, parameter: Any, conj: Any, neg: Any) -> TensorRef:
    """A :class:`TensorRef` from unpickled values, each checked (the file is untrusted).

    Raises:
        SnapshotCorruptError: a value of the wrong type or range.
    """
    ints = (storage, offset, *_int_tuple(shape, "shape"), *_int_tuple(stride, "stride"))
    if any(type(v) is not int or v < 0 for v in ints) or \
            any(type(v) is not bool for v in (requires_grad, parameter, conj, neg)) or \
            len(shape) != len(stride):
        raise SnapshotCorruptError(f"skeleton: invalid tensor reference {storage!r} {shape!r}")
    if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise SnapshotCorruptError(f"skeleton: unknown dtype {dtype!r}")
    return TensorRef(storage=storage, dtype=dtype, shape=tuple(shape), stride=tuple(stride),
                     offset=offset, requires_grad=requires_grad, parameter=parameter, conj=conj,
                     neg=neg)


def _int_tuple(value: Any, what: str) -> tuple[Any, ...]:
    if not isinstance(value, (tuple, list)):
        raise SnapshotCorruptError(f"skeleton: tensor {what} {value!r} is not a tuple")
    return tuple(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Skeleton:
    """The object an incremental snapshot file holds (see the module docstring).

    Attributes:
        area: the blob area, relative to the snapshot's directory
            (``'.snapkeep/blobs/<template key>'``).
        storages: ``(digest, size in bytes)`` of each blob storage, by number.
        tree: the state with :class:`TensorRef` in place of the blob tensors.
    """

    area: str
    storages: tuple[tuple[str, int], ...]
    tree: Any

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return open_incremental_snapshot, (FORMAT, self.area,
                                           [list(s) for s in self.storages], self.tree)

    def digests(self) -> dict[str, int]:
        """Every blob it needs: digest -> size in bytes."""
        return {digest: nbytes for digest, nbytes in self.storages}


#: What a bare ``torch.load(path, weights_only=False)`` of an incremental snapshot raises.
BARE_LOAD_MESSAGE = (
    "this is an incremental snapkeep snapshot: its large tensors are stored once, as blobs in "
    "the .snapkeep/blobs directory beside it, and a plain torch.load cannot put them back. "
    "Load it with snapkeep (Checkpointer.load, snapkeep.load_latest, the snapshot extension's "
    "autoload), or write a plain torch.save file with: snapkeep convert SNAPSHOT OUT.pt")


def open_incremental_snapshot(*args: Any) -> NoReturn:
    """What an incremental snapshot's pickle calls first when unpickled by anything but
    snapkeep: refuses (snapkeep's readers map this name to :func:`_open_skeleton`).

    Raises:
        IncrementalSnapshotError: always (:data:`BARE_LOAD_MESSAGE`).
    """
    raise IncrementalSnapshotError(BARE_LOAD_MESSAGE)


def _open_skeleton(fmt: Any, area: Any, storages: Any, tree: Any) -> Skeleton:
    """The :class:`Skeleton` of unpickled values, checked (untrusted input).

    Raises:
        SnapshotCorruptError: another format, an area outside ``.snapkeep/blobs``, or a storage
            table of the wrong shape.
    """
    if fmt != FORMAT:
        raise SnapshotCorruptError(f"incremental snapshot of format {fmt!r}; this snapkeep "
                                   f"reads {FORMAT!r}")
    if not isinstance(area, str) or not _area_is_safe(area):
        raise SnapshotCorruptError(f"incremental snapshot: blob area {area!r} is not under "
                                   f"{MANIFEST_DIR}/{BLOBS_DIR}")
    table = []
    for item in storages if isinstance(storages, list) else [None]:
        if not (isinstance(item, (list, tuple)) and len(item) == 2
                and isinstance(item[0], str) and type(item[1]) is int and item[1] >= 0):
            raise SnapshotCorruptError(f"incremental snapshot: invalid storage entry {item!r}")
        table.append((item[0], item[1]))
    return Skeleton(area=area, storages=tuple(table), tree=tree)


def _area_is_safe(area: str) -> bool:
    parts = area.split("/")
    return (len(parts) == 3 and parts[:2] == [MANIFEST_DIR, BLOBS_DIR]
            and parts[2] not in ("", ".", "..") and "\0" not in area)


#: The skeleton's globals, for ``torch.load(weights_only=True)`` (see
#: :data:`snapkeep._core.load.loading.SAFE_GLOBALS`): the refusing name maps to the real opener.
#: The module path skeletons written before the core's re-cut into sub-packages name (their
#: pickles record ``<module>.tensor_ref`` and ``<module>.open_incremental_snapshot``); both paths
#: open, so those snapshots still resume. (Spelt in two parts so that a path rewrite of the
#: source leaves the recorded on-disk name alone.)
LEGACY_MODULE = "snapkeep._core" + ".incremental"
SAFE_GLOBALS: list[Any] = [
    tensor_ref, (_open_skeleton, f"{__name__}.{open_incremental_snapshot.__qualname__}"),
    (tensor_ref, f"{LEGACY_MODULE}.{tensor_ref.__qualname__}"),
    (_open_skeleton, f"{LEGACY_MODULE}.{open_incremental_snapshot.__qualname__}"),
]


class _Unpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that opens skeletons (``torch.load(weights_only=False)``)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in (__name__, LEGACY_MODULE) and name == open_incremental_snapshot.__qualname__:
            return _open_skeleton
        if module == LEGACY_MODULE and name == tensor_ref.__qualname__:
            return tensor_ref
        return super().find_class(module, name)


class PICKLE_MODULE:  # noqa: N801 -- stands in for the ``pickle`` module in torch.load
    """``torch.load(..., pickle_module=PICKLE_MODULE)`` for ``weights_only=False``: as
    ``pickle``, except that skeletons open instead of refusing."""

    Unpickler = _Unpickler
    Pickler = pickle.Pickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return _Unpickler(file, **kwargs).load()


# -- reading ---------------------------------------------------------------------------------------
def is_skeleton(obj: Any) -> bool:
    return isinstance(obj, Skeleton)


def area_of(storage: Storage, snapshot_path: str, skeleton: Skeleton) -> BlobArea:
    """The blob area a skeleton at ``snapshot_path`` refers to."""
    return BlobArea(storage=storage, directory=storage.join(
        storage.dirname(snapshot_path), *skeleton.area.split("/")))


def materialise(skeleton: Skeleton, area: BlobArea, *, map_location: Any = "cpu") -> Any:
    """The state a skeleton stands for: each blob read into a new storage and verified (size
    and digest, in one pass), each :class:`TensorRef` a tensor viewing it as saved.

    Args:
        skeleton: from the snapshot file.
        area: where its blobs are (:func:`area_of`).
        map_location: as ``torch.load``'s: None, a device or its name, a dict of location
            names, or a callable ``(storage, 'cpu') -> storage``.

    Raises:
        SnapshotCorruptError: a blob is missing, truncated or corrupt, or a reference does not
            fit its storage.
        SnapshotStorageError: the store could not be reached.
    """
    storages = _in_parallel(lambda item: _place(area.read(*item), map_location),
                            skeleton.storages)  # reads overlap (cold disks, object stores)
    return _rebuild(skeleton.tree, storages)


def _place(storage: torch.UntypedStorage, map_location: Any) -> torch.UntypedStorage:
    if map_location is None:
        return storage
    if callable(map_location):
        return map_location(storage, "cpu")  # type: ignore[no-any-return]
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu", "cpu")
    device = torch.device(map_location)
    return storage if device.type == "cpu" else storage.to(device=device)


def _rebuild(node: Any, storages: list[torch.UntypedStorage]) -> Any:
    if atomic(node):
        return node
    if isinstance(node, TensorRef):
        return _tensor_of(node, storages)
    if isinstance(node, dict):
        out = copy.copy(node)
        for key, value in node.items():
            out[key] = _rebuild(value, storages)
        return out
    if isinstance(node, list):
        return [_rebuild(v, storages) for v in node]
    if isinstance(node, tuple):
        items = [_rebuild(v, storages) for v in node]
        if hasattr(node, "_fields"):
            return type(node)(*items)
        return tuple(items) if type(node) is tuple else type(node)(items)
    return node


def _tensor_of(ref: TensorRef, storages: list[torch.UntypedStorage]) -> torch.Tensor:
    if ref.storage >= len(storages):
        raise SnapshotCorruptError(f"skeleton: tensor reference to storage {ref.storage} of "
                                   f"{len(storages)}")
    storage = storages[ref.storage]
    dtype = getattr(torch, ref.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if ref.shape and all(ref.shape):
        last = ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride))
        if (last + 1) * itemsize > storage.nbytes():
            raise SnapshotCorruptError(
                f"skeleton: a {ref.dtype} tensor of shape {ref.shape} does not fit its "
                f"{storage.nbytes()}-byte storage")
    out = torch.empty((0,), dtype=dtype, device=storage.device)
    out.set_(storage, ref.offset, ref.shape, ref.stride)  # type: ignore[call-overload]
    out = apply_lazy_bits(out, conj=ref.conj, neg=ref.neg)
    if ref.parameter:
        return torch.nn.Parameter(out, requires_grad=ref.requires_grad)
    if ref.requires_grad:
        out.requires_grad_(True)
    return out


def skeleton_digests(obj: Any) -> dict[str, int] | None:
    """The blobs ``obj`` needs when it is a skeleton (digest -> bytes), else None."""
    return obj.digests() if isinstance(obj, Skeleton) else None


# -- writing (the commit) --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Unchanged:
    """A leaf of a staged tree: a tensor whose storage was not copied because its bytes are a
    blob already (see :class:`IncrementalTracker`). Tensors sharing one storage share
    ``index``."""

    index: int
    digest: str
    nbytes: int
    ref: TensorRef  # its geometry (``ref.storage`` unused)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IncrementalJob:
    """What the commit of an incremental snapshot needs (travels in a
    :class:`~snapkeep._core.save.job.SaveJob`).

    Attributes:
        area: the template's blob area.
        area_name: the area relative to the snapshot's directory.
        min_blob_bytes: storages of at least this many bytes become blobs.
        changed: first tree paths of storages known to have changed since their last blob:
            written and hashed in one pass (others are hashed first and written only when
            their blob is missing).
    """

    area: BlobArea
    area_name: str
    min_blob_bytes: int = DEFAULT_MIN_BLOB_BYTES
    changed: frozenset[_Path] = frozenset()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Encoded:
    """What :func:`encode` made: the skeleton, every blob it needs (digest -> bytes), the bytes
    of blobs written now, and the digest of each storage written or found, by first tree
    path."""

    skeleton: Skeleton
    blobs: dict[str, int]
    written_bytes: int
    digests: tuple[tuple[_Path, str], ...]


def encode(tree: Any, job: IncrementalJob, *, tag: str) -> Encoded:
    """Write the blobs of ``tree`` (a staged tree, or the live one for a synchronous writer)
    that are not there yet, make them durable, and return the skeleton to publish.

    Blobs are published by up to :data:`PUBLISH_THREADS` threads at once (their ``fsync``
    calls overlap); the area's directory is then ``fsync``-ed once.

    Raises:
        SnapshotStorageError: a blob could not be written (nothing refers to it yet).
        SnapshotCorruptError: a blob's bytes changed while it was written.
    """
    slots: dict[Any, int] = {}
    storages: list[tuple[str, int]] = []
    pending: list[tuple[int, _Path, torch.UntypedStorage]] = []

    def walk(node: Any, path: _Path) -> Any:
        if atomic(node):
            return node
        if isinstance(node, Unchanged):
            key: Any = ("unchanged", node.index)
            index = slots.get(key)
            if index is None:
                index = slots[key] = len(storages)
                storages.append((node.digest, node.nbytes))
            return dataclasses.replace(node.ref, storage=index)
        if isinstance(node, torch.Tensor):
            if not _blob_candidate(node, job.min_blob_bytes):
                return node
            storage = node.untyped_storage()
            key = ("tensor", str(storage.device), storage.data_ptr(), storage.nbytes())
            index = slots.get(key)
            if index is None:
                index = slots[key] = len(storages)
                storages.append(("", storage.nbytes()))
                pending.append((index, path, storage))
            return _ref_of(node, index)
        if isinstance(node, dict):
            out = copy.copy(node)
            for key, value in node.items():
                out[key] = walk(value, (*path, key))
            return out
        if isinstance(node, list):
            return [walk(v, (*path, i)) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            items = [walk(v, (*path, i)) for i, v in enumerate(node)]
            if hasattr(node, "_fields"):
                return type(node)(*items)
            return tuple(items) if type(node) is tuple else type(node)(items)
        return node

    tree_out = walk(tree, ())

    # host bytes of each (an accelerator storage of an unstaged, synchronous save is copied;
    # the copies are kept alive while their views are used)
    sources = [storage if storage.device.type == "cpu" else storage.cpu()
               for _, _, storage in pending]
    views = [_host_view(source) for source in sources]

    def first(i: int) -> tuple[str, int]:
        """Changed bytes: written and hashed in one pass; others: hashed only."""
        if pending[i][1] in job.changed:
            return job.area.put_new(_writer_of(views[i]), tag=tag).checksum, len(views[i])
        return _digest(views[i]), 0

    results = _in_parallel(first, range(len(pending)))
    found: dict[str, int] = {}  # digest -> the pending item whose bytes it is (once)
    for i, (digest, nbytes) in enumerate(results):
        if not nbytes and digest not in found:
            found[digest] = i
    # a blob referred to without being written must hold the right bytes (proven or read,
    # see BlobArea.intact): a missing, damaged or replaced one is written again from these
    intact = _in_parallel(lambda d: job.area.intact(d, len(views[found[d]])), list(found))
    missing = {d: i for (d, i), ok in zip(found.items(), intact) if not ok}

    def put(digest: str) -> int:
        job.area.put(digest, _writer_of(views[missing[digest]]), tag=tag)
        return len(views[missing[digest]])

    written = sum(nbytes for _, nbytes in results) + sum(_in_parallel(put, list(missing)))
    digests = []
    for (index, path, storage), (digest, _) in zip(pending, results):
        storages[index] = (digest, storage.nbytes())
        digests.append((path, digest))
    if storages:
        job.area.sync()  # every blob durable before the skeleton that refers to them
    return Encoded(skeleton=Skeleton(area=job.area_name, storages=tuple(storages),
                                     tree=tree_out),
                   blobs=dict(storages), written_bytes=written, digests=tuple(digests))


def _in_parallel(fn: Callable[[Any], Any], items: Any) -> list[Any]:
    """``[fn(item) for item in items]``, by up to :data:`PUBLISH_THREADS` threads (the first
    error raised after all ended)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(PUBLISH_THREADS, len(items)),
                                               thread_name_prefix="snapkeep-blob") as pool:
        return list(pool.map(fn, items))


def _blob_candidate(t: torch.Tensor, min_blob_bytes: int) -> bool:
    """A dense strided tensor (plain or ``nn.Parameter``) of a real device whose storage holds
    at least ``min_blob_bytes``."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided \
            or t.is_quantized or t.is_nested or t.device.type == "meta":
        return False
    try:
        return t.untyped_storage().nbytes() >= min_blob_bytes
    except (RuntimeError, NotImplementedError):
        return False


def _ref_of(t: torch.Tensor, index: int) -> TensorRef:
    return TensorRef(storage=index, dtype=str(t.dtype).rpartition(".")[2],
                     shape=tuple(t.shape), stride=tuple(t.stride()),
                     offset=int(t.storage_offset()),
                     requires_grad=bool(t.requires_grad),
                     parameter=isinstance(t, torch.nn.Parameter), conj=bool(t.is_conj()),
                     neg=bool(t.is_neg()))


def _host_view(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage, in place."""
    nbytes = storage.nbytes()
    if not nbytes:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")


def _digest(view: memoryview) -> str:
    hasher = new_hasher()
    for start in range(0, len(view), _CHUNK_BYTES):
        hasher.update(view[start:start + _CHUNK_BYTES])
    return str(hasher.hexdigest())


def _digest_storage(storage: torch.UntypedStorage) -> str:
    """The digest of a storage's bytes, in place for CPU memory; from an accelerator through one
    reused host buffer of :data:`_CHUNK_BYTES` (never a host copy of the whole storage)."""
    if storage.device.type == "cpu":
        return _digest(_host_view(storage))
    flat = torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage)
    buffer = torch.empty(min(_CHUNK_BYTES, flat.numel()), dtype=torch.uint8)
    hasher = new_hasher()
    for start in range(0, flat.numel(), _CHUNK_BYTES):
        n = min(_CHUNK_BYTES, flat.numel() - start)
        buffer[:n].copy_(flat[start:start + n])
        hasher.update(_host_view(buffer.untyped_storage())[:n])
    return str(hasher.hexdigest())


def _writer_of(view: memoryview) -> Callable[[BinaryIO], None]:
    def write(f: BinaryIO) -> None:
        for start in range(0, len(view), _CHUNK_BYTES):
            f.write(view[start:start + _CHUNK_BYTES])
    return write


# -- the training thread ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Seen:
    """A blob storage as the call saw it: identity, its tensors' version counters, and (once
    committed) its digest."""

    ident: tuple[str, int, int]
    versions: tuple[int, ...]
    digest: str = ""
    nbytes: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Live:
    """An unchanged storage of a plan: what :meth:`IncrementalPlan.confirm` hashes."""

    path: _Path
    tensors: tuple[torch.Tensor, ...]  # detached: the call's storage, its version counters
    versions: tuple[int, ...]
    digest: str
    nbytes: int


class IncrementalTracker:
    """What one writer of one store knows about the storages of its last committed incremental
    snapshot (see the module docstring): one per door and store, used on the training thread
    (:meth:`plan`) and updated when a plan commits (any thread).

    Args:
        area: the store's blob area.
        area_name: the area relative to the snapshot directory.
        min_blob_bytes: storages of at least this many bytes become blobs (> 0).

    Raises:
        ValueError: ``min_blob_bytes`` is not a positive int.
    """

    def __init__(self, area: BlobArea, area_name: str, *,
                 min_blob_bytes: int = DEFAULT_MIN_BLOB_BYTES) -> None:
        if isinstance(min_blob_bytes, bool) or not isinstance(min_blob_bytes, int) \
                or min_blob_bytes <= 0:
            raise ValueError(f"min_blob_bytes must be an int > 0, got {min_blob_bytes!r}")
        self.area = area
        self.area_name = area_name
        self.min_blob_bytes = min_blob_bytes
        self.ledger: BlobLedger = ledger_for(area)
        self._lock = threading.Lock()
        self._known: dict[_Path, _Seen] = {}
        self._planned = 0
        self._applied = 0

    @classmethod
    def for_store(cls, store: Any, *, min_blob_bytes: int = DEFAULT_MIN_BLOB_BYTES
                  ) -> IncrementalTracker:
        """The tracker of a :class:`~snapkeep._core.store.files.SnapshotStore` (its blob area)."""
        return cls(store.blob_area(), store.blob_area_name(), min_blob_bytes=min_blob_bytes)

    def forget(self, path: _Path) -> None:
        """The next snapshot stages and writes the storage first seen at ``path`` in full."""
        with self._lock:
            self._known.pop(path, None)

    def plan(self, tree: Any) -> tuple[Any, IncrementalPlan]:
        """On the training thread, at the snapshot call: ``tree`` with the tensors of every
        unchanged storage replaced by :class:`Unchanged` leaves (``tree`` itself when none is),
        and the plan of the save. The plan is in flight (its blobs are pinned, see
        :class:`~snapkeep._core.tiers.blobs.BlobLedger`) until :meth:`IncrementalPlan.finish`.
        """
        seen: dict[tuple[str, int, int], tuple[_Path, list[torch.Tensor]]] = {}
        for path, t in _tensors(tree):
            if not _blob_candidate(t, self.min_blob_bytes):
                continue
            storage = t.untyped_storage()
            ident = (str(storage.device), storage.data_ptr(), storage.nbytes())
            seen.setdefault(ident, (path, []))[1].append(t)
        with self._lock:
            known = dict(self._known)
            self._planned += 1
            number = self._planned
        calls: dict[_Path, _Seen] = {}
        unchanged: dict[tuple[str, int, int], _Live] = {}
        changed = set()
        for ident, (path, tensors) in seen.items():
            versions = tuple(t._version for t in tensors)
            calls[path] = _Seen(ident=ident, versions=versions)
            before = known.get(path)
            if before is None:
                continue
            if before.ident == ident and before.versions == versions and before.digest:
                unchanged[ident] = _Live(path=path, tensors=tuple(t.detach() for t in tensors),
                                         versions=versions, digest=before.digest,
                                         nbytes=before.nbytes)
            else:
                changed.add(path)
        job = IncrementalJob(area=self.area, area_name=self.area_name,
                             min_blob_bytes=self.min_blob_bytes, changed=frozenset(changed))
        lives = list(unchanged.values())
        plan = IncrementalPlan(self, number, job, calls, lives)
        self.ledger.begin(plan.pins)
        if not unchanged:
            return tree, plan
        indexes = {ident: i for i, ident in enumerate(unchanged)}
        return _replace_unchanged(tree, unchanged, indexes), plan

    def _apply(self, number: int, known: dict[_Path, _Seen]) -> None:
        with self._lock:
            if number > self._applied:  # a later plan's commit is newer
                self._applied = number
                self._known = known


class IncrementalPlan:
    """One incremental save in flight (from :meth:`IncrementalTracker.plan`).

    Call order: the saver calls :meth:`confirm` in the trainer process right before the write
    (any thread), then :meth:`finish` once: with the commit record when committed (before
    retention runs), with None when the save failed, was dropped, skipped or replaced.
    """

    def __init__(self, tracker: IncrementalTracker, number: int, job: IncrementalJob,
                 calls: dict[_Path, _Seen], lives: list[_Live]) -> None:
        self.tracker = tracker
        self.number = number
        self.job = job
        self._calls = calls
        self._lives = lives
        self.pins = tuple(sorted({live.digest for live in lives}))
        self._finished = False
        self._guard = threading.Lock()

    @property
    def unchanged_bytes(self) -> int:
        """Bytes of storages neither staged nor written by this save."""
        return sum(live.nbytes for live in self._lives)

    def confirm(self) -> None:
        """Hash each unchanged storage's live bytes against its blob (see the module docstring);
        a missing blob is written again from bytes that hash right.

        Raises:
            StagingRaceError: a storage changed behind its version counter: the snapshot must
                be dropped (the tracker forgot the storage).
            SnapshotStorageError: a missing blob could not be written again.
        """
        for live in self._lives:
            storage = live.tensors[0].untyped_storage()
            digest = _digest_storage(storage)
            if digest != live.digest:
                now = tuple(t._version for t in live.tensors)
                if now != live.versions:
                    logger.debug("tensor at %s changed after the snapshot call (counter %s -> "
                                 "%s); the snapshot keeps its blob %s", _where(live.path),
                                 live.versions, now, live.digest)
                    continue
                self.tracker.forget(live.path)
                error = StagingRaceError(
                    f"incremental snapshot {self.job.area_name}: the tensor at "
                    f"{_where(live.path)} changed without its version counter moving (written "
                    "through .data, a raw pointer or another process?); this snapshot was "
                    "dropped, never written, and the next one copies that tensor in full")
                logger.warning("%s", error)
                raise error
            if not self.job.area.intact(live.digest, live.nbytes):
                logger.warning("blob %s of the tensor at %s was missing or damaged; writing it "
                               "again from the live bytes", live.digest, _where(live.path))
                host = storage if storage.device.type == "cpu" else storage.cpu()
                self.job.area.put(live.digest, _writer_of(_host_view(host)), tag="re")
                self.job.area.sync()

    def finish(self, record: Any) -> None:
        """The save ended: committed (``record``, a ``CommitRecord`` with ``blob_digests``:
        the tracker now knows this snapshot's storages) or not (None). Idempotent."""
        with self._guard:
            if self._finished:
                return
            self._finished = True
        try:
            if record is not None:
                written = dict(getattr(record, "blob_digests", ()) or ())
                by_path = {live.path: live for live in self._lives}
                known = {}
                for path, call in self._calls.items():
                    live = by_path.get(path)
                    digest = live.digest if live is not None else written.get(path, "")
                    nbytes = live.nbytes if live is not None else call.ident[2]
                    if digest:
                        known[path] = dataclasses.replace(call, digest=digest, nbytes=nbytes)
                self.tracker._apply(self.number, known)
        finally:
            self.tracker.ledger.end(self.pins)


def _where(path: _Path) -> str:
    return "/".join(map(str, path)) or "<root>"


def _tensors(node: Any, path: _Path = ()) -> Iterator[tuple[_Path, torch.Tensor]]:
    """Every tensor of a tree with its path, in the walk order of staging and :func:`encode`."""
    if atomic(node):
        return
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _tensors(value, (*path, key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _tensors(value, (*path, i))


def _replace_unchanged(node: Any, unchanged: dict[tuple[str, int, int], _Live],
                       indexes: dict[tuple[str, int, int], int]) -> Any:
    if atomic(node):
        return node
    if isinstance(node, torch.Tensor):
        try:
            storage = node.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return node
        ident = (str(storage.device), storage.data_ptr(), storage.nbytes())
        live = unchanged.get(ident)
        if live is None or type(node) not in (torch.Tensor, torch.nn.Parameter):
            return node
        return Unchanged(index=indexes[ident], digest=live.digest, nbytes=live.nbytes,
                         ref=_ref_of(node, 0))
    if isinstance(node, dict):
        out = copy.copy(node)
        for key, value in node.items():
            out[key] = _replace_unchanged(value, unchanged, indexes)
        return out
    if isinstance(node, list):
        return [_replace_unchanged(v, unchanged, indexes) for v in node]
    if isinstance(node, tuple):
        items = [_replace_unchanged(v, unchanged, indexes) for v in node]
        if hasattr(node, "_fields"):
            return type(node)(*items)
        return tuple(items) if type(node) is tuple else type(node)(items)
    return node


def blob_area_of(storage: Storage, listed: str, lock_key: str) -> BlobArea:
    """The blob area of a template (see :func:`snapkeep._core.tiers.blobs.area_directory`)."""
    return BlobArea(storage=storage, directory=area_directory(storage, listed, lock_key))


__all__ = [
    "BARE_LOAD_MESSAGE", "DEFAULT_MIN_BLOB_BYTES", "FORMAT", "PICKLE_MODULE", "SAFE_GLOBALS",
    "Encoded", "IncrementalJob", "IncrementalPlan", "IncrementalTracker", "Skeleton",
    "TensorRef", "Unchanged", "area_of", "blob_area_of", "encode", "is_skeleton", "materialise",
    "open_incremental_snapshot", "skeleton_digests", "tensor_ref",
]
