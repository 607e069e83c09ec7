"""Fixed-interval trigger (as ppe's ``IntervalTrigger``)."""

from __future__ import annotations

from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import Trigger, UnitLiteral, check_period, check_unit

__all__ = ["IntervalTrigger"]


class IntervalTrigger(Trigger):
    """Fires every ``period`` iterations or epochs.

    With ``unit='epoch'`` the period may be fractional: the trigger fires at the first iteration
    at or after each multiple of ``period * iters_per_epoch`` (ppe's rule, so a run fires at the
    same iterations under snapkeep and ppe). It never fires at iteration 0. Stateless: its
    ``state_dict()`` is ``{}`` as in ppe, so resuming needs nothing from it.

    Args:
        period: Interval length, > 0; a whole number when ``unit`` is ``'iteration'``.
        unit: ``'iteration'`` or ``'epoch'``.

    Raises:
        ValueError: ``unit`` is not ``'iteration'``/``'epoch'``, or ``period`` is not positive
            (or fractional with ``unit='iteration'``).
        TypeError: ``period`` is not a number.
    """

    def __init__(self, period: float, unit: UnitLiteral) -> None:
        self.unit = check_unit(unit)
        self.period = check_period(period, self.unit)

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        """Whether ``manager.iteration`` ends an interval."""
        return self.may_fire(manager.iteration, manager._iters_per_epoch)

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        if iteration == 0:
            return False
        interval = self.period * epoch_len if self.unit == "epoch" else self.period
        return iteration % interval < 1

    def get_training_length(self) -> tuple[float, str]:
        """Returns ``(period, unit)``."""
        return (self.period, self.unit)

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.period}, '{self.unit}')"
