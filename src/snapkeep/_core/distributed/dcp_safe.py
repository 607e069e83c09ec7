"""Safe reading of ``torch.distributed.checkpoint`` (DCP) directories.

DCP reads its ``.metadata`` file with ``pickle.load`` and unpickles every non-tensor value with
``torch.load(weights_only=False)``: a doctored directory runs code on whoever loads it. snapkeep
reads them differently, so that ``weights_only=True`` (the default) holds for sharded snapshots as
for single files (DESIGN 8):

- ``.metadata`` is read by :func:`read_metadata`: Python's own restricted-unpickler pattern
  (``pickle.Unpickler.find_class`` limited to an allow-list: DCP's metadata dataclasses, the
  torch value types they hold -- ``torch.Size``, dtypes, layouts -- and ``pathlib`` paths). Any
  other global is refused with :class:`~snapkeep.errors.UnsafeSnapshotError` naming it, before
  anything is called. torch's own weights-only unpickler cannot be used here: it reads pickle
  protocol 2 only, and DCP writes protocol 4/5 (``FRAME``, ``MEMOIZE``, ``STACK_GLOBAL``).
  ``weights_only=False`` falls back to DCP's plain ``pickle.load``.
- non-tensor values are loaded with ``torch.load(weights_only=...)`` (:class:`SafeLoadPlanner`,
  :class:`SafeGatherPlanner`).
- DCP's :class:`~torch.distributed.checkpoint.api.CheckpointException` (a ``BaseException``)
  never escapes: :func:`dcp_errors` turns it into a snapkeep error (unsafe when a rank refused an
  object, corrupt otherwise).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import struct
import sys
import zipfile
from collections.abc import Collection, Generator, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.futures import Future

from snapkeep._core.errors import SnapshotCorruptError, SnapshotError, UnsafeSnapshotError
from snapkeep._core.format.checksum import ALGORITHM, digest_stream, require_match
from snapkeep._core.storage import Storage, open_regular

_DCP = "torch.distributed.checkpoint"

#: ``(module, name)`` of every global a DCP ``.metadata`` file may reference (torch 2.4-2.13).
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *((f"{_DCP}.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath",
                               "Path")),
})

_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`METADATA_GLOBALS` and torch value types
    (``torch.float32``): the "restricting globals" pattern of Python's ``pickle`` docs."""

    def __init__(self, file: Any, *, where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise UnsafeSnapshotError(
            f"{self._where}: the DCP metadata calls {module}.{name}, which is not one of DCP's "
            "metadata types (unsafe: a well-formed pickle needing arbitrary code); loading "
            "refused and nothing in it was executed. If you trust this directory, pass "
            "weights_only=False.")


def read_metadata(data: bytes, *, where: str, weights_only: bool = True) -> Metadata:
    """Decode a DCP ``.metadata`` file.

    Args:
        data: its bytes.
        where: its path, for messages.
        weights_only: True (default) resolves only :data:`METADATA_GLOBALS`; False is DCP's
            own ``pickle.load`` (arbitrary code: trusted directories only).

    Raises:
        UnsafeSnapshotError: it references a global outside the allow-list (nothing called).
        SnapshotCorruptError: it is not a DCP metadata pickle (truncated, junk, another type).
    """
    try:
        if weights_only:
            metadata = _MetadataUnpickler(io.BytesIO(data), where=where).load()
        else:
            metadata = pickle.loads(data)  # noqa: S301 -- the caller opted in by name
    except UnsafeSnapshotError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError,
            IndexError, ImportError, OverflowError) as e:
        raise SnapshotCorruptError(
            f"{where}: not a readable DCP metadata file (corrupt: {type(e).__name__}: {e})"
        ) from e
    if not isinstance(metadata, Metadata):
        raise SnapshotCorruptError(
            f"{where}: holds a {type(metadata).__name__}, not DCP Metadata (corrupt)")
    return metadata


METADATA_NAME = ".metadata"

#: Largest ``.metadata`` read when no marker records its size, in bytes.
MAX_METADATA_BYTES = 2**30


class Recorded(Protocol):
    """What a sharded snapshot's marker records of one file
    (:class:`~.sharded_store.FileRecord`)."""

    @property
    def size_bytes(self) -> int: ...

    @property
    def checksum(self) -> str: ...


def metadata_of(storage: Storage, path: str, *, weights_only: bool = True,
                listed: Mapping[str, Recorded] | None = None) -> Metadata:
    """The DCP metadata of the snapshot directory ``path``, read through :func:`read_metadata`
    before DCP is called (DCP logs and falls back to per-rank metadata on a refused read).

    The file is read by the storage's safe reader: a regular file only (a FIFO or device is
    refused at once, never opened for a blocking read), at most its size recorded in ``listed``
    (else :data:`MAX_METADATA_BYTES`). With ``listed`` (the files of the snapshot's marker),
    the bytes decoded are those whose checksum the marker recorded, and every file the metadata
    names for DCP to read must be one of them (:func:`check_storage_paths`).

    Raises:
        UnsafeSnapshotError, SnapshotCorruptError: as :func:`read_metadata`; corrupt also when
            the file is missing, not a regular file, larger than recorded, differs from its
            checksum, or names a file outside the snapshot.
    """
    where = storage.join(path, METADATA_NAME)
    record = None if listed is None else listed.get(METADATA_NAME)
    if listed is not None and record is None:
        raise SnapshotCorruptError(f"{where}: not listed in the snapshot's marker (corrupt)")
    limit = MAX_METADATA_BYTES if record is None else record.size_bytes
    try:
        data = storage.read_bytes(where, max_bytes=limit)
    except FileNotFoundError as e:
        raise SnapshotCorruptError(f"{where}: missing (corrupt: not a DCP checkpoint)") from e
    except SnapshotError:
        raise
    except OSError as e:  # not a regular file, or larger than recorded
        raise SnapshotCorruptError(f"{where}: unreadable (corrupt: {e})") from e
    if record is not None:
        digest, size = digest_stream(io.BytesIO(data))
        require_match(where, digest, size, recorded_checksum=record.checksum,
                      recorded_size=record.size_bytes, algorithm=ALGORITHM, record="marker")
    metadata = read_metadata(data, where=where, weights_only=weights_only)
    check_storage_paths(metadata, None if listed is None else set(listed), where=where)
    return metadata


def check_storage_paths(metadata: Metadata, names: Collection[str] | None, *,
                        where: str) -> None:
    """Refuse DCP metadata that would make DCP read a file outside the snapshot directory:
    every storage item's ``relative_path`` must be a plain file name (no separator, ``..`` or
    NUL), other than ``.metadata``, and one of ``names`` (the files the marker lists and
    verified) when given.

    Raises:
        SnapshotCorruptError: naming the first offending path.
    """
    storage_data = getattr(metadata, "storage_data", None)
    if storage_data is None:
        return  # no storage items (DCP then reads nothing)
    if not isinstance(storage_data, dict):
        raise SnapshotCorruptError(f"{where}: its storage_data is a "
                                   f"{type(storage_data).__name__}, not a dict (corrupt)")
    for info in storage_data.values():
        relative = getattr(info, "relative_path", None)
        if not _inside(relative) or (names is not None and relative not in names):
            raise SnapshotCorruptError(
                f"{where}: names the file {relative!r:.200} for DCP to read, which is not "
                + ("a file the snapshot's marker lists and verified" if names is not None
                   else "a plain file name inside the directory")
                + " (corrupt: nothing outside a snapshot is ever read)")


def _inside(relative: Any) -> bool:
    return (isinstance(relative, str) and bool(relative) and relative not in (".", "..")
            and relative != METADATA_NAME and not any(c in relative for c in "/\\\0"))


class _RegularFiles(FileSystem):
    """DCP's local file system, opening for reading only regular files, without blocking
    (:func:`~snapkeep._core.storage.open_regular`): a shard swapped for a FIFO after it was
    verified is refused, never waited on."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str
                      ) -> Generator[io.IOBase, None, None]:
        if "r" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            f = os.fdopen(open_regular(os.fspath(path)), "rb")
        except FileNotFoundError:
            raise  # DCP's own error for a missing file
        except OSError as e:
            raise SnapshotCorruptError(f"{os.fspath(path)}: {e}") from e
        with f:
            yield f


class _SafeMetadataMixin:
    """``read_metadata`` through :func:`read_metadata` (see the module docstring), bounded,
    and its storage paths checked (:func:`check_storage_paths`); ``read_data`` reads only those
    files."""

    weights_only: bool
    listed: Mapping[str, Recorded] | None
    fs: Any
    load_id: Any
    #: the metadata :func:`metadata_of` already read and checked (None: read it here)
    verified: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.verified is not None and kwargs.get("rank") is None:
            metadata = self.verified  # read, verified and checked once, by metadata_of
            self.verified = None
        else:
            metadata = self._read_checked(kwargs.get("rank"))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id  # as DCP's FileSystemReader
        return metadata

    def _read_checked(self, rank: int | None) -> Metadata:
        path = self._get_metadata_path(rank)  # type: ignore[attr-defined]
        record = None if self.listed is None else self.listed.get(METADATA_NAME)
        limit = MAX_METADATA_BYTES if record is None else record.size_bytes
        with self.fs.create_stream(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise SnapshotCorruptError(f"{path}: larger than {limit} bytes (corrupt)")
        if record is not None:
            digest, size = digest_stream(io.BytesIO(data))
            require_match(str(path), digest, size, recorded_checksum=record.checksum,
                          recorded_size=record.size_bytes, algorithm=ALGORITHM,
                          record="marker")
        metadata = read_metadata(data, where=str(path), weights_only=self.weights_only)
        check_storage_paths(metadata, None if self.listed is None else set(self.listed),
                            where=str(path))
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, *args: Any, **kwargs: Any) -> None:
        # every rank checks the metadata it was given (rank 0 read it; others received it)
        check_storage_paths(metadata, None if self.listed is None else set(self.listed),
                            where=f"{self.load_id or 'the'} DCP metadata")
        super().set_up_storage_reader(metadata, *args, **kwargs)  # type: ignore[misc]


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    """DCP's local reader whose ``.metadata`` is read through the allow-list, naming only the
    files ``listed`` (the marker's; None: any plain name inside the directory), and whose files
    are opened only when regular, without blocking.

    ``read_data`` reads a saved tensor chunk straight into its target when the chunk is loaded
    whole into a whole contiguous CPU tensor of its dtype and shape (the common case: the same
    world size and placements as at the save), instead of DCP's ``torch.load`` into a new
    tensor and ``copy_`` (4-6x less time for those chunks, measured on 216 MiB); every other
    item (resharded slices, other devices or layouts, ``bytes`` values, transforms) goes
    through DCP's own ``read_data``. The chunk's layout comes from torch's weights-only
    ``torch.load(map_location="meta")`` of its pickle, which reads no data, and its storage
    record's place and size from the archive's own directory (``zipfile``): read only when
    stored uncompressed with exactly the target's bytes."""

    def __init__(self, path: str, *, weights_only: bool = True,
                 listed: Mapping[str, Recorded] | None = None) -> None:
        super().__init__(path)
        self.fs = _RegularFiles()
        self.weights_only = weights_only
        self.listed = listed

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[tuple[ReadItem, Any, torch.Tensor]]] = {}
        rest: list[ReadItem] = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            target = _whole_target(item, info, planner)
            if target is None:
                rest.append(item)
            else:
                by_file.setdefault(info.relative_path, []).append((item, info, target))
        for relative_path, items in by_file.items():
            path = os.path.join(self.path, relative_path)
            with self.fs.create_stream(path, "rb") as stream:
                for item, info, target in sorted(items, key=lambda x: x[1].offset):
                    if _read_into(stream, _Slice(stream, info.offset, info.length), info, target,
                                  path):
                        planner.commit_tensor(item, target)
                    else:
                        rest.append(item)
        if rest:
            return super().read_data(LoadPlan(rest, plan.storage_data, plan.planner_data),
                                     planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _whole_target(item: ReadItem, info: Any, planner: LoadPlanner) -> torch.Tensor | None:
    """The tensor ``item`` loads into when the saved chunk lands whole on it and it can take
    the bytes directly (CPU, dense, contiguous, no conjugate or negative view, not ``bool``:
    DCP's ``copy_`` normalizes a bool's byte; no transform); None otherwise."""
    if item.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None) \
            or any(item.storage_offsets) or any(item.dest_offsets):
        return None
    target = planner.resolve_tensor(item).detach()
    if target.device.type != "cpu" or target.layout != torch.strided \
            or not target.is_contiguous() or target.is_quantized or target.is_conj() \
            or target.is_neg() or target.dtype == torch.bool \
            or tuple(target.shape) != tuple(item.lengths):
        return None
    return target


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a seekable binary stream as a stream of their own
    (DCP's ``_ReaderView`` misplaces a seek from the end, which ``zipfile`` needs)."""

    def __init__(self, raw: Any, offset: int, length: int) -> None:
        super().__init__()
        self._raw, self._offset, self._length, self._pos = raw, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise ValueError(f"negative position {base + pos} in a {self._length}-byte slice")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if not n:
            return 0
        self._raw.seek(self._offset + self._pos)
        got = self._raw.readinto(memoryview(buffer).cast("B")[:n])
        self._pos += got or 0
        return got or 0


#: A ``torch.save`` archive's storage record (``archive/data/0``).
_DATA_RECORD = re.compile(r"(?:.*/)?data/[0-9]+\Z")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature .. file name length, extra field length


def _read_into(stream: Any, blob: Any, info: Any, target: torch.Tensor, path: Any) -> bool:
    """Read the tensor that DCP ``torch.save``d at ``info`` (``blob``: a view of it) straight
    into ``target`` when its saved layout is ``target``'s (dtype, shape, contiguous from its
    storage's start, native byte order) and its one storage record is stored uncompressed with
    exactly the target's bytes, inside the blob; False (nothing read) otherwise: DCP's own path
    then reads it (and names what is wrong with it).

    Raises:
        SnapshotCorruptError: the file ends before the tensor's bytes do."""
    nbytes = target.numel() * target.element_size()
    try:
        with zipfile.ZipFile(blob) as archive:
            records = archive.infolist()
            order = [r for r in records if r.filename.rsplit("/", 1)[-1] == "byteorder"]
            if len(order) > 1 or (order and archive.read(order[0]).decode() != sys.byteorder):
                return False  # DCP's path swaps the bytes
            data = [r for r in records if _DATA_RECORD.match(r.filename)]
        if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED \
                or data[0].file_size != nbytes or data[0].compress_size != nbytes:
            return False
        blob.seek(data[0].header_offset)
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(blob.read(_LOCAL_HEADER.size))
        if signature != b"PK\x03\x04":
            return False
        start = data[0].header_offset + _LOCAL_HEADER.size + name_len + extra_len
        blob.seek(0)
        saved = torch.load(blob, map_location="meta", weights_only=True)
    except Exception:  # noqa: BLE001 - DCP's own path reports it, with its error
        return False
    if not isinstance(saved, torch.Tensor) \
            or getattr(saved.untyped_storage(), "_checkpoint_offset", None) != start \
            or saved.dtype != target.dtype or saved.shape != target.shape \
            or saved.storage_offset() != 0 or not saved.is_contiguous() \
            or start + nbytes > info.length:
        return False
    if nbytes:
        view = target.reshape(-1).view(torch.uint8).numpy().data
        stream.seek(info.offset + start)
        got = 0
        while got < nbytes:
            n = stream.readinto(view[got:])
            if not n:
                raise SnapshotCorruptError(
                    f"{os.fspath(path)}: ends {nbytes - got} bytes before a tensor saved "
                    "in it (truncated: corrupt)")
            got += n
    return True


class SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    """DCP's fsspec reader (object stores) whose ``.metadata`` is read through the allow-list,
    naming only the files ``listed`` (None: any plain name inside the directory)."""

    def __init__(self, url: str, *, weights_only: bool = True,
                 listed: Mapping[str, Recorded] | None = None, **storage_options: Any) -> None:
        super().__init__(url, **storage_options)
        self.weights_only = weights_only
        self.listed = listed


def reader_for(storage: Storage, path: str, storage_options: dict[str, Any] | None = None, *,
               weights_only: bool = True, listed: Mapping[str, Recorded] | None = None,
               metadata: Metadata | None = None) -> FileSystemReader:
    """The safe DCP reader of the snapshot directory ``path`` on ``storage``, reading only the
    files ``listed`` (the marker's files; None: any plain name inside ``path``). ``metadata``:
    what :func:`metadata_of` returned for ``path`` with the same ``listed`` and
    ``weights_only`` (DCP's ``read_metadata`` then returns it instead of reading the file a
    second time)."""
    reader: SafeFileSystemReader | SafeFsspecReader
    if storage.is_local:
        reader = SafeFileSystemReader(path, weights_only=weights_only, listed=listed)
    else:
        reader = SafeFsspecReader(storage.url(path), weights_only=weights_only, listed=listed,
                                  **(storage_options or {}))
    reader.verified = metadata
    return reader


def _load_bytes(planner: Any, read_item: ReadItem, value: Any, weights_only: bool) -> None:
    loaded = torch.load(value, weights_only=weights_only)
    if planner.flatten_state_dict:
        from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own helper

        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn],
                    loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are unpickled with
    ``torch.load(weights_only=...)`` (DCP always passes ``weights_only=False``)."""

    def __init__(self, weights_only: bool) -> None:
        super().__init__()
        self._weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        _load_bytes(self, read_item, value, self._weights_only)


class SafeGatherPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner of ``dcp_to_torch_save`` (loads everything into an empty dict), with
    non-tensor values unpickled by ``torch.load(weights_only=...)``."""

    def __init__(self, weights_only: bool) -> None:
        super().__init__()
        self._weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        _load_bytes(self, read_item, value, self._weights_only)


@contextlib.contextmanager
def dcp_errors(where: str) -> Iterator[None]:
    """Turn DCP's :class:`CheckpointException` (a ``BaseException``: ``except Exception`` misses
    it) into :class:`UnsafeSnapshotError` when a rank refused an object, else
    :class:`SnapshotCorruptError`; snapkeep's own errors pass unchanged."""
    try:
        yield
    except CheckpointException as e:
        failures = {int(r): f[0] if isinstance(f, tuple) and f else f
                    for r, f in (getattr(e, "failures", {}) or {}).items()}
        for failure in failures.values():
            inner = failure if isinstance(failure, BaseException) else None
            if isinstance(inner, UnsafeSnapshotError):
                raise inner from e
            if isinstance(inner, pickle.UnpicklingError) and "weights only" in str(inner).lower():
                raise UnsafeSnapshotError(
                    f"{where}: a value needs objects outside the weights_only allow-list "
                    "(unsafe: well-formed, needing arbitrary unpickling); loading refused. If you "
                    "trust this directory, pass weights_only=False.") from e
        details = "; ".join(f"rank {r}: {type(x).__name__}: {(str(x).splitlines() or [''])[0]}"
                            for r, x in failures.items())
        raise SnapshotCorruptError(
            f"{where}: torch.distributed.checkpoint could not read it (corrupt: "
            f"{details or e})") from e


def gather_dcp(storage: Storage, path: str, *, weights_only: bool = True,
               storage_options: dict[str, Any] | None = None,
               listed: Mapping[str, Recorded] | None = None) -> dict[str, Any]:
    """The whole state of the DCP directory ``path`` in one dict (what DCP's
    ``format_utils.dcp_to_torch_save`` writes, kept in memory), read safely; no process group.
    With ``listed`` (a snapkeep snapshot's marker files), only those files are read.

    Raises:
        UnsafeSnapshotError: with ``weights_only``, something needs arbitrary unpickling.
        SnapshotCorruptError: DCP cannot read it (missing or damaged files, junk metadata).
    """
    metadata_of(storage, path, weights_only=weights_only, listed=listed)
    state: dict[str, Any] = {}
    with dcp_errors(path):
        try:
            _load_state_dict(state, storage_reader=reader_for(
                storage, path, storage_options, weights_only=weights_only, listed=listed),
                planner=SafeGatherPlanner(weights_only), no_dist=True)
        except SnapshotError:
            raise
        except (OSError, RuntimeError, ValueError, KeyError, EOFError) as e:
            raise SnapshotCorruptError(
                f"{path}: torch.distributed.checkpoint could not read it (corrupt: "
                f"{type(e).__name__}: {e})") from e
    return state


__all__ = ["MAX_METADATA_BYTES", "METADATA_GLOBALS", "Recorded", "SafeFileSystemReader",
           "SafeFsspecReader", "SafeGatherPlanner",
           "SafeLoadPlanner", "check_storage_paths", "dcp_errors", "gather_dcp", "metadata_of",
           "read_metadata", "reader_for"]
