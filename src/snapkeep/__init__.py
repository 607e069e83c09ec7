"""snapkeep: safe, cheap PyTorch training snapshots with a pytorch-pfn-extras compatible API.

``import snapkeep as ppe`` keeps ppe code working: ``ppe.training.ExtensionsManager``,
``ppe.training.extensions.snapshot``, ``ppe.writing.ThreadWriter``, ``ppe.reporting.report``.
"""

__version__ = "0.1.0"

from snapkeep import errors, reporting, retention, training, writing  # noqa: E402
from snapkeep.errors import (  # noqa: E402
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotSaveError,
    SnapshotStorageError,
    SnapshotTimeoutError,
    StagingRaceError,
    StateMismatchError,
    UnsafeSnapshotError,
    WorkerDiedError,
)
from snapkeep.reporting import report  # noqa: E402

__all__ = [
    "__version__", "errors", "reporting", "retention", "training", "writing", "report",
    "NoValidSnapshotError", "SnapshotCorruptError", "SnapshotError", "SnapshotSaveError",
    "SnapshotStorageError", "SnapshotTimeoutError", "StagingRaceError", "StateMismatchError",
    "UnsafeSnapshotError",
    "WorkerDiedError",
]
