"""Extensions shipped with snapkeep (as ``ppe.training.extensions``): snapshots."""

from snapkeep.training.extensions._snapshot import snapshot, snapshot_object

__all__ = ["snapshot", "snapshot_object"]
