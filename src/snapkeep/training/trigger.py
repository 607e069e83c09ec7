"""Compatibility path ``snapkeep.training.trigger`` (ppe keeps ``training/trigger.py`` too).

Re-exports the trigger base class, :func:`get_trigger` and :class:`IntervalTrigger` so code
written against ``pytorch_pfn_extras.training.trigger`` keeps working after the import switch.
"""

from snapkeep.training._trigger_util import (
    Trigger,
    TriggerFunc,
    TriggerLike,
    get_trigger,
    never_fire_trigger,
)
from snapkeep.training.triggers.interval_trigger import IntervalTrigger

#: ppe's private name (``ppe.training.trigger._never_fire_trigger``), kept on this ppe path.
_never_fire_trigger = never_fire_trigger

__all__ = [
    "IntervalTrigger",
    "Trigger",
    "TriggerFunc",
    "TriggerLike",
    "_never_fire_trigger",
    "get_trigger",
]
