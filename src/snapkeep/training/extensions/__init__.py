"""Extensions shipped with snapkeep, under ppe's names (as ``ppe.training.extensions``).

Snapshots (``snapshot``, ``snapshot_object``), the node-RAM tier (``memory_tier``,
``MemoryTier``) and the extensions of a usual ppe training loop:
``LogReport``, ``PrintReport``, ``ProgressBar``, ``observe_lr``, ``observe_value``,
``LRScheduler``, ``FailOnNonNumber`` and ``Evaluator``. Asking for another ppe extension
(``PlotReport``, ``ParameterStatistics``, ...) raises an ``AttributeError`` that explains how
to keep it: ppe's manager with snapkeep's snapshot extension.
"""

from typing import Any

from snapkeep._not_shipped import not_shipped_error
from snapkeep.training.extensions._memory_tier import MemoryTier, memory_tier
from snapkeep.training.extensions._preemption import (
    EXIT_CODE_PREEMPTED,
    Preemption,
    preemption,
)
from snapkeep.training.extensions._snapshot import SnapshotMode, snapshot, snapshot_object
from snapkeep.training.extensions.evaluator import Evaluator
from snapkeep.training.extensions.fail_on_non_number import FailOnNonNumber
from snapkeep.training.extensions.log_report import LogReport
from snapkeep.training.extensions.lr_scheduler import LRScheduler
from snapkeep.training.extensions.print_report import PrintReport
from snapkeep.training.extensions.progress_bar import ProgressBar
from snapkeep.training.extensions.value_observation import observe_lr, observe_value

PrintReportCLI = PrintReport  # ppe's names of the terminal versions
ProgressBarCLI = ProgressBar
_ipython_module_available = False  # ppe's flag (its tests import it): no notebook variants

__all__ = [
    "EXIT_CODE_PREEMPTED",
    "Evaluator",
    "FailOnNonNumber",
    "LRScheduler",
    "LogReport",
    "MemoryTier",
    "Preemption",
    "PrintReport",
    "PrintReportCLI",
    "ProgressBar",
    "ProgressBarCLI",
    "memory_tier",
    "SnapshotMode",
    "observe_lr",
    "observe_value",
    "preemption",
    "sharded_snapshot",
    "snapshot",
    "snapshot_object",
]


def __getattr__(name: str) -> Any:
    # sharded_snapshot imports torch.distributed.checkpoint (seconds): only when asked for
    if name == "sharded_snapshot":
        from snapkeep.training.extensions._sharded import sharded_snapshot

        return sharded_snapshot
    raise not_shipped_error(__name__, name)
