"""Public exception types (see :mod:`snapkeep._core.errors`)."""

from snapkeep._core.distributed.errors import (
    CollectiveTimeoutError,
    NoCommonSnapshotError,
    RankFailedError,
)
from snapkeep._core.errors import (
    IncrementalSnapshotError,
    ManifestError,
    MemoryTierTooSmallError,
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotSaveError,
    SnapshotStorageError,
    SnapshotTimeoutError,
    StagingRaceError,
    StateMismatchError,
    StoreLockedError,
    UnsafeSnapshotError,
    WorkerDiedError,
)

__all__ = [
    "CollectiveTimeoutError", "IncrementalSnapshotError", "ManifestError",
    "MemoryTierTooSmallError",
    "NoCommonSnapshotError", "NoValidSnapshotError",
    "RankFailedError", "SnapshotCorruptError", "SnapshotError", "SnapshotSaveError",
    "SnapshotStorageError", "SnapshotTimeoutError", "StagingRaceError", "StateMismatchError",
    "StoreLockedError", "UnsafeSnapshotError", "WorkerDiedError",
]
