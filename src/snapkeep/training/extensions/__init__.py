"""Extensions shipped with snapkeep (as ``ppe.training.extensions``): snapshots."""

from snapkeep.training.extensions._sharded import sharded_snapshot
from snapkeep.training.extensions._snapshot import SnapshotMode, snapshot, snapshot_object

__all__ = ["SnapshotMode", "sharded_snapshot", "snapshot", "snapshot_object"]
