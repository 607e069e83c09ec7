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
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from snapkeep._core.errors import SnapshotCorruptError, SnapshotError, UnsafeSnapshotError
from snapkeep._core.storage import Storage

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


def metadata_of(storage: Storage, path: str, *, weights_only: bool = True) -> Metadata:
    """The DCP metadata of the snapshot directory ``path``, read through :func:`read_metadata`
    before DCP is called (DCP logs and falls back to per-rank metadata on a refused read).

    Raises:
        UnsafeSnapshotError, SnapshotCorruptError: as :func:`read_metadata`; corrupt also when
            the file is missing or unreadable.
    """
    where = storage.join(path, METADATA_NAME)
    try:
        data = storage.read_bytes(where)
    except FileNotFoundError as e:
        raise SnapshotCorruptError(f"{where}: missing (corrupt: not a DCP checkpoint)") from e
    return read_metadata(data, where=where, weights_only=weights_only)


class _SafeMetadataMixin:
    """``read_metadata`` through :func:`read_metadata` (see the module docstring)."""

    weights_only: bool
    fs: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        metadata = read_metadata(data, where=str(path), weights_only=self.weights_only)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id  # as DCP's FileSystemReader
        return metadata


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    """DCP's local reader whose ``.metadata`` is read through the allow-list."""

    def __init__(self, path: str, *, weights_only: bool = True) -> None:
        super().__init__(path)
        self.weights_only = weights_only


class SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    """DCP's fsspec reader (object stores) whose ``.metadata`` is read through the allow-list."""

    def __init__(self, url: str, *, weights_only: bool = True, **storage_options: Any) -> None:
        super().__init__(url, **storage_options)
        self.weights_only = weights_only


def reader_for(storage: Storage, path: str, storage_options: dict[str, Any] | None = None, *,
               weights_only: bool = True) -> FileSystemReader:
    """The safe DCP reader of the snapshot directory ``path`` on ``storage``."""
    if storage.is_local:
        return SafeFileSystemReader(path, weights_only=weights_only)
    return SafeFsspecReader(storage.url(path), weights_only=weights_only,
                            **(storage_options or {}))


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
           storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole state of the DCP directory ``path`` in one dict (what DCP's
    ``format_utils.dcp_to_torch_save`` writes, kept in memory), read safely; no process group.

    Raises:
        UnsafeSnapshotError: with ``weights_only``, something needs arbitrary unpickling.
        SnapshotCorruptError: DCP cannot read it (missing or damaged files, junk metadata).
    """
    metadata_of(storage, path, weights_only=weights_only)
    state: dict[str, Any] = {}
    with dcp_errors(path):
        try:
            _load_state_dict(state, storage_reader=reader_for(
                storage, path, storage_options, weights_only=weights_only),
                planner=SafeGatherPlanner(weights_only), no_dist=True)
        except SnapshotError:
            raise
        except (OSError, RuntimeError, ValueError, KeyError, EOFError) as e:
            raise SnapshotCorruptError(
                f"{path}: torch.distributed.checkpoint could not read it (corrupt: "
                f"{type(e).__name__}: {e})") from e
    return state


__all__ = ["METADATA_GLOBALS", "SafeFileSystemReader", "SafeFsspecReader", "SafeGatherPlanner",
           "SafeLoadPlanner", "dcp_errors", "gather_dcp", "metadata_of", "read_metadata",
           "reader_for"]
