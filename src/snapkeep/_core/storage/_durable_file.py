"""A new local file written durably in one pass: ``O_DIRECT`` where the file system takes it,
hashed as written, ``fsync``-ed when closed.

For writers that choose their own file names inside a directory that is not yet visible (the
sharded snapshot's DCP files: the directory becomes a snapshot only when its marker is
committed), so no temp name and rename are needed. The bytes take the path of
:class:`~snapkeep._core.storage._direct.DirectFile` (no copy into the page cache; each piece
hashed while it is in the CPU cache); where ``O_DIRECT`` is refused or off they go through the
page cache. Either way the file is durable once :meth:`DurableFile.close` returns.
"""

from __future__ import annotations

import contextlib
import os

from snapkeep._core.storage._direct import DirectFile
from snapkeep._core.storage._direct_resources import open_for_write
from snapkeep._core.storage._hashing import HashingWriter, new_hasher


class DurableFile(HashingWriter):
    """A write-only file created at ``path`` (``write``/``tell``/``flush``/``close``), counted
    (:attr:`size_bytes`) and hashed (:meth:`hexdigest`, XXH3-128) as written.

    Args:
        path: a local path; a file already there is removed first (the caller's directory is
            not yet visible), a symlink in its place is never followed.
        direct_io: write with ``O_DIRECT`` where the file system takes it.
        file_mode: permission bits of the new file (less the umask).

    Raises:
        OSError: from ``open(2)``/``unlink(2)`` (``ENOSPC``, ``EACCES``, ...).
    """

    def __init__(self, path: str, *, direct_io: bool = True, file_mode: int = 0o644) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fd, direct = open_for_write(path, direct=direct_io, mode=file_mode)
        hasher = new_hasher()
        try:
            raw = DirectFile(fd, direct, hasher=hasher)
        except BaseException:
            os.close(fd)
            raise
        super().__init__(raw, hashed_by=hasher)  # type: ignore[arg-type]
        self._file = raw
        #: whether :meth:`close` made every byte durable
        self.durable = False

    def close(self) -> None:
        """Write what is gathered, ``fsync`` the file and close it (then :attr:`durable`);
        idempotent.

        Raises:
            OSError: from ``write(2)``, ``ftruncate(2)`` or ``fsync(2)`` (the file is closed
                all the same, not durable).
        """
        if self._file.closed:
            return
        try:
            self._file.finish()
            os.fsync(self._file.fileno())
            self.durable = True
        finally:
            self._file.close()

    def abort(self) -> None:
        """Close without making it durable (after a failed write); idempotent."""
        self._file.close()


__all__ = ["DurableFile"]
