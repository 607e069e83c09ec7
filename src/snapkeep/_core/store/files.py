"""The snapshot store: the files of one filename template in the directory its trainer owns.

``SnapshotStore(storage, directory, template)`` commits (data + manifest as one unit), lists by
step, verifies, loads the newest valid snapshot, deletes (file + manifest), applies retention,
sweeps stale temps and orphan manifests, and takes the directory lock (:mod:`.lock`: one
trainer per snapshot directory, whatever template names its files). The save
path is ``saver`` (stage, back-pressure) -> :func:`~snapkeep._core.save.commit.commit_job` (in
whichever thread or process runs the save) -> :meth:`SnapshotStore.retain` (in the trainer
process, through :class:`Retain`).

"Latest" is the highest key parsed from the filename template (iteration, then epoch) among
snapshots that verify -- never mtime. Verification checks the file against the checksum manifest
recorded at commit; a snapshot without a manifest (ppe-written, or a crash between the two
commits) is accepted only if it loads completely, with a warning. A manifest that is present but
invalid makes its snapshot "unverified" the same way, with a warning naming it.

On-error snapshots (``snapshot(snapshot_on_error=True)``) hold mid-iteration state. They are
committed under ``<name>`` + :data:`ON_ERROR_SUFFIX`, which no template entry ever has: they
never replace a clean snapshot, are never listed by :meth:`SnapshotStore.entries`, so autoload
and retention never use or delete them. They stay for inspection or manual recovery.

Removal: :meth:`SnapshotStore.delete` (a snapshot with its manifest), :meth:`SnapshotStore.retain`
(what a retention policy does not keep, the last stage of the save path) and
:meth:`SnapshotStore.sweep` (stale temps and manifests whose snapshot is gone). A failed delete
is logged, not raised (DESIGN 5); retention never deletes the newest snapshot, a protected one,
or one of another run.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import struct
import threading
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

from snapkeep._core.errors import (
    SnapshotCorruptError,
    SnapshotStorageError,
    UnsafeSnapshotError,
)
from snapkeep._core.format.checksum import digest_file, digest_stream, require_match
from snapkeep._core.format.manifest import (
    MANIFEST_DIR,
    Manifest,
    ManifestError,
    manifest_path,
    read_manifest,
)
from snapkeep._core.format.naming import FilenameTemplate
from snapkeep._core.save.commit import commit_job
from snapkeep._core.save.job import CommitRecord, SaveJob
from snapkeep._core.storage import Storage
from snapkeep._core.store.contract import newest_valid, require_one_kind
from snapkeep._core.store.lock import StoreLock
from snapkeep._core.store.name_check import misnamed_reason
from snapkeep._core.store.retention import RetentionPolicy, SnapshotInfo, plan_deletions
from snapkeep._core.tiers.blobs import BLOBS_DIR, BlobArea, area_directory, ledger_for
from snapkeep._core.user_warnings import warn_user

logger = logging.getLogger(__name__)

#: What a failed verification or decode of untrusted bytes can raise. A file raising one of these
#: is skipped (named in a warning); an :class:`UnsafeSnapshotError` is never swallowed.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    SnapshotCorruptError, RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError,
    KeyError, IndexError, TypeError, AttributeError, struct.error, zipfile.BadZipFile,
)


#: Appended to the name of a snapshot taken when the training loop raised (mid-iteration state).
ON_ERROR_SUFFIX = ".on-error"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One snapshot file of a store.

    Attributes:
        name: file name relative to the output directory (what the template produced).
        path: full path on the storage.
        key: sort key parsed from the name (iteration first).
        step: the first number of the key (the iteration when the template has one).
    """

    name: str
    path: str
    key: tuple[float, ...]
    step: int | None


class HeldListing:
    """What a store knows of one directory (either kind: files for single-file snapshots,
    directories for sharded ones). Not held (the default, a reader), every call lists afresh.
    Held (:meth:`hold`: the trainer's store on the rank that writes, the only writer of its
    template there -- the lock), the first listing is kept and updated by the store's own
    commits (:meth:`added`) and deletes (:meth:`removed`) instead of listed again (object
    stores bill and throttle LISTs; shared filesystems are slow to list); what anything else
    writes is seen after :meth:`release`. Thread-safe: a commit noted while the listing runs
    waits for it.

    Args:
        storage: where the directory is.
        directory: the directory listed.
    """

    def __init__(self, storage: Storage, directory: str) -> None:
        self.storage = storage
        self.directory = directory
        self._guard = threading.Lock()
        self._held = False
        self._known: tuple[set[str], set[str]] | None = None  # (files, directories)
        self._raw: list[dict[str, Any]] | None = None

    def hold(self) -> None:
        """Keep the next listing (see the class docstring) until :meth:`release`."""
        with self._guard:
            self._held = True

    def release(self) -> None:
        """Stop holding: forget the listing; every later call lists afresh."""
        with self._guard:
            self._held = False
            self._known, self._raw = None, None

    def _listed(self) -> tuple[set[str], set[str]]:
        if self._known is None or not self._held:  # under self._guard
            try:
                raw = self.storage.list_entries(self.directory)
            except FileNotFoundError:
                raw = []
            files, dirs = self.storage.children_of(raw)
            self._known, self._raw = (set(files), set(dirs)), raw
        return self._known

    def children(self) -> tuple[list[str], list[str]]:
        """``(files, directories)`` directly in the directory (temp files excluded), each
        sorted, from one listing (as ``Storage.list_children``)."""
        with self._guard:
            files, dirs = self._listed()
            return sorted(files), sorted(dirs)

    def files(self) -> list[str]:
        """Names of the files directly in the directory (temp files excluded), sorted."""
        return self.children()[0]

    def dirs(self) -> list[str]:
        """Names of the sub-directories directly in the directory, sorted."""
        return self.children()[1]

    def take_entries(self) -> list[dict[str, Any]] | None:
        """The listing's detailed entries (temp files included), for the start-up sweep of temp
        files; held, None after the first call (a later sweep lists afresh)."""
        with self._guard:
            self._listed()
            raw, self._raw = self._raw, None
            return raw

    def added(self, path: str, *, directory: bool = False) -> None:
        """``path`` (a file, or a ``directory``, directly in the directory; other paths are
        ignored) was committed by the store."""
        if self.storage.dirname(path) != self.directory:
            return
        with self._guard:
            if self._known is not None:
                self._known[1 if directory else 0].add(self.storage.basename(path))

    def removed(self, path: str) -> None:
        """``path`` was deleted by the store (or found missing)."""
        if self.storage.dirname(path) != self.directory:
            return
        with self._guard:
            if self._known is not None:
                for names in self._known:
                    names.discard(self.storage.basename(path))


class SnapshotStore:
    """The snapshots of one template in one directory (see the module docstring).

    Args:
        storage: where they live.
        directory: the output directory on ``storage``.
        template: the filename template; a ``str`` template or :class:`FilenameTemplate`.

    Thread use: listing, verification and loading may run on any thread; :meth:`retain` runs on
    the thread that dispatches commits (the saver's). Every method is safe against a concurrent
    commit of the same template by this process (a commit publishes the data file before its
    manifest; retention never deletes the newest or the just-committed snapshot).
    """

    def __init__(self, storage: Storage, directory: str, template: FilenameTemplate | str) -> None:
        self.storage = storage
        self.directory = directory
        self.template = template if isinstance(template, FilenameTemplate) \
            else FilenameTemplate(template)
        # paths this process committed: retention treats them as this run's files even when
        # their manifest is missing (e.g. removed after a failed manifest write)
        self._committed: set[str] = set()
        self._warned: set[str] = set()  # invalid manifests already warned about
        # its directory and manifest directory: listed afresh by each call, or, once held
        # (hold_listing: the trainer's store), listed once and kept up to date
        template = str(self.template.template) if self.template.parsable else ""
        sub = template.rpartition("/")[0]
        listed = self._subdir(sub) if "{" not in sub else directory
        self._listing = HeldListing(storage, listed)
        self._manifests = HeldListing(storage, storage.join(listed, MANIFEST_DIR))

    def __repr__(self) -> str:
        return f"SnapshotStore({self.storage.url(self.directory)!r}, {self.template.text!r})"

    # -- listing ------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Committed snapshot files of this template, oldest (lowest key) first.

        Temporary files, manifests, on-error snapshots and files that do not match the template
        are never listed. Only templates whose directory part is literal
        (``'snap/iter_{step}'``) are listable; others yield [].

        Listed afresh, unless the store holds its listing (:meth:`hold_listing`).
        """
        split = self._split()
        if split is None:
            return []
        sub, base = split
        base_template = FilenameTemplate(base)
        directory = self._subdir(sub)
        found = []
        for name in self._listing.files():
            if name.endswith(ON_ERROR_SUFFIX):
                continue
            key = base_template.parse(name)
            if key is None:
                continue
            rel = f"{sub}/{name}" if sub else name
            found.append(Entry(name=rel, path=self.storage.join(directory, name), key=key,
                               step=int(key[0]) if key else None))
        found.sort(key=lambda e: (e.key, e.name))
        return found

    def hold_listing(self) -> None:
        """Keep what the store knows of its directory: the first listing of it and of its
        manifest directory (by :meth:`check_kind`, :meth:`sweep`, :meth:`entries` or
        :meth:`orphan_manifests`, whichever comes first) is kept and updated by this store's
        commits (:meth:`note_committed`) and deletes, never listed again; so a trainer's
        start-up lists out_dir once and its snapshots (with retention) none. Call it on the
        store that alone writes this template here (the trainer's, on the saver rank: the
        lock); what anything else writes is seen after :meth:`release_listing`. Thread-safe.
        """
        self._listing.hold()
        self._manifests.hold()

    def release_listing(self) -> None:
        """Forget the held listing; every later call lists afresh (as before
        :meth:`hold_listing`)."""
        self._listing.release()
        self._manifests.release()

    def _subdir(self, sub: str) -> str:
        return self.storage.join(self.directory, sub) if sub else self.directory

    def _split(self) -> tuple[str, str] | None:
        """``(sub-directory, base template)`` of a listable template, else None."""
        if not self.template.parsable:
            return None
        template = str(self.template.template)
        sub, _, base = template.rpartition("/")
        if "{" in sub:
            logger.warning("filename template %r has fields in its directory part; snapshots "
                           "cannot be listed for autoload or retention", self.template.text)
            return None
        return sub, base

    def entry_for(self, path: str) -> Entry | None:
        """The entry of a path of this store (None when it is not one of its snapshots)."""
        for entry in self.entries():
            if entry.path == path:
                return entry
        return None

    # -- manifests and verification ----------------------------------------------------------------
    def manifest(self, entry: Entry) -> Manifest | None:
        """The entry's manifest, or ``None`` when it has none or it is invalid (a warning names
        it: the snapshot is then treated as unverified)."""
        path = manifest_path(self.storage, entry.path)
        try:
            return read_manifest(self.storage, path)
        except ManifestError as e:
            message = f"{e}; treating snapshot {entry.path} as unverified"
            if message not in self._warned:  # once per store (retention reads it every save)
                self._warned.add(message)
                warn_user(message, RuntimeWarning)
            return None

    def expected(self, entry: Entry) -> Manifest | None:
        """The entry's manifest (None if it has none), checked to name this file; the file's
        bytes are not read.

        Raises:
            SnapshotCorruptError: the manifest records another file name (copied or renamed).
        """
        manifest = self.manifest(entry)
        if manifest is None:
            return None
        name = self.storage.basename(entry.path)
        if manifest.name != name:  # a file and its manifest copied or renamed by hand
            raise SnapshotCorruptError(
                f"{entry.path}: its manifest records the snapshot {manifest.name!r} (step "
                f"{manifest.step}), not {name!r}: copied or renamed by hand? Rename it back, or "
                "move both away")
        return manifest

    def verify(self, entry: Entry, data: bytes | None = None, *,
               references: bool = True) -> Manifest | None:
        """Check the entry against its manifest; return the manifest (None if it has none).

        Args:
            entry: the snapshot.
            data: its bytes when already fetched (remote stores), else the file is streamed.
            references: also check every blob an incremental snapshot's manifest lists (each
                read and hashed against its name and size). False when the caller loads the
                snapshot next: loading verifies every blob it reads.

        Raises:
            SnapshotCorruptError: size or checksum differs from the manifest, the file is
                unreadable, or a blob it refers to is missing or corrupt.
            SnapshotStorageError: the store could not be reached.
        """
        manifest = self.expected(entry)
        if manifest is None:
            return None
        try:
            if data is not None:
                digest, size = digest_stream(io.BytesIO(data))
            elif self.storage.is_local:  # hashed in place through a memory map (no copies)
                digest, size = digest_file(entry.path)
            else:
                with self.storage.open_read(entry.path) as f:
                    digest, size = digest_stream(f)
        except SnapshotStorageError:
            raise  # the store is unreachable: that says nothing about this snapshot
        except OSError as e:
            raise SnapshotCorruptError(f"{entry.path}: unreadable ({e})") from e
        require_match(entry.path, digest, size, recorded_checksum=manifest.checksum,
                      recorded_size=manifest.size_bytes, algorithm=manifest.algorithm)
        if references and manifest.blobs:
            area = self.blob_area_of(entry, manifest)
            for blob, nbytes in sorted(manifest.blobs.items()):
                try:
                    area.check(blob, nbytes)
                except SnapshotCorruptError as e:
                    raise SnapshotCorruptError(f"{entry.path}: {e}") from e
        return manifest

    def validate(
        self, entry: Entry, loader: Callable[[Entry, bytes | None], Any],
        data: bytes | None = None, *,
        one_pass: Callable[[Entry, Manifest | None], Any] | None = None,
    ) -> tuple[Manifest | None, Any]:
        """Everything that makes ``entry`` valid to resume from, in one place (every reader
        uses it through :meth:`load_newest`; the agreed autoload calls it on the saver rank):
        checksum and name against its manifest (:meth:`verify`), a complete decode by
        ``loader``, and the misnamed check (a manager state whose iteration is not the step in
        its name: ``cp snapshot_iter_2 snapshot_iter_9``; see :mod:`.name_check`).

        With ``one_pass`` (local files, see :meth:`load_newest`), the checksum is verified
        while the file is decoded, in one read, instead of :meth:`verify` then ``loader``.

        Returns:
            ``(manifest or None, state)``.

        Raises:
            SnapshotCorruptError: it fails any check, or does not decode (junk, truncated).
            UnsafeSnapshotError: a well-formed file needing objects outside the allow-list.
            SnapshotStorageError: the store could not be reached.
        """
        try:
            if data is None and one_pass is not None and self.storage.is_local:
                manifest = self.expected(entry)
                state = one_pass(entry, manifest)  # verified while it loads
            else:  # loading verifies every blob it reads
                manifest = self.verify(entry, data, references=False)
                state = loader(entry, data)
        except (UnsafeSnapshotError, SnapshotStorageError, SnapshotCorruptError):
            raise
        except DECODE_ERRORS as e:
            raise SnapshotCorruptError(
                f"{entry.path} is not a well-formed snapshot (corrupt: {type(e).__name__}: "
                f"{e})" if str(e) else f"{entry.path} is empty or truncated (corrupt: "
                f"{type(e).__name__})") from e
        reason = misnamed_reason(entry.name, entry.step, self.template.template, state)
        if reason is not None:
            raise SnapshotCorruptError(reason)
        return manifest, state

    def load_newest(
        self, loader: Callable[[Entry, bytes | None], Any], *,
        candidates: list[Entry] | None = None,
        on_skip: Callable[[Entry, str], None] | None = None,
        one_pass: Callable[[Entry, Manifest | None], Any] | None = None,
    ) -> tuple[Entry, Any] | None:
        """Load the newest snapshot that is valid (:meth:`validate`); warn about each one
        skipped. THE newest-valid-with-fallback of single-file snapshots: autoload,
        :func:`snapkeep.load_latest`, ``snapkeep verify``/``ls`` and the ppe file view use it.

        Args:
            loader: ``loader(entry, data) -> state``, where ``data`` is the file's bytes when the
                store is remote (fetched once, verified, then decoded from memory: one download)
                and ``None`` for local files.
            candidates: entries to consider (default: :meth:`entries`).
            on_skip: ``on_skip(entry, reason)`` for each entry skipped, instead of a
                ``RuntimeWarning`` (autoload prints them in its resume notice).
            one_pass: for local files, ``one_pass(entry, manifest) -> state`` replaces
                :meth:`verify` + ``loader``: it verifies against ``manifest`` (from
                :meth:`expected`; None when there is none) while it loads, and raises
                ``SnapshotCorruptError`` on a mismatch, returning nothing of the file
                (:mod:`snapkeep._core.load.one_pass`).

        Returns:
            ``(entry, state)``, or ``None`` when there are no snapshot files at all.

        Raises:
            NoValidSnapshotError: snapshot files exist but none is valid (each reason listed);
                nothing is deleted.
            UnsafeSnapshotError: the newest valid file needs arbitrary unpickling.
            SnapshotStorageError: the store could not be reached (not treated as corruption).
        """
        entries = self.entries() if candidates is None else candidates

        def check(entry: Entry) -> tuple[Manifest | None, Any]:
            data = None if self.storage.is_local else self.storage.read_bytes(entry.path)
            return self.validate(entry, loader, data, one_pass=one_pass)

        def skipped(entry: Entry, error: SnapshotCorruptError) -> None:
            if on_skip is not None:
                on_skip(entry, str(error))
                return
            warn_user(f"skipping snapshot {entry.name} (step {entry.step}): {error}",
                      RuntimeWarning)

        found = newest_valid(entries, check, skipped=skipped,
                             what=f"{self.template.text!r} in {self.directory!r}")
        if found is None:
            return None
        entry, (manifest, state) = found
        if manifest is None:
            warn_user(
                f"snapshot {entry.name} (step {entry.step}) has no checksum manifest (written "
                "by ppe or interrupted before its manifest was committed) or an invalid one; "
                "it loaded completely but is unverified", RuntimeWarning)
        return entry, state

    # -- commit ------------------------------------------------------------------------------
    def commit(self, job: SaveJob, obj: Any) -> CommitRecord:
        """Commit one snapshot of this store in the calling thread: :func:`commit_job` (data
        and manifest as one unit), then recorded as this process's (see :meth:`retain`).
        Writers run :func:`commit_job` wherever their runner puts it and the saver records it.

        Raises:
            ValueError: ``job.path`` is not in this store's directory, or its name cannot get a
                manifest (see ``commit.check_name_length``).
            SnapshotStorageError: as :func:`commit_job`.
        """
        split = self._split()
        if split is not None and self.storage.dirname(job.path) != self._subdir(split[0]):
            raise ValueError(f"job.path {job.path!r} is not a file of {self!r}")
        record = commit_job(job, obj)
        self.note_committed(record.path)
        return record

    def note_committed(self, path: str) -> None:
        """Record that this process committed ``path`` (called by the saver after each commit):
        retention treats it as this run's snapshot even if its manifest goes missing."""
        self._committed.add(path)
        self._listing.added(path)
        self._manifests.added(manifest_path(self.storage, path))

    # -- kind ------------------------------------------------------------------------------
    def check_kind(self) -> None:
        """Refuse a template that already names sharded snapshot directories here (see
        :func:`~snapkeep._core.store.contract.require_one_kind`); call at start.

        Raises:
            ValueError: both kinds under one template (both named).
        """
        split = self._split()
        if split is None:
            return
        require_one_kind(self.storage, self._subdir(split[0]), FilenameTemplate(split[1]),
                         expected="file", listed=self._listing.dirs())

    # -- lock ------------------------------------------------------------------------------
    @property
    def snapshot_directory(self) -> str:
        """The directory this store's snapshot files live in (``directory`` joined with the
        template's literal directory part: ``'snap'`` of ``'snap/iter_{step}'``): what
        one trainer owns (:meth:`lock`)."""
        return self._listing.directory

    def lock(self, *, existing_only: bool = False) -> StoreLock | None:
        """Take the exclusive lock of :attr:`snapshot_directory` (one trainer per directory,
        whatever template names the files; the stores of this process share it); see
        :class:`StoreLock`. Returns None on storages without a local filesystem (object
        stores, pfio-style objects): there nothing is locked; with ``existing_only`` (a tool
        beside trainers) also None when no trainer ever locked it.

        Raises:
            StoreLockedError: another live process holds it (the message names its pid, host and
                since when).
            SnapshotStorageError: the lock file cannot be created.
        """
        if not self.storage.is_local:
            logger.info("%r: no directory lock on this storage; two trainers writing "
                        "here would interfere", self)
            return None
        acquire = StoreLock.acquire_existing if existing_only else StoreLock.acquire
        return acquire(self.storage.join(self.snapshot_directory, MANIFEST_DIR),
                       self.storage.url(self.snapshot_directory),
                       what=self.template.text if self.template.parsable else "")

    # -- deletion and retention --------------------------------------------------------------------
    def delete(self, entry: Entry, *, by: str = "snapkeep", strict: bool = False) -> bool:
        """Delete a snapshot and then its manifest (a kill between the two leaves an orphan
        manifest, removed by :meth:`sweep`). The one delete of single-file snapshots: retention,
        ``snapkeep prune`` and the ppe file view use it. A file already gone is not an error.

        Args:
            entry: the snapshot.
            by: who deletes, for the log (``'retention'``).
            strict: raise a failed delete (``snapkeep prune`` reports it) instead of logging it
                (retention: DESIGN 5). The manifest is then kept.

        Returns:
            True when the snapshot file is gone.

        Raises:
            OSError: only with ``strict``, the snapshot could not be deleted.
        """
        gone = True
        for path in (entry.path, manifest_path(self.storage, entry.path)):
            if not gone:
                break  # the snapshot stays: so does its manifest
            try:
                self.storage.remove(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                if strict:
                    raise
                gone = gone and path != entry.path
                logger.warning("%s could not delete %s (step %s): %s", by, path, entry.step, e)
                continue
            else:
                logger.debug("deleted %s (step %s)", path, entry.step)
            self._listing.removed(path)
            self._manifests.removed(path)
        self._committed.discard(entry.path)
        return gone

    def retain(
        self, policy: RetentionPolicy, lineage: frozenset[str | None] | set[str | None], *,
        protect: Sequence[str] = (), door: str = "",
    ) -> list[Entry]:
        """Delete what ``policy`` does not keep among the snapshots of the run ``lineage``.

        The last stage of the save path (the saver calls it after each commit, on the saver rank,
        in the trainer process). A snapshot belongs to the lineage when its manifest's run id is
        in ``lineage`` (``None`` in it: manifest-less snapshots), or when this process committed
        it (even if its manifest is missing or invalid). Snapshots of other runs are never
        deleted; neither is the newest one, nor one whose path is in ``protect``.

        Args:
            policy: a pure policy from :mod:`snapkeep.retention`.
            lineage: run ids whose snapshots may be deleted.
            protect: paths never to delete (the snapshot just committed).
            door: the retaining door (``Manifest.door``): a snapshot recording another door is
                never counted or deleted, whatever its run id.

        Returns:
            The entries deleted.
        """
        entries: list[Entry] = []
        infos: list[SnapshotInfo] = []
        foreign = 0
        listed = self.entries()
        for entry in listed:
            manifest = self.manifest(entry)
            ours = entry.path in self._committed
            if not ours and ((manifest.run_id if manifest is not None else None) not in lineage
                             or (door and manifest is not None and manifest.door
                                 and manifest.door != door)):
                foreign += 1
                continue
            entries.append(entry)
            metrics = dict(manifest.metrics) if manifest is not None else {}
            infos.append(SnapshotInfo(name=entry.name, key=entry.key, step=entry.step,
                                      metrics=metrics))
        if foreign:
            logger.debug("retention in %s leaves %d snapshot(s) of other runs alone",
                         self.directory, foreign)
        by_name = {e.name: e for e in entries}
        keep = [e.name for e in entries if e.path in set(protect)]
        deleted = []
        freed: set[str] = set()  # blobs of deleted incremental snapshots, in this area
        own = self.blob_area_name()
        for name in plan_deletions(policy, infos, protect=keep):
            entry = by_name[name]
            manifest = self.manifest(entry)
            if self.delete(entry, by="retention"):
                deleted.append(entry)
                if manifest is not None and manifest.blob_area == own:
                    freed.update(manifest.blobs)
                logger.debug("retention deleted %s (step %s)", entry.path, entry.step)
        self._remove_orphan_manifests(listed, lineage)
        if freed:
            self.collect_blobs(freed)
        return deleted

    # -- blobs of incremental snapshots ------------------------------------------------------------
    def blob_area(self) -> BlobArea:
        """This template's blob area (:mod:`snapkeep._core.tiers.blobs`; incremental snapshots).

        Raises:
            TypeError: a callable template (it has no area).
        """
        return BlobArea(storage=self.storage, directory=area_directory(
            self.storage, self._listing.directory, self.template.lock_key))

    def blob_area_of(self, entry: Entry, manifest: Manifest) -> BlobArea:
        """The blob area ``manifest`` (of ``entry``) names."""
        return BlobArea(storage=self.storage, directory=self.storage.join(
            self.storage.dirname(entry.path), *manifest.blob_area.split("/")))

    def blob_area_name(self) -> str | None:
        """:meth:`blob_area` relative to the snapshots' directory (None: no area)."""
        if not self.template.parsable:
            return None
        return "/".join((MANIFEST_DIR, BLOBS_DIR,
                         self.storage.basename(self.blob_area().directory)))

    def referenced_blobs(self) -> set[str] | None:
        """Every blob a snapshot of this template refers to: those listed by each of its
        manifests (any run, on-error snapshots and manifests whose snapshot is gone included),
        and those of a snapshot without a manifest read from the file itself (a kill between
        publishing a snapshot and its manifest). None when a manifest cannot be read: then
        nobody may tell which blobs are unused."""
        split = self._split()
        if split is None:
            return None
        sub, base = split
        template = FilenameTemplate(base)
        manifest_dir = self.storage.join(self._subdir(sub), MANIFEST_DIR)
        referenced: set[str] = set()
        described = set()
        for name in self._manifests.files():
            snapshot, dot, ext = name.rpartition(".")
            if not dot or ext != "json":
                continue
            if template.parse(snapshot.removesuffix(ON_ERROR_SUFFIX)) is None:
                continue
            try:
                manifest = read_manifest(self.storage, self.storage.join(manifest_dir, name))
            except (ManifestError, OSError) as e:
                logger.warning("cannot tell which blobs are in use: %s", e)
                return None
            if manifest is not None:
                referenced.update(manifest.blobs)
                described.add(snapshot)
        from snapkeep._core.load.loading import skeleton_blobs

        for entry in self.entries():
            if self.storage.basename(entry.path) not in described:
                referenced.update(skeleton_blobs(self.storage, entry.path))
        return referenced

    def collect_blobs(self, candidates: set[str] | None = None, *,
                      area: BlobArea | None = None) -> list[str]:
        """Delete the blobs among ``candidates`` (None: every blob of the area, and its stale
        temporary files) that no snapshot refers to (:meth:`referenced_blobs`) and no save of
        this process in flight may use (see :class:`~snapkeep._core.tiers.blobs.BlobLedger`: with a
        save in flight the candidates wait for a later pass). A failed delete is logged.
        ``area``: the blob area (default :meth:`blob_area`; ``snapkeep prune`` passes the one
        its deleted snapshots' manifests name). Returns the digests deleted."""
        if not self.template.parsable or self._split() is None:
            return []
        area = self.blob_area() if area is None else area
        ledger = ledger_for(area)
        with ledger.quiet() as alone:
            if not alone:
                if candidates is not None:
                    ledger.deferred.update(candidates)
                return []
            raw: list[dict[str, Any]] = []
            if candidates is None:
                names, raw = area.listing()
                candidates = set(names)
            candidates = candidates | ledger.deferred
            referenced = self.referenced_blobs()
            if referenced is None:
                ledger.deferred = candidates
                return []
            ledger.deferred = set()
            removed = [d for d in sorted(candidates - referenced) if area.remove(d)]
            area.remove_stale_temps(raw)
        if removed:
            logger.info("removed %d blob(s) no snapshot of %r refers to", len(removed),
                        self.template.text)
        return removed

    # -- sweeping ------------------------------------------------------------------------------
    def sweep(self, lineage: frozenset[str | None] | None = None) -> list[str]:
        """Remove temporary files of crashed writers (see ``Storage.remove_stale_temps``) from
        this template's directory and its manifest directory, and manifests whose snapshot is
        gone (of run ``lineage`` only, or of any run when None); return the removed paths."""
        split = self._split()
        if split is None:
            return []
        directory = self._subdir(split[0])  # from the store's one listing of each (at start)
        removed = self.storage.remove_stale_temps(directory, self._listing.take_entries())
        removed += self.storage.remove_stale_temps(self.storage.join(directory, MANIFEST_DIR),
                                                   self._manifests.take_entries())
        removed += self._remove_orphan_manifests(None, lineage)
        if BLOBS_DIR in self._manifests.dirs():  # incremental snapshots were written here
            area = self.blob_area()
            removed += [area.path(d) for d in self.collect_blobs(None)]
        return removed

    def orphan_manifests(self, entries: list[Entry] | None = None) -> list[str]:
        """Paths of this template's manifests whose snapshot file is gone (a process killed
        between deleting a snapshot and deleting its manifest); ``entries`` is the current
        listing (default :meth:`entries`)."""
        split = self._split()
        if split is None:
            return []
        sub, base = split
        present = {e.name for e in (self.entries() if entries is None else entries)}
        base_template = FilenameTemplate(base)
        manifest_dir = self.storage.join(self._subdir(sub), MANIFEST_DIR)
        orphans = []
        for name in self._manifests.files():
            snapshot, dot, ext = name.rpartition(".")
            if not dot or ext != "json" or base_template.parse(snapshot) is None:
                continue
            if (f"{sub}/{snapshot}" if sub else snapshot) not in present:
                orphans.append(self.storage.join(manifest_dir, name))
        return orphans

    def _remove_orphan_manifests(
        self, listed: list[Entry] | None, lineage: frozenset[str | None] | set[str | None] | None,
    ) -> list[str]:
        """Delete orphan manifests (of ``lineage`` when given). A snapshot committed after
        ``listed`` was taken (an async writer's next one) is found by the existence check: its
        file precedes its manifest."""
        storage = self.storage
        removed = []
        for path in self.orphan_manifests(listed):
            snapshot = storage.join(storage.dirname(storage.dirname(path)),
                                    storage.basename(path)[:-len(".json")])
            try:
                if storage.exists(snapshot):
                    continue
            except OSError as e:
                logger.debug("leaving manifest %s: cannot check its snapshot (%s)", path, e)
                continue
            if lineage is not None:
                try:
                    manifest = read_manifest(storage, path)
                except (OSError, ManifestError) as e:
                    logger.debug("leaving invalid orphan manifest %s: %s", path, e)
                    continue
                if manifest is None or manifest.run_id not in lineage:
                    continue
            try:
                storage.remove(path)
            except FileNotFoundError:
                self._manifests.removed(path)
                continue
            except OSError as e:
                logger.warning("could not delete the orphan manifest %s: %s", path, e)
                continue
            self._manifests.removed(path)
            removed.append(path)
            logger.info("removed manifest %s, whose snapshot was already deleted", path)
        return removed


@dataclasses.dataclass(frozen=True, kw_only=True)
class Retain:
    """The retention stage of one save: after the commit, the saver calls
    ``store.retain(policy, lineage, protect=[committed path])`` (policy None: only records the
    commit in the store).

    Attributes:
        store: the store of the snapshot's template.
        policy: what to keep (:mod:`snapkeep.retention`), or None to keep everything.
        lineage: run ids whose snapshots retention may delete.
        door: the door of the save (recorded in its manifest: ``Manifest.door``); empty: not
            recorded.
    """

    store: SnapshotStore
    policy: RetentionPolicy | None = None
    lineage: frozenset[str | None] = frozenset()
    door: str = ""

    def after_commit(self, record: CommitRecord) -> None:
        """Run on the saver rank in the trainer process; failures are logged, never raised."""
        self.store.note_committed(record.path)
        if self.policy is None:
            return
        try:
            self.store.retain(self.policy, self.lineage, protect=[record.path], door=self.door)
        except Exception:  # retention must never stop training (DESIGN invariant 5)
            logger.exception("retention after %s (step %s) failed", record.path, record.step)
