"""Wall-clock interval trigger (as ppe's ``TimeTrigger``)."""

from __future__ import annotations

from typing import Any

from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import Trigger

__all__ = ["TimeTrigger"]


class TimeTrigger(Trigger):
    """Fires at most once per ``period_s`` seconds of ``manager.elapsed_time``.

    The n-th firing happens at the first call after ``n * period`` seconds; the schedule does
    not drift with late calls (as ppe).

    Args:
        period: Interval in seconds, > 0.

    Raises:
        ValueError: ``period`` is not positive.
    """

    def __init__(self, period: float) -> None:
        if not period > 0:
            raise ValueError(f"period must be > 0 seconds, got {period!r}")
        self._period = float(period)
        self._next_time = self._period

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        if manager.elapsed_time > self._next_time:
            self._next_time += self._period
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{'next_time': seconds}`` (ppe's layout)."""
        return {"next_time": self._next_time}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_time = float(state["next_time"])
