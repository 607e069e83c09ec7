"""The distributed engine: snapkeep's own process groups, agreements between ranks, and sharded
snapshots through ``torch.distributed.checkpoint``. The only part of ``_core`` that imports
``torch.distributed``."""

from snapkeep._core.distributed.agreement import agree_on_resume, all_gather, exchange_outcomes
from snapkeep._core.distributed.errors import (
    CollectiveTimeoutError,
    NoCommonSnapshotError,
    RankFailedError,
)
from snapkeep._core.distributed.groups import Groups, background_groups, is_distributed
from snapkeep._core.distributed.sharded import (
    ShardedHandle,
    ShardedJob,
    ShardedSaver,
    load_sharded,
    saved_keys,
)
from snapkeep._core.distributed.sharded_store import MARKER_NAME, ShardedManifest, ShardedStore

__all__ = [
    "MARKER_NAME", "CollectiveTimeoutError", "Groups", "NoCommonSnapshotError",
    "RankFailedError", "ShardedHandle", "ShardedJob", "ShardedManifest", "ShardedSaver",
    "ShardedStore", "agree_on_resume", "all_gather", "background_groups", "exchange_outcomes",
    "is_distributed", "load_sharded", "saved_keys",
]
