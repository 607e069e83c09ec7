"""Triggers that fire when a reported value improves (as ppe's ``minmax_value_trigger``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import snapkeep.reporting as reporting
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import Trigger, TriggerLike, get_trigger

__all__ = ["BestValueTrigger", "MaxValueTrigger", "MinValueTrigger"]


class BestValueTrigger(Trigger):
    """Fires when the mean of an observed value over a check interval is the best so far.

    Every call adds ``manager.observation[key]`` (when present) to a running mean. When the check
    trigger fires, the mean is compared with the best mean seen so far by ``compare(best, new)``;
    the trigger fires if ``new`` is better (always on the first check), and the mean restarts.

    State (``'interval_trigger'``, ``'_summary'``, ``'_best_value'``: ppe's layout) is saved in
    the manager's ``state_dict``, so a resumed run keeps its best value.

    Args:
        key: Observation key, e.g. ``'val/loss'``.
        compare: ``compare(best_value, new_value)`` returns ``True`` when ``new_value`` is better.
        trigger: Check interval; anything ``get_trigger`` accepts (default one epoch).

    Raises:
        KeyError: (from ``__call__``) at a check, ``key`` was never observed in the interval.
    """

    def __init__(
        self,
        key: str,
        compare: Callable[[float, float], bool],
        trigger: TriggerLike = (1, "epoch"),
    ) -> None:
        self._key = key
        self._compare = compare
        self._best_value: float | None = None
        self._interval_trigger = get_trigger(trigger)
        self._summary = reporting.DictSummary()

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        observation = manager.observation
        if self._key in observation:
            self._summary.add({self._key: observation[self._key]})
        if not self._interval_trigger(manager):
            return False

        means = self._summary.compute_mean()
        if self._key not in means:
            raise KeyError(
                f"key {self._key!r} was not reported during the check interval "
                f"(reported keys: {sorted(means)})"
            )
        value = float(means[self._key])  # copies a device tensor to the host
        self._summary = reporting.DictSummary()
        if self._best_value is None or self._compare(self._best_value, value):
            self._best_value = value
            return True
        return False

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        return self._interval_trigger.may_fire(iteration, epoch_len)

    def state_dict(self) -> dict[str, Any]:
        return {
            "interval_trigger": self._interval_trigger.state_dict(),
            "_summary": self._summary.state_dict(),
            "_best_value": self._best_value,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._interval_trigger.load_state_dict(state["interval_trigger"])
        self._summary.load_state_dict(state["_summary"])
        best = state["_best_value"]
        self._best_value = None if best is None else float(best)


class MaxValueTrigger(BestValueTrigger):
    """Fires when the mean of ``key`` over the check interval is the highest so far.

    Args:
        key: Observation key, e.g. ``'val/accuracy'``.
        trigger: Check interval (default one epoch).
    """

    def __init__(self, key: str, trigger: TriggerLike = (1, "epoch")) -> None:
        super().__init__(key, lambda best, new: new > best, trigger)


class MinValueTrigger(BestValueTrigger):
    """Fires when the mean of ``key`` over the check interval is the lowest so far.

    Args:
        key: Observation key, e.g. ``'val/loss'``.
        trigger: Check interval (default one epoch).
    """

    def __init__(self, key: str, trigger: TriggerLike = (1, "epoch")) -> None:
        super().__init__(key, lambda best, new: new < best, trigger)
