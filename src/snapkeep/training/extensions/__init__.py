"""Extensions shipped with snapkeep (as ``ppe.training.extensions``): snapshots."""

from snapkeep.training.extensions._preemption import (
    EXIT_CODE_PREEMPTED,
    Preemption,
    preemption,
)
from snapkeep.training.extensions._snapshot import SnapshotMode, snapshot, snapshot_object

__all__ = ["EXIT_CODE_PREEMPTED", "Preemption", "SnapshotMode", "preemption", "sharded_snapshot",
           "snapshot", "snapshot_object"]


def __getattr__(name: str) -> object:
    # sharded_snapshot imports torch.distributed.checkpoint (seconds): only when asked for
    if name == "sharded_snapshot":
        from snapkeep.training.extensions._sharded import sharded_snapshot

        return sharded_snapshot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
