"""Public exception types (see :mod:`snapkeep._core.errors`)."""

from snapkeep._core.errors import (
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotSaveError,
    SnapshotStorageError,
    SnapshotTimeoutError,
    StagingRaceError,
    StateMismatchError,
    UnsafeSnapshotError,
    WorkerDiedError,
)

__all__ = [
    "NoValidSnapshotError", "SnapshotCorruptError", "SnapshotError", "SnapshotSaveError",
    "SnapshotStorageError", "SnapshotTimeoutError", "StagingRaceError", "StateMismatchError",
    "UnsafeSnapshotError",
    "WorkerDiedError",
]
