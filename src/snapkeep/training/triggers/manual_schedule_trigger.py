"""Trigger at listed points (as ppe's ``ManualScheduleTrigger``)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import Trigger, UnitLiteral, check_unit

__all__ = ["ManualScheduleTrigger"]


class ManualScheduleTrigger(Trigger):
    """Fires at each of the given iterations or epochs.

    With ``unit='epoch'`` a point ``p`` fires at iteration ``int(p * iters_per_epoch)`` (ppe's
    rule), so fractional epochs are allowed. Stateless (``state_dict()`` is ``{}``).

    Args:
        points: One point or a list of points, each >= 0.
        unit: ``'iteration'`` or ``'epoch'``.

    Raises:
        ValueError: Bad ``unit`` or a negative point.
        TypeError: A point is not a number.
    """

    def __init__(self, points: float | Sequence[float], unit: UnitLiteral) -> None:
        self.unit = check_unit(unit)
        listed: list[float] = list(points) if isinstance(points, Sequence) else [points]
        for point in listed:
            if isinstance(point, bool) or not isinstance(point, numbers.Real):
                raise TypeError(f"points must be numbers, got {point!r}")
            if point < 0:
                raise ValueError(f"points must be >= 0, got {point!r}")
        self.points = listed

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        """Whether ``manager.iteration`` is one of the scheduled points."""
        return self.may_fire(manager.iteration, manager._iters_per_epoch)

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        if self.unit == "epoch":
            return any(int(point * epoch_len) == iteration for point in self.points)
        return any(point == iteration for point in self.points)
