"""Commit strategies: how one file becomes visible under its final name, all at once.

A :class:`CommitStrategy` is chosen per filesystem by :class:`~._storage.Storage`:

- :class:`ReplaceCommit` -- the local filesystem: temp file in the same directory -> write ->
  flush -> ``fsync`` -> ``os.replace`` -> ``fsync`` of the directory.
- :class:`RenameCommit` -- filesystems whose only atomic primitive is a rename (ppe/pfio-style
  objects): temp name -> write -> flush (-> ``fsync`` when the file has a descriptor) -> rename.
- :class:`~._put.ObjectPutCommit` (its own module) -- object stores and in-memory filesystems:
  the complete object is uploaded under its final name in one PUT; an object larger than the
  spill threshold streams through an upload that only becomes visible when completed
  (``autocommit=False`` then ``commit()``; ``discard()`` aborts it). Never a temp object plus a
  copy.

Every strategy leaves nothing visible under the final name when it fails, and a previous file of
that name intact. Errors raised by the backend itself (including those ``torch.save`` hides behind
an opaque ``RuntimeError``) surface as :class:`SnapshotStorageError` naming the URL.
"""

from __future__ import annotations

import dataclasses
import errno as errno_mod
import io
import logging
import os
from collections.abc import Callable
from typing import Any, BinaryIO, NoReturn, Protocol

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.storage._direct import DirectFile
from snapkeep._core.storage._direct_resources import open_for_write
from snapkeep._core.storage._hashing import HashingWriter, new_hasher

logger = logging.getLogger(__name__)

WriteFn = Callable[[BinaryIO], None]

#: Called right before any file is published under its final name (rename, replace, upload
#: completion); raises to refuse. The process writer's worker sets one that checks its trainer
#: is alive, so nothing a dead trainer started becomes visible after its death.
_PUBLISH_GUARD: Callable[[], None] | None = None


def set_publish_guard(guard: Callable[[], None] | None) -> None:
    """Install (or with ``None`` remove) this process's publish guard (see above)."""
    global _PUBLISH_GUARD
    _PUBLISH_GUARD = guard


def check_publish() -> None:
    guard = _PUBLISH_GUARD
    if guard is not None:
        guard()


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """Where one commit goes.

    Attributes:
        path: final path on the filesystem.
        temp_path: a reserved temporary name next to it (used by rename-based strategies).
        url: ``path`` as the user would write it (``s3://b/k``), for messages.
        endpoint: the service endpoint when one is configured, for messages (never credentials).
    """

    path: str
    temp_path: str
    url: str
    endpoint: str | None = None


class CommitStrategy(Protocol):
    """Writes one file and publishes it atomically under ``target.path``.

    ``write`` is called once per file, from whichever thread or process runs the save (the
    trainer, a writer thread, or the worker process: strategies must be picklable and keep no
    per-call state on ``self``). ``write_fn(file)`` produces the bytes; the file it receives is
    write-only and refuses ``seek``.

    On success the file is visible under its final name, complete. On any failure nothing is
    visible under that name that was not there before (the previous file stays intact), the
    strategy's temporary resources (temp file, pending upload) are released, and the error is
    raised: a backend fault as :class:`SnapshotStorageError` (``__cause__`` = the backend's own
    exception), anything ``write_fn`` raised by itself unchanged.
    """

    #: whether the filesystem has real directories that can vanish (False: key prefixes).
    real_directories: bool

    def write(self, fs: Any, target: Target, write_fn: WriteFn) -> WriteResult:
        ...


# -- errors ----------------------------------------------------------------------------------------
def storage_error(
    exc: BaseException, url: str, size_bytes: int | None, action: str,
    endpoint: str | None = None,
) -> SnapshotStorageError:
    """A :class:`SnapshotStorageError` for ``exc`` that names ``url`` and the endpoint, never
    credentials (``storage_options`` are not looked at). ``size_bytes``: bytes written before
    the fault, ``None`` for operations that write nothing."""
    code = getattr(exc, "errno", None)
    code = code if isinstance(code, int) else None
    if code is not None and isinstance(exc, OSError) and not isinstance(exc, SnapshotStorageError):
        text = exc.strerror if isinstance(exc.strerror, str) and exc.strerror \
            else os.strerror(code)
        reason = f"[errno {code}] {text}"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    hint = ""
    if code == errno_mod.ENOSPC:
        hint = "; free space on that filesystem or lower n_retains"
    elif code in (errno_mod.EACCES, errno_mod.EPERM, errno_mod.EROFS) or \
            isinstance(exc, PermissionError):
        hint = ("; choose a writable output directory or check the credentials in "
                "storage_options")
    elif "Credentials" in type(exc).__name__:
        hint = ("; pass credentials in storage_options (for s3fs: key and secret) or configure "
                "the backend's usual credential sources")
    elif _looks_unreachable(exc):
        hint = "; check that the endpoint is reachable (storage_options endpoint_url)"
    where = f" (endpoint {endpoint})" if endpoint else ""
    after = f" after {size_bytes} bytes" if size_bytes is not None else ""
    return SnapshotStorageError(
        f"{action} {url}{where} failed{after}: {reason}{hint}",
        errno=code, filename=url, size_bytes=size_bytes,
    )


def _looks_unreachable(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                         "ConnectionClosedError", "ServerDisconnectedError"})


def raise_failure(
    exc: BaseException, backend_error: BaseException | None, size_bytes: int, target: Target,
    action: str,
) -> NoReturn:
    """Raise what a failed commit raises (see :class:`CommitStrategy`)."""
    if isinstance(backend_error, SnapshotStorageError):
        raise backend_error
    if backend_error is not None:
        raise storage_error(backend_error, target.url, size_bytes, action,
                            target.endpoint) from backend_error
    if isinstance(exc, OSError) and not isinstance(exc, SnapshotStorageError):
        raise storage_error(exc, target.url, size_bytes, action, target.endpoint) from exc
    raise exc


class Sink:
    """Passes writes through and remembers the first error the backend raised.

    ``torch.save`` replaces an exception raised by the file's ``write`` with an opaque
    ``RuntimeError``; this keeps the real cause so it can be reported.
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            written = self._raw.write(data)
        except Exception as e:
            self.error = self.error or e
            raise
        return len(memoryview(data)) if written is None else int(written)

    def flush(self) -> None:
        try:
            self._raw.flush()
        except Exception as e:
            self.error = self.error or e
            raise

    def finish(self) -> None:
        """The backend's own end of writing (``DirectFile.finish``), with the same error capture."""
        finish = getattr(self._raw, "finish", None)
        if finish is None:
            return
        try:
            finish()
        except Exception as e:
            self.error = self.error or e
            raise


# -- local: replace + fsync ------------------------------------------------------------------------
class ReplaceCommit:
    """Local filesystem: temp file -> write -> flush -> ``fsync`` -> ``os.replace`` -> ``fsync``
    of the directory (the POSIX protocol; ``os.replace`` is atomic within one filesystem).

    The temp file is written with ``O_DIRECT`` where the filesystem accepts it (see
    :mod:`._direct`; ``direct_io=False`` always writes through the page cache), and created
    with the permissions ``file_mode`` (less the umask; ``0o600`` for the memory tier's
    private files).
    """

    real_directories = True

    def __init__(self, *, direct_io: bool = True, file_mode: int = 0o644) -> None:
        self.direct_io = direct_io
        self.file_mode = file_mode

    def write(self, fs: Any, target: Target, write_fn: WriteFn) -> WriteResult:
        result = self.write_temp(target, write_fn)
        try:
            check_publish()
            os.replace(target.temp_path, target.path)
        except BaseException as e:
            unlink_quietly(target.temp_path)
            raise_failure(e, None, result.size_bytes, target, "writing snapshot")
        fsync_directory(os.path.dirname(target.path) or ".")
        return WriteResult(path=target.path, size_bytes=result.size_bytes,
                           checksum=result.checksum)

    def write_temp(self, target: Target, write_fn: WriteFn) -> WriteResult:
        """The first half of :meth:`write`: ``target.temp_path`` written, flushed and
        ``fsync``-ed, not renamed (the caller publishes it; on failure it is removed and the
        error raised as :meth:`write` raises it). Returns the temp file's result."""
        tmp = target.temp_path
        try:
            fd, direct = open_for_write(tmp, direct=self.direct_io, mode=self.file_mode)
        except OSError as e:
            raise storage_error(e, target.url, 0, "creating a temporary file for",
                                target.endpoint) from e
        hasher = new_hasher()
        try:
            raw = DirectFile(fd, direct, hasher=hasher)
        except BaseException as e:
            os.close(fd)
            unlink_quietly(tmp)
            if isinstance(e, OSError):
                raise storage_error(e, target.url, 0, "creating a temporary file for",
                                    target.endpoint) from e
            raise
        sink = Sink(raw)
        hashing = HashingWriter(sink, hashed_by=hasher)  # type: ignore[arg-type]
        try:
            with raw:
                write_fn(hashing)  # type: ignore[arg-type]
                sink.flush()
                sink.finish()
                os.fsync(raw.fileno())
                logger.debug("%s: %d bytes written (%s), %d of them in place (no copy)",
                             tmp, raw.size_bytes, "O_DIRECT" if raw.direct else "page cache",
                             raw.in_place_bytes)
        except BaseException as e:
            unlink_quietly(tmp)
            raise_failure(e, sink.error, hashing.size_bytes, target, "writing snapshot")
        return WriteResult(path=tmp, size_bytes=hashing.size_bytes,
                           checksum=hashing.hexdigest())


# -- rename-capable filesystems (ppe/pfio-style objects) -------------------------------------------
class RenameCommit:
    """Temp name -> write -> flush (-> ``fsync`` when the file has a descriptor) -> rename.

    For filesystems whose only atomic primitive is renaming a file (ppe/pfio-style objects, see
    :class:`~._pfio.PfioFileSystem`); ``fs.replace(src, dst)`` must replace ``dst`` in one step.
    Atomicity and durability are exactly those of the wrapped object's ``rename`` (POSIX:
    ``rename(2)``, no directory ``fsync`` is available through that interface; pfio's S3: a
    server-side copy, then a delete of the temp object).
    """

    real_directories = True

    def write(self, fs: Any, target: Target, write_fn: WriteFn) -> WriteResult:
        try:
            f = fs.open(target.temp_path, "wb")
        except Exception as e:
            raise storage_error(e, target.url, 0, "creating a temporary file for",
                                target.endpoint) from e
        sink = Sink(f)
        hashing = HashingWriter(sink)  # type: ignore[arg-type]
        try:
            try:
                write_fn(hashing)  # type: ignore[arg-type]
                sink.flush()
                _fsync_if_possible(f)
            finally:
                f.close()
            check_publish()
            fs.replace(target.temp_path, target.path)
        except BaseException as e:
            _remove_quietly(fs, target.temp_path)
            raise_failure(e, sink.error, hashing.size_bytes, target, "writing snapshot")
        return WriteResult(path=target.path, size_bytes=hashing.size_bytes,
                           checksum=hashing.hexdigest())


# -- helpers ---------------------------------------------------------------------------------------
def _fsync_if_possible(f: Any) -> None:
    try:
        fileno = f.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return
    if isinstance(fileno, int):
        os.fsync(fileno)


def unlink_quietly(path: str) -> None:
    """Remove the local temporary file ``path``; already gone is fine, any other failure is
    logged (a leftover temp is swept later), never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("could not remove temporary file %s: %s", path, e)


def _remove_quietly(fs: Any, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm_file(path)
    except FileNotFoundError:
        pass
    except Exception as e:
        logger.warning("could not remove temporary file %s: %s", path, e)


def fsync_directory(directory: str) -> None:
    """``fsync`` a local directory so a rename in it is durable (skipped where unsupported)."""
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
