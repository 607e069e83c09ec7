"""The capabilities layered on a session (public names for the doors): the memory tier (node
RAM and verified peer copies: :class:`MemoryTier`, the :class:`TieredSession` layer every door
takes through :func:`tiered`) and incremental snapshots (:class:`IncrementalTracker`: a skeleton
file and shared blobs). See :mod:`snapkeep._core.tiers`.
"""

from snapkeep._core.tiers.incremental import IncrementalTracker
from snapkeep._core.tiers.memory_store import NotPrivateError, describe_tiers
from snapkeep._core.tiers.memory_tier import (
    MemoryTier,
    Restored,
    check_into_live,
    copy_into_live,
    flat_keys,
    local_shards,
    newest_listed_step,
    state_bytes,
)
from snapkeep._core.tiers.tiered_session import TieredSession, check_memory, tiered

__all__ = [
    "IncrementalTracker", "MemoryTier", "NotPrivateError", "Restored", "TieredSession",
    "check_into_live", "check_memory", "copy_into_live", "describe_tiers", "flat_keys",
    "local_shards", "newest_listed_step", "state_bytes", "tiered",
]
