"""Public exception types (see :mod:`snapkeep._core.errors`)."""

from snapkeep._core.errors import (
    ManifestError,
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotSaveError,
    SnapshotStorageError,
    SnapshotTimeoutError,
    StateMismatchError,
    UnsafeSnapshotError,
    WorkerDiedError,
)

__all__ = [
    "ManifestError", "NoValidSnapshotError", "SnapshotCorruptError", "SnapshotError",
    "SnapshotSaveError",
    "SnapshotStorageError", "SnapshotTimeoutError", "StateMismatchError", "UnsafeSnapshotError",
    "WorkerDiedError",
]
