"""Object stores and in-memory filesystems: the complete object under its final name in one PUT
(see :mod:`._commit` for the other strategies and what every strategy guarantees)."""

from __future__ import annotations

import io
import logging
from typing import Any

from snapkeep._core.storage._commit import (
    Sink,
    Target,
    WriteFn,
    WriteResult,
    check_publish,
    raise_failure,
)
from snapkeep._core.storage._hashing import HashingWriter

logger = logging.getLogger(__name__)


class ObjectPutCommit:
    """The complete object under its final name in one PUT; never a temp object plus a copy.

    Bytes are buffered in memory; a file that stays below ``spill_bytes`` is sent with one
    ``fs.pipe_file`` (a single PUT). Past ``spill_bytes`` the buffer spills into
    ``fs.open(path, 'wb', autocommit=False)``, which streams parts (S3: a multipart upload) that no
    reader can see until ``commit()`` completes it; on failure ``discard()`` aborts it.

    Args:
        spill_bytes: threshold in bytes for streaming; ``None`` never spills (the whole file is
            buffered, for filesystems whose files do not honour ``autocommit=False``, such as
            ``memory://`` whose ``pipe_file`` is one dict assignment).
    """

    real_directories = False

    def __init__(self, spill_bytes: int | None) -> None:
        self.spill_bytes = spill_bytes

    def write(self, fs: Any, target: Target, write_fn: WriteFn) -> WriteResult:
        upload = _Upload(fs, target.path, self.spill_bytes)
        sink = Sink(upload)
        hashing = HashingWriter(sink)  # type: ignore[arg-type]
        try:
            write_fn(hashing)  # type: ignore[arg-type]
        except BaseException as e:
            upload.discard()
            raise_failure(e, sink.error, hashing.size_bytes, target, "uploading snapshot")
        try:
            check_publish()
            upload.commit()
        except BaseException as e:
            upload.discard()
            raise_failure(e, e if isinstance(e, Exception) else None, hashing.size_bytes,
                           target, "uploading snapshot")
        return WriteResult(path=target.path, size_bytes=hashing.size_bytes,
                           checksum=hashing.hexdigest())


class _Upload:
    """Buffer, then one PUT or a deferred-commit upload (see :class:`ObjectPutCommit`)."""

    def __init__(self, fs: Any, path: str, spill_bytes: int | None) -> None:
        self._fs = fs
        self._path = path
        self._spill = spill_bytes
        self._buffer = io.BytesIO()
        self._file: Any = None
        self._discarded = False

    def write(self, data: Any) -> int:
        if self._discarded:
            raise ValueError(f"the upload of {self._path} was discarded")
        if self._file is not None:
            self._file.write(data)
            return len(memoryview(data))
        n = self._buffer.write(data)
        if self._spill is not None and self._buffer.tell() >= self._spill:
            self._file = self._fs.open(self._path, "wb", autocommit=False)
            view = self._buffer.getbuffer()
            try:
                self._file.write(view)
            finally:
                view.release()
            self._buffer = io.BytesIO()
        return n

    def flush(self) -> None:
        """Nothing to do: the data is published only by :meth:`commit`."""

    def commit(self) -> None:
        if self._discarded:
            raise ValueError(f"the upload of {self._path} was discarded")
        if self._file is None:
            self._fs.pipe_file(self._path, self._buffer.getvalue())
            self._buffer = io.BytesIO()
            return
        self._file.close()
        self._file.commit()

    def discard(self) -> None:
        self._discarded = True
        self._buffer = io.BytesIO()
        f, self._file = self._file, None
        if f is None:
            return
        try:
            f.discard()
        except Exception:  # the original error matters more than a failed abort
            logger.warning("aborting the partial upload of %s failed; the store may keep its "
                           "parts until a lifecycle rule removes them (nothing is visible under "
                           "the name)", self._path, exc_info=True)
        # An fsspec buffered file closed later (or by its finalizer) would flush and complete the
        # upload it just discarded; mark it closed so nothing is sent.
        try:
            f.closed = True
        except AttributeError:
            pass
