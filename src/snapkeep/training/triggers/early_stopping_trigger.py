"""Early stopping (as ppe's ``EarlyStoppingTrigger``, plus saved state)."""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Callable
from typing import Any

import snapkeep.reporting as reporting
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import Trigger, TriggerLike, UnitLiteral, get_trigger
from snapkeep.training.triggers.interval_trigger import IntervalTrigger

__all__ = ["EarlyStoppingTrigger"]

logger = logging.getLogger(__name__)


class EarlyStoppingTrigger(Trigger):
    """Fires when a monitored value stops improving, or when ``max_trigger`` fires.

    Every call adds ``manager.observation[monitor]`` (when present) to a running mean. When
    ``check_trigger`` fires, the mean is compared with the best mean so far: an improvement resets
    the patience counter, anything else increments it, and the trigger fires once the counter
    reaches ``patience``. Typically passed as the manager's ``stop_trigger``.

    Unlike ppe (which keeps them only in memory), the counter, best value, running mean and the
    inner triggers' state are returned by :meth:`state_dict`; a state dict from ppe (``{}``)
    loads as a fresh trigger.

    Args:
        check_trigger: Comparison interval; anything ``get_trigger`` accepts.
        monitor: Observation key, e.g. ``'main/loss'``.
        patience: Number of consecutive checks without improvement before firing.
        mode: ``'min'``, ``'max'`` or ``'auto'`` (``'max'`` if ``'accuracy'`` is in ``monitor``,
            else ``'min'``).
        verbose: Log the decisions at INFO instead of DEBUG.
        max_trigger: ``(period, unit)`` upper bound of the training length.

    Raises:
        ValueError: Bad ``mode``, negative ``patience``, or a bad ``max_trigger``.
    """

    def __init__(
        self,
        check_trigger: TriggerLike = (1, "epoch"),
        monitor: str = "main/loss",
        patience: int = 3,
        mode: str = "auto",
        verbose: bool = False,
        max_trigger: tuple[float, UnitLiteral] = (100, "epoch"),
    ) -> None:
        if mode not in ("min", "max", "auto"):
            raise ValueError(f"mode must be 'min', 'max' or 'auto', got {mode!r}")
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience!r}")
        self.monitor = monitor
        self.patience = patience
        self.verbose = verbose
        self.count = 0
        self._max_trigger = IntervalTrigger(*max_trigger)
        self._interval_trigger = get_trigger(check_trigger)
        self._summary = reporting.DictSummary()
        maximize = mode == "max" or (mode == "auto" and "accuracy" in monitor)
        self._compare: Callable[[float, float], bool] = operator.gt if maximize else operator.lt
        self.best = float("-inf") if maximize else float("inf")
        self._log("early stopping monitors %r (%s)", monitor, "max" if maximize else "min")

    def _log(self, msg: str, *args: Any) -> None:
        logger.log(logging.INFO if self.verbose else logging.DEBUG, msg, *args)

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        """Whether training should stop after the manager's current iteration."""
        observation = manager.observation
        if self.monitor in observation:
            self._summary.add({self.monitor: observation[self.monitor]})

        if self._max_trigger(manager):
            return True
        if not self._interval_trigger(manager):
            return False
        if self.monitor not in observation:
            warnings.warn(f"{self.monitor} is not in observation", UserWarning, stacklevel=2)
            return False

        current = float(self._summary.compute_mean()[self.monitor])
        self._summary = reporting.DictSummary()
        if self._compare(current, self.best):
            self.best = current
            self.count = 0
        else:
            self.count += 1
        if self._stop_condition():
            self._log(
                "early stopping at iteration %d: %s did not improve on %s for %d checks",
                manager.iteration, self.monitor, self.best, self.count,
            )
            return True
        return False

    def _stop_condition(self) -> bool:
        return self.count >= self.patience

    def get_training_length(self) -> tuple[float, str]:
        """Returns ``max_trigger`` as ``(period, unit)``."""
        return self._max_trigger.get_training_length()

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        return self._interval_trigger.may_fire(iteration, epoch_len)

    def state_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "best": self.best,
            "_summary": self._summary.state_dict(),
            "interval_trigger": self._interval_trigger.state_dict(),
            "max_trigger": self._max_trigger.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # saved by ppe, whose trigger keeps no state
            return
        self.count = int(state["count"])
        self.best = float(state["best"])
        self._summary.load_state_dict(state["_summary"])
        self._interval_trigger.load_state_dict(state["interval_trigger"])
        self._max_trigger.load_state_dict(state["max_trigger"])
