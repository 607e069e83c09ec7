"""Distributed snapshots (public names): snapkeep's own process groups, agreement between ranks
on what to resume, and sharded snapshots through ``torch.distributed.checkpoint``. See
:mod:`snapkeep._core.distributed` for the engine and ``docs/scale-out.md`` for the flow."""

from snapkeep._core.distributed import (
    MARKER_NAME,
    CollectiveTimeoutError,
    Groups,
    NoCommonSnapshotError,
    RankFailedError,
    ShardedHandle,
    ShardedJob,
    ShardedManifest,
    ShardedSaver,
    ShardedStore,
    agree_on_resume,
    all_gather,
    background_groups,
    exchange_outcomes,
    is_distributed,
    load_sharded,
    saved_keys,
)

__all__ = [
    "MARKER_NAME", "CollectiveTimeoutError", "Groups", "NoCommonSnapshotError",
    "RankFailedError", "ShardedHandle", "ShardedJob", "ShardedManifest", "ShardedSaver",
    "ShardedStore", "agree_on_resume", "all_gather", "background_groups", "exchange_outcomes",
    "is_distributed", "load_sharded", "saved_keys",
]
