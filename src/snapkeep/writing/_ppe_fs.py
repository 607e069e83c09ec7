"""``writer.fs`` as ppe's snapshot extension uses it, over snapkeep's storage.

ppe 0.9.0's ``training.extensions.snapshot`` talks to its writer's filesystem directly:

* ``autoload``: ``fs.list(writer.out_dir, recursive=True)`` (names relative to ``out_dir``),
  ``fs.stat(path).last_modified`` for each name matching the template's prefix and suffix (the
  newest mtime wins), then ``fs.open(path, 'rb')`` handed to ``torch.load``;
* ``n_retains``: the same listing after every save, then ``fs.remove(path)`` for each stale one.

:class:`PpeFileSystem` answers those calls from snapkeep's :class:`~snapkeep._core.storage.Storage`
(local paths, fsspec URLs, or the ``fs=`` object given to the writer) while keeping snapkeep's
guarantees where ppe's code path lets it:

* listings never show temp files of saves in flight nor the ``.snapkeep`` manifest directory;
* ``open(path, 'rb')`` verifies the file against its checksum manifest first and raises
  :class:`~snapkeep.SnapshotCorruptError` naming the file instead of handing ppe torn bytes (ppe
  picks one file, so there is no fallback to an older snapshot on this path: snapkeep's own
  snapshot extension falls back);
* the misnamed check of every other reader (a manager state whose iteration differs from the one
  its name gives: ``cp snapshot_iter_2 snapshot_iter_9``) is NOT made here, because this view
  cannot: ppe keeps the template in its extension and calls ``fs.open(path)`` with a bare path,
  so the view knows neither which field of the name is the iteration nor that the file is a
  manager state; and the copy has no manifest of its own (``cp`` copies the file only), so it
  is opened as a ppe-written file, unverified (logged). A copy made together with its manifest
  is refused, as the manifest records the name it was saved under. Resume through
  ``snapkeep.training.extensions.snapshot``, which knows its template and skips such a copy;
* ``remove(path)`` deletes the snapshot's manifest with it, and an already-deleted file is not an
  error (two cleanup passes may race), so ppe's cleanup hook never fails.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
import posixpath
from collections.abc import Iterator, Mapping
from typing import IO, Any

from snapkeep._core.errors import SnapshotCorruptError
from snapkeep._core.format.manifest import MANIFEST_DIR
from snapkeep._core.format.naming import FilenameTemplate
from snapkeep._core.storage import Storage, is_temp_name, resolve_storage
from snapkeep._core.store.files import Entry, SnapshotStore

logger = logging.getLogger(__name__)

_READ_MODES = ("r", "rb")


@dataclasses.dataclass(frozen=True)
class FileStat:
    """What ppe reads from ``fs.stat(path)`` (the fields of ppe's ``_PosixFileStat``).

    Attributes:
        filename: the path as given.
        last_modified: modification time in seconds since the epoch (what ppe orders by).
        size: size in bytes.
    """

    filename: str
    last_modified: float
    size: int


class PpeFileSystem:
    """The pfio-style filesystem object ppe expects as ``writer.fs`` (see the module docstring).

    Paths are those ppe builds: ``os.path.join(writer.out_dir, name)``, local paths or fsspec
    URLs; they are resolved like a writer's ``out_dir``.

    Args:
        fs: the ``fs=`` given to the writer (None: chosen from each path).
        storage_options: the writer's ``storage_options``.
    """

    def __init__(self, fs: Any = None, storage_options: Mapping[str, Any] | None = None) -> None:
        self._fs = fs
        self._options = dict(storage_options or {})

    def _resolve(self, path: str) -> tuple[Storage, str]:
        return resolve_storage(path or ".", self._fs, self._options or None)

    def resolve(self, path: str) -> tuple[Storage, str]:
        """``(Storage, path on it)`` for ``path``: what this view reads and deletes through (so
        snapkeep code handed a writer's ``fs`` uses the storage itself, not the view)."""
        return self._resolve(path)

    @staticmethod
    def unwrap(fs: Any, storage_options: Mapping[str, Any] | None = None
               ) -> tuple[Any, dict[str, Any]]:
        """``(fs, storage_options)`` underneath ``fs`` when it is a :class:`PpeFileSystem` (a
        writer's ``fs`` passed on as another writer's ``fs=``), else the arguments unchanged."""
        if isinstance(fs, PpeFileSystem):
            return fs._fs, {**fs._options, **(storage_options or {})}
        return fs, dict(storage_options or {})

    # -- what ppe's snapshot extension calls -------------------------------------------------------
    def list(self, path_or_prefix: str | None = None, recursive: bool = False) -> Iterator[str]:
        """Names under ``path_or_prefix`` relative to it (ppe's order: unspecified); with
        ``recursive``, files in sub-directories as ``'sub/name'``. Temp files and the manifest
        directory are never listed; a missing directory lists nothing.

        An empty path (ppe passes ``writer.out_dir``) lists the working directory, as ppe's
        writers do, with a warning: a snapkeep writer without ``out_dir`` saves into the
        manager's output directory, where ppe's autoload and ``n_retains`` would not look."""
        if not path_or_prefix:
            logger.warning(
                "listing the working directory for a writer without out_dir: ppe's snapshot "
                "extension looks there, but a snapkeep writer without out_dir saves into the "
                "manager's output directory; create the writer with out_dir=...")
        storage, directory = self._resolve(path_or_prefix or "")
        yield from _walk(storage, directory, "", recursive)

    def stat(self, path: str) -> FileStat:
        """Size and modification time of ``path``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        storage, p = self._resolve(path)
        info = storage.info(p)
        return FileStat(filename=path, last_modified=_mtime(info), size=int(info.get("size") or 0))

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> IO[Any]:
        """Open ``path`` for reading after checking it against its checksum manifest.

        A file without a manifest (written by ppe) is opened unverified.

        Raises:
            SnapshotCorruptError: size or checksum differ from the manifest.
            ValueError: ``mode`` is not ``'r'`` or ``'rb'`` (snapkeep writers commit files
                themselves; write through the writer).
        """
        if mode not in _READ_MODES:
            raise ValueError(
                f"mode must be one of {_READ_MODES} for a snapkeep writer's fs, got {mode!r}: "
                "snapkeep writers commit files atomically themselves; save through the writer")
        storage, p = self._resolve(path)
        data = None if storage.is_local else storage.read_bytes(p)
        _verify(storage, p, data)
        raw: IO[bytes] = io.BytesIO(data) if data is not None else storage.open_read(p)
        if mode == "r":
            return io.TextIOWrapper(raw, **kwargs)
        return raw

    def remove(self, path: str, recursive: bool = False) -> None:
        """Delete the snapshot ``path`` and its manifest; a file already gone is not an error
        (logged). ``recursive`` is accepted for ppe's signature; directories are not removed."""
        storage, p = self._resolve(path)
        store, entry = _store_entry(storage, p)
        store.delete(entry, by="ppe's n_retains", strict=True)  # the store's one delete

    def exists(self, path: str) -> bool:
        storage, p = self._resolve(path)
        return storage.exists(p)

    def isdir(self, path: str) -> bool:
        storage, p = self._resolve(path)
        return storage.isdir(p)

    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        """Create ``path`` and its parents (``mode`` is ignored; ``exist_ok`` as ``os``)."""
        storage, p = self._resolve(path)
        if not exist_ok and storage.exists(p):
            raise FileExistsError(path)
        storage.makedirs(p)

    def __enter__(self) -> PpeFileSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release (ppe's interface)."""


def _walk(storage: Storage, directory: str, prefix: str, recursive: bool) -> Iterator[str]:
    try:
        entries = storage.list_entries(directory)
    except FileNotFoundError:
        return
    for entry in sorted(entries, key=lambda e: str(e["name"])):
        name = posixpath.basename(str(entry["name"]).rstrip("/"))
        if is_temp_name(name) or name == MANIFEST_DIR:
            continue
        yield prefix + name
        if recursive and entry.get("type") == "directory":
            yield from _walk(storage, storage.join(directory, name), f"{prefix}{name}/", True)


def _mtime(info: Mapping[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def _store_entry(storage: Storage, path: str) -> tuple[SnapshotStore, Entry]:
    """The store holding the one file ``path`` (its name as a literal template), and its entry."""
    name = storage.basename(path)
    literal = FilenameTemplate(name.replace("{", "{{").replace("}", "}}"))
    return SnapshotStore(storage, storage.dirname(path), literal), \
        Entry(name=name, path=path, key=(), step=None)


def _verify(storage: Storage, path: str, data: bytes | None) -> None:
    """The store's own verification (checksum, size and the name its manifest records), so the
    ppe view accepts exactly what autoload accepts; a file without a manifest is opened
    unverified (ppe-written)."""
    store, entry = _store_entry(storage, path)
    try:
        manifest = store.verify(entry, data)
    except SnapshotCorruptError as e:
        raise SnapshotCorruptError(
            f"{e}. ppe's autoload loads only the newest file; move it away to resume from the "
            "previous one, or use snapkeep.training.extensions.snapshot, which falls back to the "
            "newest valid snapshot by itself") from e
    if manifest is None:
        logger.info("%s has no valid checksum manifest (written by ppe?); loading it unverified",
                    storage.url(path))
