"""Triggers: when extensions run and when training stops (as ``ppe.training.triggers``)."""

from snapkeep.training._trigger_util import Trigger, TriggerLike, get_trigger
from snapkeep.training.triggers.auto_trigger import AutoTrigger
from snapkeep.training.triggers.early_stopping_trigger import EarlyStoppingTrigger
from snapkeep.training.triggers.function_trigger import FunctionTrigger
from snapkeep.training.triggers.interval_trigger import IntervalTrigger
from snapkeep.training.triggers.manual_schedule_trigger import ManualScheduleTrigger
from snapkeep.training.triggers.minmax_value_trigger import (
    BestValueTrigger,
    MaxValueTrigger,
    MinValueTrigger,
)
from snapkeep.training.triggers.once_trigger import OnceTrigger
from snapkeep.training.triggers.time_trigger import TimeTrigger

__all__ = [
    "AutoTrigger",
    "BestValueTrigger",
    "EarlyStoppingTrigger",
    "FunctionTrigger",
    "IntervalTrigger",
    "ManualScheduleTrigger",
    "MaxValueTrigger",
    "MinValueTrigger",
    "OnceTrigger",
    "TimeTrigger",
    "Trigger",
    "TriggerLike",
    "get_trigger",
]
