"""Trigger that asks a function (as ppe's ``FunctionTrigger``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import Trigger, TriggerLike, get_trigger

__all__ = ["FunctionTrigger"]


class FunctionTrigger(Trigger):
    """Fires when ``trigger`` fires and ``fn(*args, **kwargs)`` returns true.

    Args:
        fn: Called without the manager, only on iterations where ``trigger`` fires.
        args: Positional arguments for ``fn``.
        kwargs: Keyword arguments for ``fn``.
        trigger: Anything :func:`~snapkeep.training.triggers.get_trigger` accepts; default every
            iteration.
    """

    def __init__(
        self,
        fn: Callable[..., bool],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        trigger: TriggerLike = (1, "iteration"),
    ) -> None:
        self._fn = fn
        self._args = list(args or [])
        self._kwargs = dict(kwargs or {})
        self._interval_trigger = get_trigger(trigger)

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        if not self._interval_trigger(manager):
            return False
        return bool(self._fn(*self._args, **self._kwargs))

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        if not self._interval_trigger.may_fire(iteration, epoch_len):
            return False
        return bool(self._fn(*self._args, **self._kwargs))

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{'interval_trigger': ...}`` (ppe's layout)."""
        return {"interval_trigger": self._interval_trigger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._interval_trigger.load_state_dict(state["interval_trigger"])
