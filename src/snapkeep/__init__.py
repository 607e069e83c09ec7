"""snapkeep: safe, cheap PyTorch training snapshots with a pytorch-pfn-extras compatible API.

``import snapkeep as ppe`` keeps ppe code working: ``ppe.training.ExtensionsManager``,
``ppe.training.extensions.snapshot``, ``ppe.writing.ThreadWriter``, ``ppe.reporting.report``.
"""

from typing import Any

from snapkeep import errors, reporting, retention, training, writing  # noqa: E402
from snapkeep._not_shipped import not_shipped_error
from snapkeep._version import __version__
from snapkeep.checkpointer import Checkpointer  # noqa: E402
from snapkeep.errors import (  # noqa: E402
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
from snapkeep.loading import load_latest  # noqa: E402
from snapkeep.reporting import report  # noqa: E402
from snapkeep.session import AutoInterval
from snapkeep.tiers import MemoryTier

__all__ = [
    "__version__", "errors", "reporting", "retention", "training", "writing", "load_latest",
    "report", "Checkpointer", "MemoryTier", "AutoInterval",
    "NoValidSnapshotError", "SnapshotCorruptError", "SnapshotError", "SnapshotSaveError",
    "SnapshotStorageError", "SnapshotTimeoutError", "StagingRaceError", "StateMismatchError",
    "StoreLockedError", "UnsafeSnapshotError", "WorkerDiedError",
]


def __getattr__(name: str) -> Any:
    # ppe's names snapkeep does not ship (ppe.nn, ppe.to, ppe.cuda, ...): a pointing error
    raise not_shipped_error(__name__, name)
