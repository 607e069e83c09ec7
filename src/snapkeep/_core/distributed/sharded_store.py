"""Sharded snapshots on storage: one directory per snapshot, committed by a marker.

A sharded snapshot is the directory named by the filename template (``snapshot_iter_100/``)
holding a ``torch.distributed.checkpoint`` (DCP) checkpoint as DCP writes it -- one or more
``__<rank>_<n>.distcp`` files per rank and ``.metadata`` -- so DCP's own tools
(``dcp.load``, ``format_utils.dcp_to_torch_save``) read it unchanged. snapkeep adds one file,
the marker :data:`MARKER_NAME`, written last by one rank after every rank's files are durable;
it is the manifest of the whole directory (each file's size, xxh3-128 checksum and writing rank).

- Work in progress is marked first: rank 0 writes :data:`IN_PROGRESS_NAME` into the directory
  before any rank writes a shard. A directory without its marker is not a snapshot: never listed,
  never loaded.
- The start-up :meth:`ShardedStore.sweep` removes only directories snapkeep itself started (the
  in-progress mark present, the marker absent): a complete DCP checkpoint that snapkeep did not
  write, or any other foreign directory, is never deleted.
- Deleting a snapshot removes the marker first (the in-progress mark stays), then the directory,
  so a crash in between leaves work of snapkeep's own that the next sweep removes.
- On-error snapshots are committed under ``<name>`` + ``ON_ERROR_SUFFIX``: never listed, never
  resumed, never deleted by retention (as single files).
- One trainer per directory: :meth:`ShardedStore.lock` takes the same lock file as the
  single-file store (rank 0 only), so a single-file trainer and a sharded one collide too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from snapkeep._core.distributed.dcp_safe import METADATA_NAME, metadata_of
from snapkeep._core.errors import SnapshotCorruptError, SnapshotStorageError
from snapkeep._core.format.checksum import ALGORITHM, digest_stream, require_match
from snapkeep._core.format.json_records import INT64_LIMIT, parse_json
from snapkeep._core.format.manifest import MANIFEST_DIR
from snapkeep._core.format.naming import FilenameTemplate
from snapkeep._core.storage import TEMP_MARKER, Storage
from snapkeep._core.store.contract import IN_PROGRESS_NAME, MARKER_NAME, require_one_kind
from snapkeep._core.store.files import ON_ERROR_SUFFIX, Entry, HeldListing
from snapkeep._core.store.lock import StoreLock
from snapkeep._core.store.retention import RetentionPolicy, SnapshotInfo, plan_deletions

logger = logging.getLogger(__name__)


FORMAT = "snapkeep.sharded/1"

#: Largest marker read, in bytes (a real one takes ~120 bytes per file: 64 MiB is half a
#: million files).
MAX_MARKER_BYTES = 64 * 2**20


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
        """Parse a marker, checking every field's type (a marker is untrusted input: any
        shape of JSON is refused with ``ValueError``, never another exception).

        Raises:
            ValueError: not a snapkeep sharded marker, or a field of the wrong type or value
                (a file name that is not a plain name inside the directory included).
        """
        body = parse_json(data, max_bytes=MAX_MARKER_BYTES, allow_nan=True)  # RecordError
        if not isinstance(body, dict) or body.pop("format", None) != FORMAT:
            raise ValueError("not a snapkeep sharded-snapshot marker")
        files = body.pop("files", None)
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
        records = {_file_name(k): _file_record(k, v) for k, v in files.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in body.items() if k in known}
        for key, ok in _MARKER_FIELDS.items():
            if key in values and not ok(values[key]):
                raise ValueError(f"{key!r} has the wrong type: {values[key]!r:.80}")
        if "name" not in values or "world_size" not in values:
            raise ValueError("'name' or 'world_size' missing")
        return cls(files=records, **values)


def _is_int(value: Any, low: int = 0, high: int = INT64_LIMIT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


_MARKER_FIELDS: dict[str, Callable[[Any], bool]] = {
    "name": lambda v: isinstance(v, str) and 0 < len(v) <= 4096,
    "world_size": lambda v: _is_int(v, 1, 1 << 31),
    "algorithm": lambda v: v == ALGORITHM,
    "step": lambda v: v is None or _is_int(v),
    "created_unix_s": _is_number,
    "snapkeep_version": lambda v: isinstance(v, str) and len(v) <= 256,
    "run_id": lambda v: v is None or (isinstance(v, str) and len(v) <= 256),
    "metrics": lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and _is_number(x) for k, x in v.items()),
}


def _file_name(name: str) -> str:
    """``name`` when it is a plain file name inside the snapshot directory.

    Raises:
        ValueError: empty, ``.``/``..``, or holding a path separator or NUL.
    """
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or len(name) > 255:
        raise ValueError(f"file name {name!r:.80} is not a plain name inside the directory")
    return name


def _file_record(name: str, value: Any) -> FileRecord:
    if not isinstance(value, dict) or set(value) != {"size_bytes", "checksum", "rank"}:
        raise ValueError(f"the record of {name!r:.80} is not {{size_bytes, checksum, rank}}")
    size, checksum, rank = value["size_bytes"], value["checksum"], value["rank"]
    if not _is_int(size) or not _is_int(rank, 0, 1 << 31) or not isinstance(checksum, str) \
            or not 0 < len(checksum) <= 128:
        raise ValueError(f"the record of {name!r:.80} has a field of the wrong type")
    return FileRecord(size_bytes=size, checksum=checksum, rank=rank)


def hash_file(storage: Storage, path: str, *, max_bytes: int | None = None) -> tuple[str, int]:
    """``(xxh3-128 hex digest, size in bytes)`` of a file on ``storage``: a regular file only
    (a FIFO or device is refused at once, see :meth:`Storage.open_read`); with ``max_bytes``, at
    most ``max_bytes + 1`` bytes are read (a larger file returns a size above ``max_bytes``).

    Raises:
        OSError: no such file, or not a regular file (``EINVAL``).
    """
    with storage.open_read(path) as f:
        return digest_stream(f, max_bytes=max_bytes)


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
                f"'snapshot_iter_{{step}}', got {template!r}")
        sub, _, base = str(self.template.template).rpartition("/")
        if "{" in sub:
            raise ValueError(
                f"filename template {self.template.text!r} has fields in its directory "
                "part; sharded snapshots must be listable (put the fields in the last part)")
        self._sub = sub
        self._base = FilenameTemplate(base)
        self._listing = HeldListing(storage, self._parent())

    # -- names -----------------------------------------------------------------------------------
    def path_of(self, name: str) -> str:
        """Full path of the snapshot directory ``name`` (as the template formats it)."""
        return self.storage.join(self.directory, name)

    def marker_path(self, path: str) -> str:
        return self.storage.join(path, MARKER_NAME)

    def _parent(self) -> str:
        return self.storage.join(self.directory, self._sub) if self._sub else self.directory

    # -- the listing ------------------------------------------------------------------------------
    def hold_listing(self) -> None:
        """Keep the first listing of the snapshot directory and answer from it, updated by this
        store's own saves (:meth:`mark_in_progress`) and deletes (see
        :class:`~snapkeep._core.store.files.HeldListing`): the start-up (kind check, uncommitted,
        sweep, autoload) lists out_dir once and snapshots (with retention) never. Rank 0 only,
        whose store alone changes the directory there (the lock); other ranks list fresh."""
        self._listing.hold()

    def release_listing(self) -> None:
        """Forget the held listing; every later call lists afresh."""
        self._listing.release()

    def _candidates(self) -> list[Entry]:
        parent = self._parent()
        found = []
        for name in self._listing.dirs():
            if name.endswith(ON_ERROR_SUFFIX):
                continue
            key = self._base.parse(name)
            if key is None:
                continue
            rel = f"{self._sub}/{name}" if self._sub else name
            found.append(Entry(name=rel, path=self.storage.join(parent, name), key=key,
                               step=int(key[0]) if key else None))
        found.sort(key=lambda e: (e.key, e.name))
        return found

    def entries(self) -> list[Entry]:
        """Committed sharded snapshots (marker present), oldest (lowest key) first."""
        return [e for e in self._candidates() if self.storage.exists(self.marker_path(e.path))]

    def uncommitted(self) -> list[Entry]:
        """Snapshot directories snapkeep started (in-progress mark) without a marker: a save in
        progress, or one that crashed. Directories without the mark are never included."""
        return [e for e in self._candidates()
                if not self.storage.exists(self.marker_path(e.path))
                and self.storage.exists(self.storage.join(e.path, IN_PROGRESS_NAME))]

    def foreign(self) -> list[Entry]:
        """Directories named like this template's snapshots that snapkeep did not write: a
        ``torch.distributed.checkpoint`` checkpoint (its ``.metadata``) with neither snapkeep's
        marker nor its in-progress mark (a run checkpointed before snapkeep, or by another
        tool). Never swept, deleted, retained or resumed from (their files carry no checksums):
        a resume names them. Oldest first."""
        return [e for e in self._candidates()
                if not self.storage.exists(self.marker_path(e.path))
                and not self.storage.exists(self.storage.join(e.path, IN_PROGRESS_NAME))
                and self.storage.exists(self.storage.join(e.path, METADATA_NAME))]

    def entry(self, name: str) -> Entry:
        key = self._base.parse(self.storage.basename(name))
        if key is None:
            raise ValueError(f"{name!r} does not match the template {self.template.text!r}")
        return Entry(name=name, path=self.path_of(name), key=key, step=int(key[0]))

    # -- markers ---------------------------------------------------------------------------------
    def manifest(self, entry: Entry) -> ShardedManifest | None:
        """The marker of ``entry``; None when it has none or it is unreadable (logged)."""
        path = self.marker_path(entry.path)
        try:  # the storage's safe read: a regular file only, never blocking, bounded
            return ShardedManifest.from_bytes(
                self.storage.read_bytes(path, max_bytes=MAX_MARKER_BYTES))
        except FileNotFoundError:
            return None
        except SnapshotStorageError:  # the store could not be reached: not a verdict
            raise
        except (OSError, ValueError) as e:  # a FIFO, device, oversized or malformed marker
            logger.warning("marker %s is unreadable (%s); %s is not a committed snapshot", path,
                           e, entry.path)
            return None

    def write_marker(self, path: str, manifest: ShardedManifest, *, tag: str) -> None:
        """Commit ``manifest`` as the marker of the directory ``path`` (atomic and durable:
        temp, fsync, replace, directory fsync; one PUT on object stores)."""
        self.storage.write_bytes(self.marker_path(path), manifest.to_bytes(), tag=tag)

    def claim(self, path: str, step: int | None) -> None:
        """Rank 0, before a save writes the directory ``path`` (the snapshot of ``step``): refuse
        a name held by something that is not snapkeep's -- a file, or a directory with files
        but neither the marker nor the in-progress mark (a user's directory named like a
        snapshot) -- which the save would write into and retention later delete whole. A
        directory of snapkeep's own (committed, or a save that was interrupted, even before its
        in-progress mark: empty, or holding only temp files) is written again as before.

        Raises:
            SnapshotStorageError: ``path`` is held by something else (named); nothing written.
        """
        storage = self.storage
        if not storage.exists(path):
            return
        if storage.isdir(path) and (storage.exists(self.marker_path(path)) or storage.exists(
                storage.join(path, IN_PROGRESS_NAME)) or all(
                    TEMP_MARKER in name for name in storage.list_names(path))):
            return  # ours, or empty but for a dead save's temps (killed before its mark)
        raise SnapshotStorageError(
            f"{storage.url(path)} exists and is not a snapkeep snapshot directory (no "
            f"{MARKER_NAME}, no {IN_PROGRESS_NAME}): the sharded snapshot of step {step} would "
            "be written into it and retention would later delete it with its contents; nothing "
            "was written. Move it away, or use another filename template")

    def mark_in_progress(self, path: str, *, tag: str) -> None:
        """Rank 0, before any shard is written: create ``path`` and mark it as snapkeep's own
        work in progress (durable), so that only snapkeep's own crashed saves are swept."""
        self.storage.makedirs(path)
        self._listing.added(path, directory=True)  # a held listing knows its own saves
        self.storage.write_bytes(self.storage.join(path, IN_PROGRESS_NAME), b"", tag=tag)

    def remove_marker(self, path: str) -> None:
        """Uncommit the directory ``path`` (before it is written again or deleted)."""
        try:
            self.storage.remove(self.marker_path(path))
        except FileNotFoundError:
            return
        self.storage.sync_directory(path)

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
        recorded = manifest.name.rsplit("/", 1)[-1]
        if recorded != self.storage.basename(entry.path):  # copied or renamed by hand
            raise SnapshotCorruptError(
                f"{entry.path}: its marker records the snapshot {manifest.name!r} (step "
                f"{manifest.step}), not {self.storage.basename(entry.path)!r}: copied or renamed "
                "by hand? Rename it back, or move it away")
        names = sorted(manifest.files)
        mine = [n for i, n in enumerate(names) if i % world_size == rank or n == ".metadata"]
        for name in mine:
            record = manifest.files[name]
            path = self.storage.join(entry.path, name)
            try:
                digest, size = hash_file(self.storage, path, max_bytes=record.size_bytes)
            except SnapshotStorageError:
                raise
            except OSError as e:
                raise SnapshotCorruptError(f"{path}: unreadable ({e})") from e
            require_match(path, digest, size, recorded_checksum=record.checksum,
                          recorded_size=record.size_bytes, algorithm=manifest.algorithm,
                          record="marker")
        return manifest

    def validate_part(self, entry: Entry, rank: int, world_size: int, *,
                      weights_only: bool = True) -> ShardedManifest:
        """Everything that makes ``entry`` valid to resume from, on this rank (the sharded
        counterpart of ``SnapshotStore.validate``, run by every rank inside the agreed resume):
        :meth:`verify_part` (marker name and this rank's share of the checksums), then DCP's
        ``.metadata`` (the bytes the marker verified) decoded through the allow-list, every
        file it names being one the marker lists (see :func:`~.dcp_safe.metadata_of`).

        Raises:
            SnapshotCorruptError: a check fails or the metadata is not DCP metadata.
            UnsafeSnapshotError: the metadata needs objects outside the allow-list.
        """
        manifest = self.verify_part(entry, rank, world_size)
        metadata_of(self.storage, entry.path, weights_only=weights_only, listed=manifest.files)
        return manifest

    # -- deletion, retention, sweeping, lock -----------------------------------------------------
    def delete(self, entry: Entry, *, by: str = "snapkeep") -> bool:
        """Delete a snapshot directory: marker first (it stops being a snapshot), then the rest.
        A failed delete is logged, not raised (DESIGN 5).

        Returns:
            True when the directory is gone.
        """
        try:
            self.remove_marker(entry.path)
            self.storage.remove_tree(entry.path)
        except OSError as e:
            logger.warning("%s could not delete %s (step %s): %s", by, entry.path, entry.step, e)
            return False
        self._listing.removed(entry.path)
        logger.debug("%s deleted %s (step %s)", by, entry.path, entry.step)
        return True

    def retain(self, policy: RetentionPolicy, lineage: frozenset[str | None] | set[str | None],
               *, protect: Sequence[str] = ()) -> list[Entry]:
        """Delete what ``policy`` does not keep among this run's snapshots (marker's run id in
        ``lineage``); never the newest, a protected path, or another run's. Rank 0, after a
        commit.

        Returns:
            The entries deleted.
        """
        entries: list[Entry] = []
        infos: list[SnapshotInfo] = []
        for entry in self.entries():
            found = self.manifest(entry)
            if found is None or found.run_id not in lineage:
                continue
            entries.append(entry)
            infos.append(SnapshotInfo(name=entry.name, key=entry.key, step=entry.step,
                                      metrics=dict(found.metrics)))
        by_name = {e.name: e for e in entries}
        keep = [e.name for e in entries if e.path in set(protect)]
        return [by_name[name] for name in plan_deletions(policy, infos, protect=keep)
                if self.delete(by_name[name], by="retention")]

    def sweep(self, lineage: frozenset[str | None] | None = None) -> list[str]:
        """Remove the directories of snapkeep's own crashed saves (:meth:`uncommitted`); never a
        directory without the in-progress mark. Rank 0, at start, before the first save."""
        del lineage  # an in-progress directory has no run id yet: any crashed save of ours
        removed = []
        for entry in self._candidates():
            if self.storage.exists(self.marker_path(entry.path)):
                continue  # committed
            if self.storage.exists(self.storage.join(entry.path, IN_PROGRESS_NAME)):
                logger.info("removing uncommitted sharded snapshot directory %s (snapkeep's own "
                            "save, no marker: left by a crash)", entry.path)
                if self.delete(entry, by="sweep"):
                    removed.append(entry.path)
            else:  # a save killed while writing its in-progress mark leaves only the mark's
                # temp file (ours by its name): the directory is kept, the dead writer's temp
                # removed, so that a later save of that step commits no stray file
                removed += self.storage.remove_stale_temps(entry.path)
        return removed

    def lock(self) -> StoreLock | None:
        """The lock of the directory the snapshot directories live in (one trainer per
        directory, as the single-file store's: same file): rank 0 takes it. None on storages
        without a local filesystem.

        Raises:
            StoreLockedError: another live process holds it.
        """
        if not self.storage.is_local:
            logger.info("%s: no directory lock on this storage", self.directory)
            return None
        return StoreLock.acquire(self.storage.join(self._parent(), MANIFEST_DIR),
                                 self.storage.url(self._parent()),
                                 what=self.template.text)

    def check_kind(self) -> None:
        """Refuse a template that already names single-file snapshots here (see
        :func:`~snapkeep._core.store.contract.require_one_kind`)."""
        require_one_kind(self.storage, self._parent(), self._base, expected="directory",
                         listed=self._listing.files())

