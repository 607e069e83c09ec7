"""Compatibility path ``snapkeep.training.trigger`` (ppe keeps ``training/trigger.py`` too).

Re-exports the trigger base class, :func:`get_trigger` and :class:`IntervalTrigger` so code
written against ``pytorch_pfn_extras.training.trigger`` keeps working after the import switch.
"""

from snapkeep.training._trigger_util import (
    Trigger,
    TriggerFunc,
    TriggerLike,
    _never_fire_trigger,
    get_trigger,
)
from snapkeep.training.triggers.interval_trigger import IntervalTrigger

__all__ = [
    "IntervalTrigger",
    "Trigger",
    "TriggerFunc",
    "TriggerLike",
    "_never_fire_trigger",
    "get_trigger",
]
