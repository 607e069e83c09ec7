"""fsspec-backed storage: one class for every backend, a commit strategy per backend."""

from __future__ import annotations

import contextlib
import errno as errno_mod
import hashlib
import io
import logging
import os
import posixpath
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.storage._commit import (
    CommitStrategy,
    ObjectPutCommit,
    RenameCommit,
    ReplaceCommit,
    Target,
    WriteResult,
    storage_error,
)
from snapkeep._core.storage._pfio import PfioFileSystem

logger = logging.getLogger(__name__)

#: Every temporary name contains this marker; such names are never listed as snapshots.
TEMP_MARKER = ".snapkeep-tmp."
#: Temporary files whose owner cannot be checked are removed once older than this.
STALE_TEMP_AGE_S = 24 * 3600.0
#: This host, as 8 hex digits (temp names of other hosts on a shared filesystem are left alone).
_HOST = hashlib.blake2s(socket.gethostname().encode(), digest_size=4).hexdigest()
#: Random per process, in every temp name: a restarted trainer that gets the same pid on the same
#: host (pid 1 in a container) tells its predecessor's temp files from its own.
_PROCESS_TOKEN = uuid.uuid4().hex[:6]
#: Bytes of the final name kept at the front of a temp name (for people reading a listing).
TEMP_PREFIX_BYTES = 24
#: Longest temp name :meth:`Storage.temp_name_for` makes, in bytes, whatever the final name:
#: '.' + prefix + marker + host(8) '.' pid(base 36, <= 13) '.' token(6) + random(8).
TEMP_NAME_MAX_BYTES = 1 + TEMP_PREFIX_BYTES + len(TEMP_MARKER) + 8 + 1 + 13 + 1 + 14
#: NAME_MAX assumed where the filesystem cannot be asked (POSIX filesystems: 255 bytes).
DEFAULT_NAME_MAX = 255

#: Protocols whose files honour ``autocommit=False`` (an upload that becomes visible only when
#: committed); objects past the spill threshold stream through it.
DEFERRED_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})
#: Smallest spill threshold: S3's minimum multipart part size.
MIN_SPILL_BYTES = 5 << 20

#: pip package providing each protocol, where fsspec's own registry does not say it plainly.
_PROTOCOL_PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "abfss": "adlfs",
    "az": "adlfs", "adl": "adlfs", "hdfs": "pyarrow", "sftp": "paramiko", "ssh": "paramiko",
    "http": "aiohttp", "https": "aiohttp", "oci": "ocifs", "webdav": "webdav4",
}


def is_temp_name(name: str) -> bool:
    """Whether ``name`` (a basename) is a snapkeep temporary file."""
    return TEMP_MARKER in name


def _truncate_utf8(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8", "surrogateescape")[:max_bytes]
    return data.decode("utf-8", "ignore")


def base36(n: int) -> str:
    """``n`` (>= 0) in base 36, lowercase: compact pids and times in temp and arena names."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


def check_path(path: str, what: str = "path") -> None:
    """Refuse a path that could leave the directory it was built for: a ``..`` component or a NUL
    character (every write and delete of :class:`Storage` checks this, whatever the caller).

    Raises:
        ValueError: naming the path and the rule.
    """
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a str, got {type(path).__name__}")
    if "\0" in path:
        raise ValueError(f"{what} {path!r} contains a NUL character; snapshot names must not")
    if ".." in path.replace("\\", "/").split("/"):
        raise ValueError(f"{what} {path!r} has a '..' component, which could leave out_dir; "
                         "snapshot names must be relative paths inside out_dir")


def commit_strategy_for(fs: Any) -> CommitStrategy:
    """The commit strategy for ``fs`` (see :mod:`._commit`)."""
    if isinstance(fs, LocalFileSystem):
        return ReplaceCommit()
    if isinstance(fs, PfioFileSystem):
        return RenameCommit()
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & DEFERRED_UPLOAD_PROTOCOLS:
        block = getattr(fs, "default_block_size", None) or getattr(fs, "blocksize", 0)
        return ObjectPutCommit(spill_bytes=max(int(block or 0), MIN_SPILL_BYTES))
    # memory:// (whose pipe_file is one dict assignment) and backends snapkeep does not know:
    # buffer the complete file and publish it with one pipe_file call.
    return ObjectPutCommit(spill_bytes=None)


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
        self._known_dirs: set[str] = set()

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
            name: a relative name (see :func:`snapkeep._core.naming.check_name`).
            reserve_bytes: bytes the caller appends to the last component of ``name`` for a
                companion file (the manifest's ``'.json'``), counted against NAME_MAX.

        Raises:
            ValueError: ``name`` escapes ``directory`` (absolute, ``..``, NUL, ...; the message
                says what is accepted), or one of its components is longer than the
                filesystem's NAME_MAX in bytes (the message names the limit).
        """
        from snapkeep._core.naming import check_name

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
                        f"filename {name!r}: the component {_truncate_utf8(part, 40)!r}... is "
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
        probe = os.path.abspath(directory or ".")
        while True:
            try:
                return int(os.pathconf(probe, "PC_NAME_MAX"))
            except FileNotFoundError:
                parent = os.path.dirname(probe)
                if parent == probe:
                    return DEFAULT_NAME_MAX
                probe = parent
            except (OSError, ValueError):
                return DEFAULT_NAME_MAX

    def _check_write_path(self, path: str) -> None:
        check_path(path)
        limit = self.name_max(self.dirname(path))
        base = self.basename(path)
        if limit is not None and len(base.encode("utf-8", "surrogateescape")) > limit:
            raise ValueError(
                f"file name {_truncate_utf8(base, 40)!r}... is "
                f"{len(base.encode('utf-8', 'surrogateescape'))} bytes, over the filesystem's "
                f"NAME_MAX of {limit} bytes; nothing was written")

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
        if not path or (not self.strategy.real_directories and path in self._known_dirs):
            return
        try:
            with self._backend_errors("creating directory", path):
                if self.is_local:
                    _makedirs_durably(path)
                else:
                    self.fs.makedirs(path, exist_ok=True)
        except SnapshotStorageError:
            raise
        except OSError as e:
            raise storage_error(e, self.url(path), None, "creating directory",
                                self.endpoint) from e
        self._known_dirs.add(path)

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
        try:
            entries = self._fresh_ls(directory)
        except FileNotFoundError:
            return []
        names = []
        for entry in entries:
            if entry.get("type") in ("directory", "other"):  # FIFOs, sockets, devices
                continue
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if not is_temp_name(name):
                names.append(name)
        return sorted(names)

    def open_read(self, path: str) -> IO[bytes]:
        """A readable, seekable binary file. Remote files are fetched whole (one GET), so a
        connection fault surfaces here as :class:`SnapshotStorageError`, not later mid-read.
        Local files must be regular files (see :func:`open_regular`): a FIFO never blocks."""
        if self.is_local:
            return os.fdopen(open_regular(path), "rb")
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
        :func:`check_path`): no caller can make snapkeep delete outside out_dir that way."""
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
        prefix = _truncate_utf8(self.basename(path), TEMP_PREFIX_BYTES)
        return self.join(
            self.dirname(path),
            f".{prefix}{TEMP_MARKER}{_HOST}.{base36(os.getpid())}.{_PROCESS_TOKEN}"
            f"{uuid.uuid4().hex[:8]}",
        )

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

    def remove_stale_temps(self, directory: str) -> list[str]:
        """Remove temporary files left by crashed writers; return the removed paths.

        Only files that can no longer be in use are removed: those of a process on this host that
        is no longer alive (or of an earlier process that had this process's pid, as a restarted
        container's pid 1 does), and any older than :data:`STALE_TEMP_AGE_S`.
        """
        removed: list[str] = []
        try:
            entries = self._fresh_ls(directory)
        except FileNotFoundError:
            return removed
        for entry in entries:
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if not is_temp_name(name) or entry.get("type") == "directory":
                continue
            if not _temp_is_abandoned(name, entry):
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


def _makedirs_durably(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, with an ``fsync`` of the parent of every directory
    it creates (POSIX makes a new directory entry durable only then)."""
    from snapkeep._core.storage._commit import fsync_directory

    missing = []
    probe = os.path.abspath(path)
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue  # another process made it (and synced its parent)
        fsync_directory(os.path.dirname(directory))


def open_regular(path: str) -> int:
    """Open a local file for reading and return its descriptor, only if it is a regular file.

    The open never blocks (``O_NONBLOCK``, cleared once the file is known to be regular), so a
    FIFO, or a symlink to one, is refused at once instead of waiting for a writer.

    Raises:
        FileNotFoundError: no such file.
        OSError: ``EINVAL`` for a FIFO, device, socket or directory (the path named).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise OSError(errno_mod.EINVAL, f"{path} is {kind}, not a regular file; refused")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _temp_owner(name: str) -> tuple[str, int, str] | None:
    """``(host, pid, token+random)`` of a temp name (this version's or the older long form)."""
    fields = name.rsplit(TEMP_MARKER, 1)[1].split(".")
    if len(fields) == 3 and len(fields[0]) == 8:  # host(8 hex).pid(base 36).token
        try:
            return fields[0], int(fields[1], 36), fields[2]
        except ValueError:
            return None
    if len(fields) >= 4 and fields[-2].isdigit():  # older: tag.host.pid(decimal).token
        return fields[-3], int(fields[-2]), fields[-1]
    return None


def _temp_is_abandoned(name: str, entry: dict[str, Any]) -> bool:
    owner = _temp_owner(name)
    if owner is not None:
        host, pid, token = owner
        if host == _HOST:
            if pid == os.getpid():  # ours, or a predecessor's with the same pid
                return not token.startswith(_PROCESS_TOKEN)
            return not _pid_alive(pid)
    mtime: Any = entry.get("mtime") or entry.get("LastModified") or entry.get("created")
    if callable(getattr(mtime, "timestamp", None)):
        mtime = mtime.timestamp()
    if isinstance(mtime, (int, float)):
        return time.time() - float(mtime) > STALE_TEMP_AGE_S
    return False


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but is not reaped yet (Linux ``/proc``; False elsewhere): it
    can write nothing more, whoever its parent is."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return False
    return stat_line[stat_line.rfind(b")") + 2:][:1] in (b"Z", b"X")


def _install_hint(protocol: str) -> str:
    package = _PROTOCOL_PACKAGES.get(protocol)
    if package is None:
        from fsspec.registry import known_implementations

        known = known_implementations.get(protocol)
        if known is not None:
            module = str(known.get("class", "")).split(".")[0]
            if module and module != "fsspec":
                package = module
            elif known.get("err"):
                return str(known["err"])
    if package is None:
        return ("no installed package provides it; see fsspec's list of known implementations, "
                "or pass fs= an fsspec filesystem")
    extra = " (or snapkeep[s3])" if package == "s3fs" else ""
    return f"pip install {package}{extra}"


def resolve_storage(
    out_dir: str, fs: Any = None, storage_options: dict[str, Any] | None = None
) -> tuple[Storage, str]:
    """Turn ``out_dir`` (+ optional ``fs``) into ``(Storage, path on that storage)``.

    Args:
        out_dir: a local path, or an fsspec URL such as ``'s3://bucket/run'``, ``'memory://x'``
            or ``'file:///abs/dir'``.
        fs: an fsspec filesystem, or a ppe/pfio-style object (``open``, ``list``, ``stat``,
            ``exists``, ``makedirs``, ``rename``, ``remove``) as accepted by ppe writers; None
            picks by URL.
        storage_options: keyword arguments for the fsspec filesystem chosen by URL (endpoint,
            credentials); they are never logged or put in messages.

    Raises:
        ValueError: the URL's protocol is unknown or its package is missing (the message names
            the package to install), or ``storage_options`` is given together with ``fs``.
        TypeError: ``fs`` is neither an fsspec filesystem nor a pfio-style object.
    """
    out_dir = os.fspath(out_dir)
    if fs is not None:
        if storage_options:
            raise ValueError(
                "storage_options only apply when snapkeep creates the filesystem from out_dir; "
                "with fs= given, configure that filesystem instead")
        if isinstance(fs, fsspec.AbstractFileSystem):
            return Storage(fs), fs._strip_protocol(out_dir) if "://" in out_dir else out_dir
        return Storage(PfioFileSystem(fs)), out_dir  # TypeError names missing methods
    if "://" not in out_dir:
        return Storage(fsspec.filesystem("file")), out_dir
    protocol = out_dir.split("://", 1)[0]
    try:
        filesystem, path = fsspec.core.url_to_fs(out_dir, **(storage_options or {}))
    except ImportError as e:
        raise ValueError(
            f"out_dir {out_dir!r} needs the fsspec backend for protocol {protocol!r}, which is "
            f"not installed ({e}): {_install_hint(protocol)}") from e
    except ValueError as e:
        if "protocol" not in str(e).lower():
            raise
        raise ValueError(
            f"out_dir {out_dir!r} uses protocol {protocol!r}, which fsspec does not know "
            f"({e}); {_install_hint(protocol)}. Use a local path or a URL such as "
            "'s3://bucket/run', 'gs://bucket/run', 'memory://run' or 'file:///abs/dir'") from e
    return Storage(filesystem), path
