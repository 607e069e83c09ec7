"""Distributed snapshots (public names): snapkeep's own process groups, agreement between ranks
on what to resume, and sharded snapshots through ``torch.distributed.checkpoint``. See
:mod:`snapkeep._core.distributed` for the engine and ``docs/scale-out.md`` for the flow.

The sharded names (``ShardedSaver``, ``ShardedStore``, ``load_sharded``, ...) import
``torch.distributed.checkpoint`` (seconds) on first access only.
"""

from typing import Any

from snapkeep._core.distributed.agreement import (
    agree_on_resume,
    all_gather,
    exchange_outcomes,
    together,
)
from snapkeep._core.distributed.errors import (
    CollectiveTimeoutError,
    NoCommonSnapshotError,
    RankFailedError,
)
from snapkeep._core.distributed.groups import (
    Groups,
    background_groups,
    exit_cleanly_at_exit,
    is_distributed,
    job_rank,
)
from snapkeep._core.distributed.launcher import end_if_orphaned, on_orphaned
from snapkeep._core.distributed.signals import (
    EXIT_CODE_PREEMPTED,
    EXIT_CODE_PREEMPTED_NOT_DURABLE,
    parse_signals,
    signal_name,
    signalled,
)

_SHARDED = {
    "ShardedHandle": "sharded", "ShardedJob": "sharded", "ShardedSaver": "sharded",
    "load_sharded": "sharded", "saved_keys": "sharded", "object_to_bytes": "sharded",
    "object_from_bytes": "sharded", "optimizer_module": "sharded", "RankObjects": "sharded",
    "MARKER_NAME": "sharded_store", "ShardedManifest": "sharded_store",
    "ShardedStore": "sharded_store", "gather_dcp": "dcp_safe", "metadata_of": "dcp_safe",
}

__all__ = [
    "CollectiveTimeoutError", "Groups", "NoCommonSnapshotError", "RankFailedError",
    "agree_on_resume", "all_gather", "background_groups", "end_if_orphaned",
    "exchange_outcomes", "exit_cleanly_at_exit", "is_distributed",
    "EXIT_CODE_PREEMPTED", "EXIT_CODE_PREEMPTED_NOT_DURABLE",
    "job_rank", "on_orphaned", "parse_signals", "signal_name", "signalled", "together",
    *sorted(_SHARDED),
]


def __getattr__(name: str) -> Any:
    module = _SHARDED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"snapkeep._core.distributed.{module}"), name)
