"""The content-addressed blob area of incremental snapshots, and its in-process ledger.

An incremental snapshot (:mod:`snapkeep._core.tiers.incremental`) keeps its large tensor storages as
*blobs*: one file per distinct byte content, named by the XXH3-128 hex digest of those bytes,
in one flat directory per filename template::

    <dir>/.snapkeep/blobs/<template key>/<32 hex digits>

(``<template key>``: :func:`area_name`, so templates that list the same files share one area
and two templates never share one). Every blob is
published like any other snapkeep file: a temporary name in the same directory, written,
flushed, ``fsync``-ed, renamed into place (:meth:`BlobArea.put`), and the area's directory is
``fsync``-ed (:meth:`BlobArea.sync`) before the snapshot that refers to it is published. A blob
under its final name is therefore always complete when published; it can still be damaged or
replaced later (the disk, a copy, a hand), which every reader detects (the name is the
checksum: :meth:`BlobArea.read`).

A snapshot that refers to a blob without writing it (an unchanged storage, or bytes already
there) first makes sure the blob's bytes are right (:meth:`BlobArea.intact`): either this process
holds a *proof* -- it wrote the file or read and verified it, and the file's fingerprint (local:
device, inode, mode, size, mtime and ctime in ns; object stores: ETag or modification time, see
``Storage.fingerprint``) is unchanged since -- or the blob is read and hashed now. A damaged or
replaced blob is written again from the live bytes, so one bad blob never makes every later
snapshot unloadable (and the earlier ones that share it load again). The proof costs one
``stat`` per blob and save; what it cannot see is a change that keeps every field of the
fingerprint (bit rot under the file system, a write within the file system's timestamp
granularity of the proof): readers still verify every byte they load.

Who may delete a blob (:class:`BlobLedger`): a blob is deleted only when no snapshot of the
template refers to it (counted from the manifests, see ``SnapshotStore``) and no save of this
process that could refer to it is in flight. Saves register with the ledger of their area on the
training thread, before anything is staged (:meth:`BlobLedger.begin`), and the digests they will
refer to without writing are pinned until they end. A deletion pass runs only while no save is
in flight (one started meanwhile waits for the pass to finish, see :meth:`BlobLedger.quiet`).
Other processes are kept out by the store's directory lock (one trainer per directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import torch

from snapkeep._core.errors import SnapshotCorruptError
from snapkeep._core.format.manifest import MANIFEST_DIR
from snapkeep._core.storage import Storage, WriteResult, is_temp_name, new_hasher

logger = logging.getLogger(__name__)

#: The sub-directory of a manifest directory that holds the blob areas.
BLOBS_DIR = "blobs"
#: A blob's name: the XXH3-128 hex digest of its bytes.
BLOB_NAME = re.compile(r"[0-9a-f]{32}")
#: Bytes read and hashed per ``readinto`` when a blob is read back.
_READ_CHUNK_BYTES = 8 << 20


def area_directory(storage: Storage, listed: str, lock_key: str) -> str:
    """The blob area of the template whose lock key is ``lock_key``, whose snapshots are listed
    in the directory ``listed`` (see the module docstring)."""
    return storage.join(listed, MANIFEST_DIR, BLOBS_DIR, area_name(lock_key))


def area_name(lock_key: str) -> str:
    """``<readable part of lock_key>-<hash>``: the area of the templates whose lock key (see
    ``FilenameTemplate.lock_key``) is ``lock_key``; distinct keys get distinct areas (the name
    the template's lock file had before the lock became one per directory, kept so directories
    written by earlier versions resume)."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", lock_key)[:60]
    digest = hashlib.sha256(lock_key.encode()).hexdigest()[:12]
    return f"{readable}-{digest}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlobArea:
    """One template's blob area (picklable: it travels in a
    :class:`~snapkeep._core.save.job.SaveJob`
    to a writer process).

    Attributes:
        storage: where it is.
        directory: its directory (:func:`area_directory`).
    """

    storage: Storage
    directory: str

    def path(self, digest: str) -> str:
        """The blob of ``digest``.

        Raises:
            ValueError: ``digest`` is not 32 lowercase hex digits.
        """
        if not BLOB_NAME.fullmatch(digest):
            raise ValueError(f"not a blob digest: {digest!r}")
        return self.storage.join(self.directory, digest)

    def intact(self, digest: str, nbytes: int) -> bool:
        """Whether the blob of ``digest`` is there with the right bytes, so that a snapshot may
        refer to it without writing it (see the module docstring): proven without reading when
        it is the file this process wrote or verified, unchanged since; otherwise read and
        hashed (one pass, through a mapping locally, a reused buffer elsewhere) and proven from
        then on.

        Returns:
            False when it is missing, of another size, not a regular file or its bytes hash to
            another digest (a damaged one is logged as a warning): the caller writes it again.

        Raises:
            SnapshotStorageError: the store could not be reached.
        """
        path = self.path(digest)
        try:
            before = self.storage.fingerprint(path)
        except FileNotFoundError:
            return False
        if before is not None and _proof(self.storage.url(path)) == before:
            return True
        try:
            self._verify(path, digest, nbytes, keep=False)
        except SnapshotCorruptError as e:
            logger.warning("%s; it is written again from the live bytes", e)
            return False
        self._prove(path, before)
        return True

    def put(self, digest: str, write: Callable[[BinaryIO], None], *, tag: str) -> WriteResult:
        """Publish the blob of ``digest`` (temp, write, flush, ``fsync``, rename; see
        ``Storage.publish_by_content``), whose bytes ``write(file)`` writes; the directory
        itself is made durable by :meth:`sync`. What was written must hash to ``digest``.

        Raises:
            SnapshotCorruptError: the bytes written do not hash to ``digest`` (they changed
                while being written); the blob is removed again.
            SnapshotStorageError: a storage fault; nothing is left under the blob's name.
        """
        self.path(digest)  # a digest, not a path
        self.storage.makedirs(self.directory)
        try:
            result = self.storage.publish_by_content(self.directory, write, tag=tag,
                                                     expect=digest)
        except ValueError as e:
            raise SnapshotCorruptError(f"blob {e}") from e
        self._prove(result.path)
        return result

    def put_new(self, write: Callable[[BinaryIO], None], *, tag: str) -> WriteResult:
        """Publish a blob whose digest is not known yet: written and hashed in one pass under a
        temporary name, then renamed to its digest (see ``Storage.publish_by_content``)."""
        self.storage.makedirs(self.directory)
        result = self.storage.publish_by_content(self.directory, write, tag=tag)
        self._prove(result.path)
        return result

    def sync(self) -> None:
        """Make the blobs published so far durable (``fsync`` of the area's directory)."""
        self.storage.sync_directory(self.directory)

    def read(self, digest: str, nbytes: int) -> torch.UntypedStorage:
        """The blob of ``digest`` in a CPU storage, verified: exactly ``nbytes`` bytes that
        hash to ``digest`` (hashed as they are reached, in one pass). A blob read and verified
        is proven for :meth:`intact` (a resumed run's saves do not read it again).

        A local blob is mapped (a private, copy-on-write mapping of the file, as
        ``torch.load(mmap=True)`` maps a snapshot) and hashed in place: the pages the state
        will use are faulted in by the hash, nothing is copied, and the kernel reads the file
        ahead of it. A remote blob is read into a new storage while it is hashed.

        Raises:
            SnapshotCorruptError: missing, of another size, or its bytes do not hash to its name
                (the message names the blob and says what to do).
            SnapshotStorageError: the store could not be reached.
        """
        path = self.path(digest)
        before = self._fingerprint(path)
        target = self._verify(path, digest, nbytes, keep=True)
        self._prove(path, before)
        assert target is not None
        return target

    def check(self, digest: str, nbytes: int) -> None:
        """Verify the blob of ``digest`` (see :meth:`read`) without keeping its bytes; a blob
        this process proved unchanged since it wrote or verified it is not read again.

        Raises:
            SnapshotCorruptError: as :meth:`read`.
            SnapshotStorageError: the store could not be reached.
        """
        path = self.path(digest)
        before = self._fingerprint(path)
        if before is not None and _proof(self.storage.url(path)) == before:
            return
        self._verify(path, digest, nbytes, keep=False)
        self._prove(path, before)

    def _fingerprint(self, path: str) -> tuple[Any, ...] | None:
        try:
            return self.storage.fingerprint(path)
        except FileNotFoundError:
            return None

    def _prove(self, path: str, before: tuple[Any, ...] | None = None) -> None:
        """Record the proof of the file at ``path`` just written or verified: its fingerprint
        now, if ``before`` (taken before it was read) is None or still the same."""
        now = self._fingerprint(path)
        url = self.storage.url(path)
        with _PROOFS_LOCK:
            if now is not None and (before is None or before == now):
                _PROOFS[url] = now
            else:
                _PROOFS.pop(url, None)

    def _verify(self, path: str, digest: str, nbytes: int, *, keep: bool
                ) -> torch.UntypedStorage | None:
        """Check that the blob at ``path`` holds exactly ``nbytes`` bytes hashing to ``digest``,
        and return them as a storage when ``keep`` (local: a private mapping hashed in place;
        remote: read into a new storage, or through a reused buffer when not kept).

        Raises:
            SnapshotCorruptError: missing, unreadable, another size or another digest.
            SnapshotStorageError: the store could not be reached.
        """
        hasher = new_hasher()
        try:
            with self.storage.open_read(path, whole=True) as f:
                target: torch.UntypedStorage | None = None
                if self.storage.is_local and nbytes:
                    got = os.fstat(f.fileno()).st_size
                    extra = b""
                    if got == nbytes:  # checked before mapping: no page past the end is touched
                        mapped, view = _mapped(f.fileno(), nbytes)
                        for start in range(0, nbytes, _READ_CHUNK_BYTES):
                            hasher.update(view[start:start + _READ_CHUNK_BYTES])
                        view.release()
                        target = mapped if keep else None
                else:
                    if keep:
                        target = torch.UntypedStorage(nbytes)
                    into = (memoryview(_byte_view(target)) if nbytes else memoryview(b"")) \
                        if target is not None else None
                    buffer = memoryview(bytearray(min(_READ_CHUNK_BYTES, nbytes))) \
                        if into is None else None
                    got = 0
                    while got < nbytes:
                        want = min(_READ_CHUNK_BYTES, nbytes - got)
                        chunk = into[got:got + want] if into is not None \
                            else buffer[:want]  # type: ignore[index]
                        n = f.readinto(chunk)  # type: ignore[attr-defined]
                        if not n:
                            break
                        hasher.update(chunk[:n])
                        got += n
                    extra = f.read(1) if got == nbytes else b""
        except FileNotFoundError:
            raise SnapshotCorruptError(
                f"blob {path} is missing (deleted by hand, or an incomplete copy of the "
                "directory); the snapshots that refer to it cannot be loaded: use an older "
                "snapshot or restore .snapkeep/blobs") from None
        except OSError as e:
            if isinstance(e, SnapshotCorruptError) or type(e).__name__ == "SnapshotStorageError":
                raise
            raise SnapshotCorruptError(f"blob {path}: unreadable ({e})") from e
        if got != nbytes or extra:
            raise SnapshotCorruptError(
                f"blob {path}: {'more than ' if extra else ''}{got} bytes, the snapshot "
                f"records {nbytes} (truncated or overwritten; restore a good copy or use an "
                "older snapshot)")
        found = str(hasher.hexdigest())
        if found != digest:
            raise SnapshotCorruptError(
                f"blob {path}: its bytes hash to {found}, not to its name (corrupted; restore "
                "a good copy or use an older snapshot)")
        return target

    def listing(self) -> tuple[list[str], list[dict[str, Any]]]:
        """``(blob digests, raw entries)`` of the area (temporary files in the raw entries
        only); both empty when the area does not exist."""
        try:
            raw = self.storage.list_entries(self.directory)
        except FileNotFoundError:
            return [], []
        files, _ = self.storage.children_of(raw)
        return sorted(n for n in files if BLOB_NAME.fullmatch(n)), raw

    def remove(self, digest: str) -> bool:
        """Delete one blob; False (logged) when the delete failed; a blob already gone is
        not an error."""
        path = self.path(digest)
        with _PROOFS_LOCK:
            _PROOFS.pop(self.storage.url(path), None)
        try:
            self.storage.remove(path)
        except FileNotFoundError:
            return True
        except OSError as e:
            logger.warning("could not delete blob %s: %s", path, e)
            return False
        logger.debug("deleted blob %s", path)
        return True

    def remove_stale_temps(self, raw: list[dict[str, Any]]) -> list[str]:
        """Remove the temporary files of crashed blob writes (as ``Storage.remove_stale_temps``)."""
        if not any(is_temp_name(str(e.get("name", "")).rstrip("/").rpartition("/")[2])
                   for e in raw):
            return []
        return self.storage.remove_stale_temps(self.directory, raw)


#: This process's proofs (see :meth:`BlobArea.intact`): blob URL -> the fingerprint of the file
#: when this process wrote it or read and verified its bytes.
_PROOFS: dict[str, tuple[Any, ...]] = {}
_PROOFS_LOCK = threading.Lock()


def _reset_proofs_lock_in_child() -> None:
    """A fork while another thread held the lock must not leave the child's copy held."""
    global _PROOFS_LOCK
    _PROOFS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_proofs_lock_in_child)


def _proof(url: str) -> tuple[Any, ...] | None:
    with _PROOFS_LOCK:
        return _PROOFS.get(url)


def _mapped(fd: int, nbytes: int) -> tuple[torch.UntypedStorage, memoryview]:
    """A private (copy-on-write) mapping of the first ``nbytes`` of the file ``fd`` as a CPU
    storage (the storage keeps the mapping alive) and a byte view of it."""
    mapping = mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY)
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
        mapping.madvise(mmap.MADV_SEQUENTIAL)
    storage = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
    return storage, memoryview(mapping)


def _byte_view(storage: torch.UntypedStorage) -> Any:
    """A writable buffer over the bytes of a CPU ``storage`` (no copy)."""
    return torch.empty((0,), dtype=torch.uint8).set_(storage).numpy()


class BlobLedger:
    """What this process has in flight in one blob area (see the module docstring): saves
    begun and not ended, the digests they refer to without writing (pinned), and digests whose
    last referring snapshot was deleted while a save was in flight (collected later).

    Thread-safe. :meth:`begin` and :meth:`end` are called by the saves (training thread, writer
    thread); :meth:`quiet` by the deletion pass (the thread that runs retention).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._pins: dict[str, int] = {}
        self._collecting = False
        self.deferred: set[str] = set()

    def begin(self, pins: Iterable[str]) -> None:
        """A save starts; it refers to ``pins`` without writing them. Waits for a deletion pass
        that is running."""
        with self._cond:
            while self._collecting:
                self._cond.wait()
            self._in_flight += 1
            for digest in pins:
                self._pins[digest] = self._pins.get(digest, 0) + 1

    def end(self, pins: Iterable[str]) -> None:
        """The save that began with ``pins`` committed, failed or was dropped."""
        with self._cond:
            self._in_flight -= 1
            for digest in pins:
                left = self._pins.get(digest, 0) - 1
                if left > 0:
                    self._pins[digest] = left
                else:
                    self._pins.pop(digest, None)
            self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    @contextlib.contextmanager
    def quiet(self) -> Iterator[bool]:
        """Hold off new saves for a deletion pass; yields False (and holds nothing) when a save
        is in flight: the pass must not run then."""
        with self._cond:
            if self._in_flight or self._collecting:
                yield False
                return
            self._collecting = True
        try:
            yield True
        finally:
            with self._cond:
                self._collecting = False
                self._cond.notify_all()


_LEDGERS: dict[str, BlobLedger] = {}
_LEDGERS_LOCK = threading.Lock()


def ledger_for(area: BlobArea) -> BlobLedger:
    """This process's ledger of ``area`` (one per area URL)."""
    key = area.storage.url(area.directory)
    with _LEDGERS_LOCK:
        ledger = _LEDGERS.get(key)
        if ledger is None:
            ledger = _LEDGERS[key] = BlobLedger()
        return ledger


__all__ = ["BLOBS_DIR", "BLOB_NAME", "BlobArea", "BlobLedger", "area_directory", "ledger_for"]
