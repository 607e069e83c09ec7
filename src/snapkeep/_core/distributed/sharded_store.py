"""Sharded snapshots on storage: one directory per snapshot, committed by a marker.

A sharded snapshot is the directory named by the filename template (``snapshot_iter_100/``)
holding a ``torch.distributed.checkpoint`` (DCP) checkpoint as DCP writes it -- one or more
``__<rank>_<n>.distcp`` files per rank and ``.metadata`` -- so DCP's own tools
(``dcp.load``, ``format_utils.dcp_to_torch_save``) read it unchanged. snapkeep adds one file,
the marker :data:`MARKER_NAME`, written last by one rank after every rank's files are durable;
it is the manifest of the whole directory (each file's size, xxh3-128 checksum and writing rank).

- A directory without its marker is not a snapshot: never listed, never loaded.
- Deleting a snapshot removes the marker first, then the directory, so a crash in between leaves
  an uncommitted directory (swept later), never a listed snapshot missing files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from snapkeep._core.checksum import ALGORITHM, digest_stream, require_match
from snapkeep._core.errors import SnapshotCorruptError, SnapshotStorageError
from snapkeep._core.naming import FilenameTemplate
from snapkeep._core.storage import Storage
from snapkeep._core.store import Entry

logger = logging.getLogger(__name__)

MARKER_NAME = ".snapkeep-commit.json"
"""File name of the marker inside a sharded snapshot directory."""
FORMAT = "snapkeep.sharded/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileRecord:
    """One file of a sharded snapshot.

    Attributes:
        size_bytes: its size in bytes.
        checksum: xxh3-128 hex digest of its content.
        rank: the rank that wrote it.
    """

    size_bytes: int
    checksum: str
    rank: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedManifest:
    """The marker of a committed sharded snapshot.

    Attributes:
        name: directory name relative to the output directory.
        world_size: number of ranks that wrote it.
        files: ``{file name: FileRecord}`` of every file of the checkpoint.
        algorithm: checksum algorithm (``'xxh3_128'``).
        step: training iteration, when known.
        created_unix_s: commit time, informational only (never used to order snapshots).
        snapkeep_version: version that wrote it.
        run_id: run lineage (as the single-file manifests).
        metrics: observation values at save time (best-N retention).
    """

    name: str
    world_size: int
    files: dict[str, FileRecord]
    algorithm: str = ALGORITHM
    step: int | None = None
    created_unix_s: float = 0.0
    snapkeep_version: str = ""
    run_id: str | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {"format": FORMAT, **dataclasses.asdict(self)}
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ShardedManifest:
        """Parse a marker.

        Raises:
            ValueError: not a snapkeep sharded marker.
        """
        body = json.loads(data.decode())
        if not isinstance(body, dict) or body.pop("format", None) != FORMAT:
            raise ValueError("not a snapkeep sharded-snapshot marker")
        files = {str(k): FileRecord(**v) for k, v in body.pop("files").items()}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(files=files, **{k: v for k, v in body.items() if k in names})


def hash_file(storage: Storage, path: str) -> tuple[str, int]:
    """``(xxh3-128 hex digest, size in bytes)`` of a file on ``storage``."""
    with storage.open_read(path) as f:
        return digest_stream(f)


class ShardedStore:
    """The sharded snapshots of one template in one directory.

    Args:
        storage: where they live.
        directory: the output directory on ``storage``.
        template: the filename template (its directory part must be literal).
        storage_options: fsspec options of ``storage`` (endpoint, credentials) for DCP's own
            fsspec reader and writer on object stores; never logged.
    """

    def __init__(self, storage: Storage, directory: str, template: FilenameTemplate | str,
                 *, storage_options: dict[str, Any] | None = None) -> None:
        self.storage = storage
        self.storage_options = dict(storage_options or {})
        self.directory = directory
        self.template = template if isinstance(template, FilenameTemplate) \
            else FilenameTemplate(template)
        if not self.template.parsable:
            raise ValueError(
                "snapshot_mode=SHARDED needs a string filename template such as "
                f"'snapshot_iter_{{.iteration}}', got {template!r}")
        sub, _, base = str(self.template.template).rpartition("/")
        if "{" in sub:
            raise ValueError(
                f"filename template {self.template.template!r} has fields in its directory "
                "part; sharded snapshots must be listable (put the fields in the last part)")
        self._sub = sub
        self._base = FilenameTemplate(base)

    # -- names -----------------------------------------------------------------------------------
    def path_of(self, name: str) -> str:
        """Full path of the snapshot directory ``name`` (as the template formats it)."""
        return self.storage.join(self.directory, name)

    def marker_path(self, path: str) -> str:
        return self.storage.join(path, MARKER_NAME)

    def _candidates(self) -> list[Entry]:
        parent = self.storage.join(self.directory, self._sub) if self._sub else self.directory
        found = []
        for name in self._list_directories(parent):
            key = self._base.parse(name)
            if key is None:
                continue
            rel = f"{self._sub}/{name}" if self._sub else name
            found.append(Entry(name=rel, path=self.storage.join(parent, name), key=key,
                               step=int(key[0]) if key else None))
        found.sort(key=lambda e: (e.key, e.name))
        return found

    def _list_directories(self, parent: str) -> list[str]:
        """Names of the sub-directories of ``parent`` (fresh listing, never fsspec's cache)."""
        fs = self.storage.fs
        fs.invalidate_cache(parent)
        try:
            listed = fs.ls(parent or ".", detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in listed
                      if e.get("type") == "directory")

    def entries(self) -> list[Entry]:
        """Committed sharded snapshots (marker present), oldest (lowest key) first."""
        return [e for e in self._candidates() if self.storage.exists(self.marker_path(e.path))]

    def uncommitted(self) -> list[Entry]:
        """Snapshot directories without a marker (a save in progress, or one that crashed)."""
        return [e for e in self._candidates()
                if not self.storage.exists(self.marker_path(e.path))]

    def entry(self, name: str) -> Entry:
        key = self._base.parse(self.storage.basename(name))
        if key is None:
            raise ValueError(f"{name!r} does not match the template {self.template.template!r}")
        return Entry(name=name, path=self.path_of(name), key=key, step=int(key[0]))

    # -- markers ---------------------------------------------------------------------------------
    def manifest(self, entry: Entry) -> ShardedManifest | None:
        """The marker of ``entry``; None when it has none or it is unreadable (logged)."""
        path = self.marker_path(entry.path)
        try:
            return ShardedManifest.from_bytes(self.storage.read_bytes(path))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, TypeError, KeyError) as e:
            logger.warning("marker %s is unreadable (%s); %s is not a committed snapshot", path,
                           e, entry.path)
            return None

    def write_marker(self, path: str, manifest: ShardedManifest, *, tag: str) -> None:
        """Commit ``manifest`` as the marker of the directory ``path`` (atomic and durable:
        temp, fsync, replace, directory fsync; one PUT on object stores)."""
        self.storage.write_bytes(self.marker_path(path), manifest.to_bytes(), tag=tag)

    def remove_marker(self, path: str) -> None:
        """Uncommit the directory ``path`` (before it is written again or deleted)."""
        try:
            self.storage.remove(self.marker_path(path))
        except FileNotFoundError:
            return
        if self.storage.is_local:
            fsync_local_directory(path)

    # -- verification ----------------------------------------------------------------------------
    def verify_part(self, entry: Entry, rank: int, world_size: int) -> ShardedManifest:
        """Verify this rank's share of ``entry``'s files against the marker: every file is
        checked by exactly one rank (file ``i`` of the sorted list by rank ``i % world_size``),
        ``.metadata`` by every rank (each needs it to load).

        Raises:
            SnapshotCorruptError: no readable marker, or a file is missing, truncated or
                differs from its checksum.
            SnapshotStorageError: the store could not be reached.
        """
        manifest = self.manifest(entry)
        if manifest is None:
            raise SnapshotCorruptError(f"{entry.path}: no readable marker {MARKER_NAME}")
        names = sorted(manifest.files)
        mine = [n for i, n in enumerate(names) if i % world_size == rank or n == ".metadata"]
        for name in mine:
            record = manifest.files[name]
            path = self.storage.join(entry.path, name)
            try:
                digest, size = hash_file(self.storage, path)
            except SnapshotStorageError:
                raise
            except OSError as e:
                raise SnapshotCorruptError(f"{path}: unreadable ({e})") from e
            require_match(path, digest, size, recorded_checksum=record.checksum,
                          recorded_size=record.size_bytes, algorithm=manifest.algorithm,
                          record="marker")
        return manifest

    # -- deletion --------------------------------------------------------------------------------
    def delete(self, entry: Entry) -> None:
        """Delete a snapshot directory: marker first (it stops being a snapshot), then the rest.

        Raises:
            OSError: a delete failed (the caller logs it; retention is never fatal).
        """
        self.remove_marker(entry.path)
        try:
            self.storage.fs.rm(entry.path, recursive=True)
        except FileNotFoundError:
            pass
        self.storage.fs.invalidate_cache(entry.path)


def fsync_local_directory(path: str) -> None:
    """fsync a local directory (its entries become durable); where refused, logged and skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        logger.warning("cannot open directory %s to fsync it: %s", path, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        logger.debug("fsync of directory %s not supported: %s", path, e)
    finally:
        os.close(fd)
