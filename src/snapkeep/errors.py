"""Public exception types (see :mod:`snapkeep._core.errors`)."""

from snapkeep._core.distributed.errors import (
    CollectiveTimeoutError,
    NoCommonSnapshotError,
    RankFailedError,
)
from snapkeep._core.errors import (
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
    "CollectiveTimeoutError", "NoCommonSnapshotError", "RankFailedError",
    "NoValidSnapshotError", "SnapshotCorruptError", "SnapshotError", "SnapshotSaveError",
    "SnapshotStorageError", "SnapshotTimeoutError", "StagingRaceError", "StateMismatchError",
    "StoreLockedError", "UnsafeSnapshotError", "WorkerDiedError",
    "CollectiveTimeoutError", "NoCommonSnapshotError", "RankFailedError",
]
