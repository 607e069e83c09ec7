"""Exception hierarchy.

Every snapkeep error derives from :class:`SnapshotError` and also from the builtin a caller would
already catch for that kind of fault (``OSError`` for storage faults, ``TimeoutError`` for bounded
waits, ``ValueError`` for content that fails verification), so ``except OSError`` keeps working.
"""

from __future__ import annotations

import pickle


class SnapshotError(Exception):
    """Base class of every error raised by snapkeep."""


class SnapshotSaveError(SnapshotError, RuntimeError):
    """A background save failed.

    Raised once, at the next writer call or at ``finalize()``, with the original exception as
    ``__cause__`` (its traceback included).
    """


class SnapshotStorageError(SnapshotError, OSError):
    """An OS or storage error during a save or load (disk full, permission denied, ...).

    ``errno`` is the original errno when there is one; ``filename`` names the file;
    ``size_bytes`` is the number of bytes the save had attempted to write when known.
    """

    def __init__(
        self, message: str, *, errno: int | None = None, filename: str | None = None,
        size_bytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = errno
        self.filename = filename
        self.size_bytes = size_bytes
        self.strerror = message

    def __str__(self) -> str:
        return str(self.strerror)


class SnapshotTimeoutError(SnapshotError, TimeoutError):
    """A bounded wait for a staged or committed snapshot ran out."""


class WorkerDiedError(SnapshotError, RuntimeError):
    """The background process that writes snapshots died (killed, crashed, out of memory)."""


class SnapshotCorruptError(SnapshotError, ValueError):
    """A snapshot failed verification: checksum mismatch, truncated or unreadable file."""


class ManifestError(SnapshotError, ValueError):
    """A snapshot's manifest is not a valid snapkeep manifest (wrong schema version, a field of
    the wrong type or size, not a regular file, too large); its snapshot counts as unverified."""


class NoValidSnapshotError(SnapshotError, RuntimeError):
    """Snapshot files exist but none of them verifies, so resuming would silently start over."""


class StateMismatchError(SnapshotError, ValueError):
    """A loaded snapshot's keys or shapes do not match the target (first mismatches listed)."""


class UnsafeSnapshotError(SnapshotError, pickle.UnpicklingError):
    """A snapshot needs arbitrary unpickling, which is refused unless ``weights_only=False``."""


class StoreLockedError(SnapshotError, RuntimeError):
    """Another live trainer holds the lock of this output directory and filename template.

    Attributes:
        holder: who holds it (``'pid 123 on host h since 2026-12-03 19:00:00 UTC'``; empty
            when that could not be read).
    """

    holder = ""


class MemoryTierTooSmallError(SnapshotError, ValueError):
    """The filesystem under the memory tier's root (a tmpfs) has less free space than the tier
    needs; raised at start, naming the size needed."""


class StagingRaceError(SnapshotError, RuntimeError):
    """A tensor staged in the background (overlapped staging) was modified in place after the
    snapshot call and before its copy was validated on the training thread; that snapshot was
    dropped (never written). Raised with ``overlap='strict'``; otherwise its message is warned
    once and the run goes on (see :mod:`snapkeep._core.save.overlap`)."""


class IncrementalSnapshotError(SnapshotError, RuntimeError):
    """An incremental snapshot was opened by something that cannot materialise it: a bare
    ``torch.load(path, weights_only=False)`` (its large tensors are blobs beside it, see
    :mod:`snapkeep._core.tiers.incremental`). Load it with snapkeep, or write a plain ``torch.save``
    file with ``snapkeep convert``."""
