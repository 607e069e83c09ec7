"""fsspec-backed storage: one class for every backend, a commit strategy per backend.

Its parts: the path rules every write obeys (:mod:`._paths`), temporary names and the clean-up of
abandoned ones (:mod:`._temps`), safe local-file primitives (:mod:`._local`), and turning
``out_dir`` into a :class:`Storage` with its commit strategy (:mod:`._resolve`); the strategies
are :mod:`._commit`.
"""

from __future__ import annotations

import collections
import contextlib
import errno as errno_mod
import io
import logging
import os
import posixpath
import stat
from collections.abc import Callable, Iterator
from typing import IO, Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.storage._commit import (
    CommitStrategy,
    Target,
    WriteResult,
    fsync_directory,
    storage_error,
)
from snapkeep._core.storage._local import makedirs_durably, open_regular
from snapkeep._core.storage._paths import (
    DEFAULT_NAME_MAX,
    check_basename_bytes,
    check_name,
    check_path,
    local_name_max,
    truncate_utf8,
)
from snapkeep._core.storage._publish import publish_by_content, publish_pair
from snapkeep._core.storage._resolve import commit_strategy_for
from snapkeep._core.storage._temps import (
    is_temp_name,
    temp_basename,
    temp_is_abandoned,
)

logger = logging.getLogger(__name__)

#: directories remembered as made on a store without real directories (see ``makedirs``)
_KNOWN_DIRS = 64


class Storage:
    """One filesystem (local, memory, an object store, a pfio-style object) and how to commit a
    file on it atomically; the only place in snapkeep that talks to fsspec.

    Every operation is the same on every backend; the commit differs per backend through a
    :class:`~._commit.CommitStrategy`: replace+fsync on the local filesystem, temp+rename on
    pfio-style objects, one complete PUT on object stores and ``memory://``. Listings and reads
    always go to the backend (fsspec's listing cache is bypassed), so a snapshot committed by
    another process or the worker process is seen at once.

    Backend errors that are not ``OSError`` (botocore's ``EndpointConnectionError``, ...) are
    raised as :class:`SnapshotStorageError` naming the URL and endpoint, never credentials.

    Instances are picklable when the filesystem is (they travel to the process writer's worker);
    see :meth:`require_process_shareable`.

    Args:
        fs: an fsspec filesystem.
        strategy: the commit strategy; default :func:`commit_strategy_for` ``(fs)``.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, strategy: CommitStrategy | None = None
                 ) -> None:
        self.fs = fs
        self.strategy = commit_strategy_for(fs) if strategy is None else strategy
        self.is_local = isinstance(fs, LocalFileSystem)
        # directories made on a store without real ones (the bucket checked once per path):
        # the latest few only, so that a run making one per snapshot never grows
        self._known_dirs: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __repr__(self) -> str:
        return f"Storage({self.protocol}, {type(self.strategy).__name__})"

    @property
    def protocol(self) -> str:
        return self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    # -- paths ---------------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        parts = tuple(p for p in parts if p)
        if not parts:
            return ""
        return os.path.join(*parts) if self.is_local else posixpath.join(*parts)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path) if self.is_local else posixpath.dirname(path)

    def basename(self, path: str) -> str:
        return os.path.basename(path) if self.is_local else posixpath.basename(path)

    def child(self, directory: str, name: str, *, reserve_bytes: int = 0) -> str:
        """``directory/name`` for a snapshot ``name`` that must stay inside ``directory``.

        Args:
            directory: the output directory.
            name: a relative name (see :func:`._paths.check_name`).
            reserve_bytes: bytes the caller appends to the last component of ``name`` for a
                companion file (the manifest's ``'.json'``), counted against NAME_MAX.

        Raises:
            ValueError: ``name`` escapes ``directory`` (absolute, ``..``, NUL, ...; the message
                says what is accepted), or one of its components is longer than the
                filesystem's NAME_MAX in bytes (the message names the limit).
        """
        check_name(name, "filename")
        parts = name.split("/")
        limit = self.name_max(directory)
        if limit is not None:
            for i, part in enumerate(parts):
                extra = reserve_bytes if i == len(parts) - 1 else 0
                size = len(part.encode("utf-8", "surrogateescape"))
                if size + extra > limit:
                    companion = (f" plus {extra} bytes for its manifest's name" if extra else "")
                    raise ValueError(
                        f"filename {name!r}: the component {truncate_utf8(part, 40)!r}... is "
                        f"{size} bytes{companion}, over the filesystem's NAME_MAX of {limit} "
                        f"bytes for {self.url(directory) or '.'!r}; use a name of at most "
                        f"{limit - extra} bytes per component")
        return self.join(directory, *parts)

    def name_max(self, directory: str) -> int | None:
        """The longest file name in bytes that ``directory``'s filesystem accepts (NAME_MAX),
        ``None`` where there is none to ask (object stores: keys, not names)."""
        if not self.strategy.real_directories:
            return None
        if not self.is_local:
            return DEFAULT_NAME_MAX
        return local_name_max(directory)

    def _check_write_path(self, path: str) -> None:
        check_path(path)
        check_basename_bytes(self.basename(path), self.name_max(self.dirname(path)))

    def url(self, path: str) -> str:
        """``path`` as a user would write it (``s3://bucket/key``; local paths unchanged)."""
        return path if self.is_local else str(self.fs.unstrip_protocol(path))

    @property
    def endpoint(self) -> str | None:
        """The configured service endpoint, if any (for messages; never credentials)."""
        for source in (self.fs.__dict__, getattr(self.fs, "storage_options", {}) or {}):
            for key in ("endpoint_url", "endpoint"):
                value = source.get(key)
                if isinstance(value, str) and value:
                    return value
        client_kwargs = (getattr(self.fs, "storage_options", {}) or {}).get("client_kwargs")
        if isinstance(client_kwargs, dict) and isinstance(client_kwargs.get("endpoint_url"), str):
            return str(client_kwargs["endpoint_url"])
        return None

    def require_process_shareable(self, path: str, who: str) -> None:
        """Check that a worker process can write here through a pickled copy of this storage.

        Raises:
            ValueError: the filesystem lives in this process's memory (``memory://``): a worker
                would write into its own copy, invisible here.
            TypeError: the filesystem cannot be pickled to a worker.
        """
        if isinstance(self.fs, MemoryFileSystem):
            raise ValueError(
                f"out_dir {self.url(path)!r} is a memory:// filesystem, which lives inside one "
                f"process and cannot be shared with {who}'s worker process (it would write into "
                "its own copy, invisible here); use ThreadWriter or ThreadQueueWriter with "
                "memory://, or a local or object-store out_dir")
        import pickle

        try:
            pickle.dumps(self)
        except Exception as e:
            raise TypeError(
                f"the filesystem of {self.url(path)!r} ({type(self.fs).__name__}) cannot be "
                f"pickled to {who}'s worker process ({type(e).__name__}: {e}); use a "
                "thread-based writer") from e

    @contextlib.contextmanager
    def _backend_errors(self, action: str, path: str) -> Iterator[None]:
        """Raise non-``OSError`` backend faults as :class:`SnapshotStorageError` naming the URL."""
        try:
            yield
        except OSError:
            raise
        except Exception as e:
            if type(e).__module__.split(".")[0] in ("builtins", "snapkeep"):
                raise
            raise storage_error(e, self.url(path), None, action, self.endpoint) from e

    # -- plain operations ------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents (object stores: checks the bucket once per path).

        Local directories are created one level at a time, each followed by an ``fsync`` of its
        parent, so a directory (and then the snapshot in it) survives a power loss.

        Raises:
            SnapshotStorageError: the directory cannot be created or the store is unreachable
                (errno, URL and endpoint named).
        """
        if not path:
            return
        if not self.strategy.real_directories and path in self._known_dirs:
            self._known_dirs.move_to_end(path)
            return
        try:
            with self._backend_errors("creating directory", path):
                if self.is_local:
                    makedirs_durably(path)
                else:
                    self.fs.makedirs(path, exist_ok=True)
        except SnapshotStorageError:
            raise
        except OSError as e:
            raise storage_error(e, self.url(path), None, "creating directory",
                                self.endpoint) from e
        if not self.strategy.real_directories:
            self._known_dirs[path] = None
            while len(self._known_dirs) > _KNOWN_DIRS:
                self._known_dirs.popitem(last=False)

    def _fresh_ls(self, directory: str) -> list[dict[str, Any]]:
        self.fs.invalidate_cache(directory)
        with self._backend_errors("listing", directory):
            entries = self.fs.ls(directory or ".", detail=True, refresh=True)
        return list(entries)

    def list_names(self, directory: str) -> list[str]:
        """Basenames of the files directly in ``directory``, temp files excluded; [] if missing.

        The listing always comes from the backend, never from fsspec's listing cache; uploads
        in progress (uncompleted multipart uploads, temp files) are never listed.
        """
        return self.list_children(directory)[0]

    def list_children(self, directory: str) -> tuple[list[str], list[str]]:
        """``(files, directories)``: the basenames directly in ``directory`` from one fresh
        listing, each sorted, as :meth:`list_names` and :meth:`list_dirs` give them (temp files
        and special files excluded); ``([], [])`` if missing."""
        try:
            entries = self._fresh_ls(directory)
        except FileNotFoundError:
            return [], []
        return self.children_of(entries)

    @staticmethod
    def children_of(entries: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
        """``(files, directories)`` of a listing :meth:`list_entries` returned, as
        :meth:`list_children` gives them (for a caller that keeps one listing for several uses)."""
        names, dirs = [], []
        for entry in entries:
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if entry.get("type") == "directory":
                dirs.append(name)
            elif entry.get("type") != "other" and not is_temp_name(name):  # FIFOs, sockets
                names.append(name)
        return sorted(names), sorted(dirs)

    def list_dirs(self, directory: str) -> list[str]:
        """Basenames of the sub-directories directly in ``directory``; [] if missing (a fresh
        listing, as :meth:`list_names`)."""
        return self.list_children(directory)[1]

    def list_entries(self, directory: str) -> list[dict[str, Any]]:
        """fsspec's detailed entries (``name``, ``type``, ``size``, ``mtime``...) directly in
        ``directory``, temp files included, from a fresh listing.

        Raises:
            FileNotFoundError: ``directory`` does not exist.
            SnapshotStorageError: the store could not be reached.
        """
        return self._fresh_ls(directory)

    def info(self, path: str) -> dict[str, Any]:
        """fsspec's details of ``path`` (``type``: ``'file'`` or ``'directory'``, ``size`` in
        bytes, modification time where the backend has one), fresh from the backend.

        Raises:
            FileNotFoundError: nothing at ``path``.
            SnapshotStorageError: the store could not be reached.
        """
        self.fs.invalidate_cache(path)
        with self._backend_errors("checking", path):
            return dict(self.fs.info(path))

    #: fsspec info fields that change when an object is written again (object stores, memory).
    _IDENTITY_FIELDS = ("ETag", "etag", "generation", "md5Hash", "VersionId", "LastModified",
                        "last_modified", "mtime", "created")

    def fingerprint(self, path: str) -> tuple[Any, ...] | None:
        """What changes whenever the file at ``path`` is written or replaced, to prove it is the
        file seen before without reading it: on the local filesystem ``(device, inode, mode,
        size, mtime_ns, ctime_ns)`` of ``lstat`` (no write, rename or replacement keeps all of
        them); elsewhere the size and the ETag, generation or modification times the backend
        reports; None where it reports none (the caller must read the bytes).

        Raises:
            FileNotFoundError: nothing at ``path``.
            SnapshotStorageError: the store could not be reached.
        """
        if self.is_local:
            st = os.lstat(path)
            return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns,
                    st.st_ctime_ns)
        info = self.info(path)
        found = tuple((key, str(info[key])) for key in self._IDENTITY_FIELDS
                      if info.get(key) is not None)
        return (info.get("type"), info.get("size"), *found) if found else None

    def is_plain_file(self, path: str) -> bool:
        """Whether ``path`` is a regular file reached without a symbolic link (local: its own
        entry, ``lstat``; a link to a regular file is not one); elsewhere, a ``'file'``
        object. False when nothing is there. Never blocks (a FIFO is not opened).

        Raises:
            SnapshotStorageError: the store could not be reached.
        """
        if self.is_local:
            try:
                return stat.S_ISREG(os.lstat(path).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                return False
        try:
            return self.info(path).get("type") == "file"
        except FileNotFoundError:
            return False

    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (on object stores: a key prefix), fresh."""
        self.fs.invalidate_cache(path)
        with self._backend_errors("checking", path):
            return bool(self.fs.isdir(path))

    def sync_directory(self, path: str) -> None:
        """Make the entries of the directory ``path`` durable: ``fsync`` on the local
        filesystem (logged and skipped where refused); nothing elsewhere (object stores have no
        directories; each object is durable once its upload completed)."""
        if self.is_local:
            fsync_directory(path)

    def sync_file(self, path: str) -> None:
        """Make a file another writer wrote (a framework's own checkpoint file) durable before a
        commit marker names it: ``fsync`` on the local filesystem (regular files only, never
        blocking); nothing elsewhere (an object is durable once its upload completed).

        Raises:
            FileNotFoundError: no such file.
            OSError: not a regular file (``EINVAL``), or the ``fsync`` failed.
        """
        if not self.is_local:
            return
        fd = open_regular(path)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove_tree(self, path: str) -> None:
        """Delete the directory ``path`` and everything in it (one snapshot directory); a
        missing one is not an error.

        Raises:
            OSError: a delete failed.
        """
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    def open_read(self, path: str, *, whole: bool = False) -> IO[bytes]:
        """A readable, seekable binary file. Remote files are fetched whole (one GET), so a
        connection fault surfaces here as :class:`SnapshotStorageError`, not later mid-read.
        Local files must be regular files (see :func:`~._local.open_regular`): a FIFO never
        blocks. ``whole``: the caller reads the whole file front to back; a local file is then
        read ahead from disk at once (``posix_fadvise`` ``SEQUENTIAL`` and ``WILLNEED``)."""
        if self.is_local:
            fd = open_regular(path)
            if whole and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            return os.fdopen(fd, "rb")
        return io.BytesIO(self.read_bytes(path))

    def read_bytes(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The whole file at ``path``.

        Args:
            path: the file.
            max_bytes: refuse a file larger than this (read at most ``max_bytes + 1`` bytes); also
                refuses anything but a regular file (FIFO, device, directory) without blocking.

        Raises:
            FileNotFoundError: no such file.
            OSError: (with ``max_bytes``) not a regular file (``EINVAL``) or larger than
                ``max_bytes`` (``EFBIG``); the message names the path.
            SnapshotStorageError: the store could not be reached.
        """
        self.fs.invalidate_cache(path)
        if max_bytes is None:
            with self._backend_errors("reading", path):
                return bytes(self.fs.cat_file(path))
        if self.is_local:
            with os.fdopen(open_regular(path), "rb") as f:
                data = f.read(max_bytes + 1)
        else:
            with self._backend_errors("reading", path):
                info = self.fs.info(path)
                if info.get("type") not in ("file", None):
                    raise OSError(errno_mod.EINVAL,
                                  f"{self.url(path)} is a {info.get('type')}, not a file")
                data = bytes(self.fs.cat_file(path, start=0, end=max_bytes + 1))
        if len(data) > max_bytes:
            raise OSError(errno_mod.EFBIG,
                          f"{self.url(path)} is larger than the {max_bytes}-byte limit")
        return data

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        with self._backend_errors("checking", path):
            return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        with self._backend_errors("checking the size of", path):
            return int(self.fs.size(path))

    def remove(self, path: str) -> None:
        """Delete one file. Raises ``FileNotFoundError`` when it is already gone (where the
        backend can tell), ``ValueError`` for a path with a ``..`` component or NUL (see
        :func:`._paths.check_path`): no caller can make snapkeep delete outside out_dir that way."""
        check_path(path)
        with self._backend_errors("deleting", path):
            self.fs.rm_file(path)
        self.fs.invalidate_cache(path)

    # -- commit ----------------------------------------------------------------------------------
    def temp_name_for(self, path: str, tag: str = "") -> str:
        """A fresh temporary name next to ``path``, at most :data:`TEMP_NAME_MAX_BYTES` long
        whatever ``path``'s name (so any name the filesystem accepts can be written).

        It carries the first bytes of the final name, this host (hashed), this process's pid (base
        36) and per-process token, and 8 random hex digits; :meth:`remove_stale_temps` reads the
        host, pid and token back. ``tag`` is accepted for compatibility and not used.
        """
        return self.join(self.dirname(path), temp_basename(self.basename(path)))

    def write(
        self, path: str, write_fn: Callable[[BinaryIO], None], *, tag: str = "w",
    ) -> WriteResult:
        """Write a file through ``write_fn(file)`` and commit it atomically and durably.

        ``write_fn`` receives a write-only binary file object; it must not seek. A reader never
        sees a partial file under ``path``; a previous file under ``path`` stays intact until the
        new one replaces it in one step.

        Args:
            path: final path.
            write_fn: writes the content (e.g. ``lambda f: torch.save(obj, f)``).
            tag: short string unique to the writer, put in temporary names.

        Returns:
            The committed :class:`WriteResult`.

        Raises:
            SnapshotStorageError: a storage fault (names the URL, bytes written, errno or the
                backend's error); nothing is left under ``path`` or a temporary name, and the
                previous file under ``path`` is intact.
            ValueError: ``path`` has a ``..`` component or NUL, or its name is longer than the
                filesystem's NAME_MAX (checked before anything is written).
            Exception: whatever ``write_fn`` raised, after the same clean-up.
        """
        self._check_write_path(path)
        target = Target(path=path, temp_path=self.temp_name_for(path, tag), url=self.url(path),
                        endpoint=self.endpoint)
        try:
            return self.strategy.write(self.fs, target, write_fn)
        finally:
            self.fs.invalidate_cache(path)

    def publish_with_companion(
        self, path: str, companion: str, write_fn: Callable[[BinaryIO], None],
        companion_for: Callable[[WriteResult], bytes], *, tag: str = "w",
        companion_max_bytes: int,
    ) -> WriteResult:
        """Publish a file and its companion (a snapshot and its manifest) as one unit: see
        :func:`~._publish.publish_pair` for the order per storage, the arguments and errors."""
        return publish_pair(self, path, companion, write_fn, companion_for, tag=tag,
                            companion_max_bytes=companion_max_bytes)

    def publish_by_content(self, directory: str, write_fn: Callable[[BinaryIO], None], *,
                           tag: str = "w", expect: str | None = None) -> WriteResult:
        """Publish a file in ``directory`` named by the XXH3-128 digest of its bytes
        (``expect``: the digest they must have): see :func:`~._publish.publish_by_content`
        (one pass on local files; the directory is synced by the caller)."""
        self._check_write_path(self.join(directory, "0" * 32))
        return publish_by_content(self, directory, write_fn, tag=tag, expect=expect)

    def write_bytes(self, path: str, data: bytes, *, tag: str = "w") -> WriteResult:
        """:meth:`write` for a small in-memory payload (manifests)."""
        return self.write(path, lambda f: f.write(data), tag=tag)  # type: ignore[arg-type,return-value]

    def append(self, path: str, write_fn: Callable[[BinaryIO], None]) -> None:
        """Append through ``write_fn`` without atomicity (ppe's ``append=True``), then fsync."""
        with self._backend_errors("appending to", path), self.fs.open(path, "ab") as f:
            write_fn(f)
            f.flush()
            if self.is_local:
                os.fsync(f.fileno())

    def remove_stale_temps(self, directory: str,
                           entries: list[dict[str, Any]] | None = None) -> list[str]:
        """Remove temporary files left by crashed writers; return the removed paths.

        Only files that can no longer be in use are removed: those of a process on this host that
        is no longer alive (or of an earlier process that had this process's pid, as a restarted
        container's pid 1 does), and any older than :data:`STALE_TEMP_AGE_S`. ``entries``: what
        :meth:`list_entries` returned for ``directory`` just before (default: listed here).
        """
        removed: list[str] = []
        if entries is None:
            try:
                entries = self._fresh_ls(directory)
            except FileNotFoundError:
                return removed
        for entry in entries:
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if not is_temp_name(name) or entry.get("type") == "directory":
                continue
            if not temp_is_abandoned(name, entry):
                continue
            full = self.join(directory, name)
            try:
                self.remove(full)
                removed.append(full)
                logger.info("removed temporary file %s left by a crashed writer", full)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("could not remove stale temporary file %s: %s", full, e)
        return removed


__all__ = ["Storage"]
