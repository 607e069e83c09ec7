"""fsspec-backed storage with a per-backend atomic, durable commit."""

from __future__ import annotations

import dataclasses
import errno as errno_mod
import logging
import os
import posixpath
import socket
import time
import uuid
from collections.abc import Callable
from typing import IO, Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from snapkeep._core.checksum import HashingWriter
from snapkeep._core.errors import SnapshotStorageError

logger = logging.getLogger(__name__)

#: Every temporary name contains this marker; such names are never listed as snapshots.
TEMP_MARKER = ".snapkeep-tmp."
#: Temporary files whose owner cannot be checked are removed once older than this.
STALE_TEMP_AGE_S = 24 * 3600.0
_HOST = socket.gethostname().replace(".", "_")

_PROTOCOL_PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "az": "adlfs",
    "hdfs": "pyarrow", "sftp": "paramiko", "ssh": "paramiko", "http": "aiohttp",
    "https": "aiohttp",
}


def is_temp_name(name: str) -> bool:
    """Whether ``name`` (a basename) is a snapkeep temporary file."""
    return TEMP_MARKER in name


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteResult:
    """What a commit wrote.

    Attributes:
        path: final path of the committed file.
        size_bytes: bytes written.
        checksum: XXH3-128 hex digest of those bytes.
    """

    path: str
    size_bytes: int
    checksum: str


def _storage_error(exc: BaseException, path: str, size_bytes: int, action: str) -> Exception:
    code = getattr(exc, "errno", None)
    reason = os.strerror(code) if isinstance(code, int) else str(exc)
    hint = ""
    if code == errno_mod.ENOSPC:
        hint = "; free space on that filesystem or lower n_retains"
    elif code in (errno_mod.EACCES, errno_mod.EPERM, errno_mod.EROFS):
        hint = "; choose a writable out_dir"
    return SnapshotStorageError(
        f"{action} {path!r} failed after {size_bytes} bytes: [errno {code}] {reason}{hint}",
        errno=code if isinstance(code, int) else None, filename=path, size_bytes=size_bytes,
    )


class Storage:
    """One filesystem, local or remote, and how to commit a file on it atomically and durably.

    Local filesystems commit with temp file -> write -> flush -> ``fsync`` -> ``os.replace`` ->
    ``fsync`` of the directory. Object stores and other fsspec backends write the object under its
    final name with ``autocommit=False`` (a multipart upload that only becomes visible when
    completed) and ``discard()`` it on failure, so no partial object is ever visible.

    Instances are picklable (they travel to the process writer's worker).

    Args:
        fs: an fsspec filesystem.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"Storage({protocol})"

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

    # -- plain operations ------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents (a no-op on object stores without directories).

        Raises:
            SnapshotStorageError: the directory cannot be created (errno and path named).
        """
        if not path:
            return
        try:
            self.fs.makedirs(path, exist_ok=True)
        except OSError as e:
            raise _storage_error(e, path, 0, "creating directory") from e

    def list_names(self, directory: str) -> list[str]:
        """Basenames of the files directly in ``directory``, temp files excluded; [] if missing."""
        try:
            entries = self.fs.ls(directory or ".", detail=True, refresh=True) if not self.is_local \
                else self.fs.ls(directory or ".", detail=True)
        except FileNotFoundError:
            return []
        names = []
        for entry in entries:
            if entry.get("type") == "directory":
                continue
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if not is_temp_name(name):
                names.append(name)
        return sorted(names)

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(path, "rb")  # type: ignore[no-any-return]

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def remove(self, path: str) -> None:
        """Delete one file. Raises ``FileNotFoundError`` when it is already gone."""
        self.fs.rm_file(path)

    # -- commit ----------------------------------------------------------------------------------
    def temp_name_for(self, path: str, tag: str) -> str:
        base = self.basename(path)
        return self.join(
            self.dirname(path),
            f".{base}{TEMP_MARKER}{tag}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}",
        )

    def write(self, path: str, write_fn: Callable[[BinaryIO], None], *, tag: str = "w") -> WriteResult:
        """Write a file through ``write_fn(file)`` and commit it atomically and durably.

        ``write_fn`` receives a write-only binary file object; it must not seek. A reader never
        sees a partial file under ``path``; a previous file under ``path`` stays intact until the
        new one replaces it in one step.

        Args:
            path: final path.
            write_fn: writes the content (e.g. ``lambda f: torch.save(obj, f)``).
            tag: short string unique to the writer, put in the temporary name.

        Returns:
            The committed :class:`WriteResult`.

        Raises:
            SnapshotStorageError: an OS/storage error (names the file, bytes written, errno); the
                temporary file is removed and the previous file under ``path`` is intact.
            Exception: whatever ``write_fn`` raised, after the same clean-up.
        """
        if self.is_local:
            return self._write_local(path, write_fn, tag)
        return self._write_object(path, write_fn)

    def write_bytes(self, path: str, data: bytes, *, tag: str = "w") -> WriteResult:
        """:meth:`write` for a small in-memory payload (manifests)."""
        return self.write(path, lambda f: f.write(data), tag=tag)  # type: ignore[arg-type,return-value]

    def _write_local(self, path: str, write_fn: Callable[[BinaryIO], None], tag: str) -> WriteResult:
        directory = self.dirname(path) or "."
        tmp = self.temp_name_for(path, tag)
        hashing: HashingWriter | None = None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise _storage_error(e, path, 0, "creating a temporary file for") from e
        try:
            with os.fdopen(fd, "wb", buffering=1 << 20) as raw:
                hashing = HashingWriter(raw)
                write_fn(hashing)  # type: ignore[arg-type]
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            _unlink_quietly(tmp)
            if isinstance(e, OSError) and not isinstance(e, SnapshotStorageError):
                written = hashing.size_bytes if hashing is not None else 0
                raise _storage_error(e, path, written, "writing snapshot") from e
            raise
        _fsync_directory(directory)
        return WriteResult(path=path, size_bytes=hashing.size_bytes, checksum=hashing.hexdigest())

    def _write_object(self, path: str, write_fn: Callable[[BinaryIO], None]) -> WriteResult:
        hashing: HashingWriter | None = None
        try:
            f = self.fs.open(path, "wb", autocommit=False)
        except OSError as e:
            raise _storage_error(e, path, 0, "opening for upload") from e
        try:
            hashing = HashingWriter(f)
            write_fn(hashing)  # type: ignore[arg-type]
            f.close()
            f.commit()
        except BaseException as e:
            try:
                f.discard()
            except Exception:  # the original error matters more than a failed abort
                logger.warning("discarding the partial upload of %s failed", path, exc_info=True)
            if isinstance(e, OSError) and not isinstance(e, SnapshotStorageError):
                written = hashing.size_bytes if hashing is not None else 0
                raise _storage_error(e, path, written, "uploading snapshot") from e
            raise
        return WriteResult(path=path, size_bytes=hashing.size_bytes, checksum=hashing.hexdigest())

    def append(self, path: str, write_fn: Callable[[BinaryIO], None]) -> None:
        """Append through ``write_fn`` without atomicity (ppe's ``append=True``), then fsync."""
        with self.fs.open(path, "ab") as f:
            write_fn(f)
            f.flush()
            if self.is_local:
                os.fsync(f.fileno())

    def remove_stale_temps(self, directory: str) -> list[str]:
        """Remove temporary files left by crashed writers; return the removed paths.

        Only files that can no longer be in use are removed: those of a process on this host that
        is no longer alive, and any older than :data:`STALE_TEMP_AGE_S`.
        """
        removed: list[str] = []
        try:
            entries = self.fs.ls(directory or ".", detail=True)
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


def _temp_is_abandoned(name: str, entry: dict[str, Any]) -> bool:
    fields = name.split(TEMP_MARKER, 1)[1].split(".")
    if len(fields) >= 4:
        host, pid_text = fields[-3], fields[-2]
        if host == _HOST and pid_text.isdigit():
            return not _pid_alive(int(pid_text))
    mtime = entry.get("mtime") or entry.get("LastModified") or entry.get("created")
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
    return True


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("could not remove temporary file %s: %s", path, e)


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as e:
        logger.warning("cannot open directory %s to fsync it: %s", directory, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (e.g. certain network mounts) refuse a dir fsync
        logger.debug("fsync of directory %s not supported: %s", directory, e)
    finally:
        os.close(fd)


def resolve_storage(
    out_dir: str, fs: Any = None, storage_options: dict[str, Any] | None = None
) -> tuple[Storage, str]:
    """Turn ``out_dir`` (+ optional ``fs``) into ``(Storage, path on that storage)``.

    Args:
        out_dir: a local path, or an fsspec URL such as ``'s3://bucket/run'`` or ``'memory://x'``.
        fs: an fsspec filesystem, or a ppe/pfio-style object (``open``, ``list``, ``exists``,
            ``makedirs``, ``rename``, ``remove``) as accepted by ppe writers; None picks by URL.
        storage_options: keyword arguments for the fsspec filesystem (endpoint, credentials).

    Raises:
        ValueError: the URL's protocol is unknown; the message names the package to install.
    """
    if fs is not None:
        if isinstance(fs, fsspec.AbstractFileSystem):
            return Storage(fs), fs._strip_protocol(out_dir) if "://" in out_dir else out_dir
        from snapkeep._core.storage._pfio import PfioFileSystem

        return Storage(PfioFileSystem(fs)), out_dir
    if "://" not in out_dir:
        return Storage(fsspec.filesystem("file")), out_dir
    protocol = out_dir.split("://", 1)[0]
    try:
        filesystem, path = fsspec.core.url_to_fs(out_dir, **(storage_options or {}))
    except (ImportError, ValueError) as e:
        package = _PROTOCOL_PACKAGES.get(protocol)
        install = f"pip install {package}" if package else "install the fsspec backend for it"
        raise ValueError(
            f"out_dir {out_dir!r} uses protocol {protocol!r}, which fsspec cannot open here "
            f"({e}); {install}"
        ) from e
    if isinstance(filesystem, LocalFileSystem):
        return Storage(filesystem), path
    return Storage(filesystem), path
