"""Trigger base class and :func:`get_trigger` (as ppe's ``training/_trigger_util.py``).

A trigger is called with the manager after every iteration and answers whether something (an
extension, the end of training) happens now. Triggers may keep state; that state is saved in the
manager's ``state_dict`` under its extension entry, so it must consist of plain Python values or
tensors (``torch.load(weights_only=True)`` must accept it).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, Union

from snapkeep.training._manager_protocol import ExtensionsManagerProtocol

__all__ = [
    "Trigger",
    "TriggerFunc",
    "TriggerLike",
    "UnitLiteral",
    "get_trigger",
]

UNITS = ("iteration", "epoch")

UnitLiteral = str
"""``'iteration'`` or ``'epoch'``."""

TriggerFunc = Callable[[ExtensionsManagerProtocol], bool]
TriggerLike = Union["Trigger", TriggerFunc, tuple[float, UnitLiteral], str, None]
"""Anything :func:`get_trigger` accepts."""


class Trigger:
    """Base class of triggers (as ppe's ``Trigger``).

    Subclasses implement :meth:`__call__`; stateful ones also :meth:`state_dict` /
    :meth:`load_state_dict`, and those whose firing is predictable override :meth:`may_fire`.
    """

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        """Whether the trigger could fire at ``iteration`` (without changing its state).

        The manager uses it to decide whether extensions that need the model state
        (``needs_model_state``) may run at ``iteration``. The default answers ``True``.

        Args:
            iteration: Iteration count after the update, starting at 1.
            epoch_len: Iterations per epoch.
        """
        return True

    def state_dict(self) -> dict[str, Any]:
        """Returns the trigger state (empty for stateless triggers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores state saved by :meth:`state_dict`."""

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        """Decides whether to fire for the manager's current iteration."""
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")


class _CallableTrigger(Trigger):
    """Adapts a plain ``fn(manager) -> bool`` to :class:`Trigger` (stateless)."""

    def __init__(self, func: TriggerFunc) -> None:
        self.func = func

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        return bool(self.func(manager))


def never_fire_trigger(manager: ExtensionsManagerProtocol) -> bool:
    return False


def check_unit(unit: object, argument: str = "unit") -> str:
    """Returns ``unit`` if it is ``'iteration'`` or ``'epoch'``.

    Raises:
        ValueError: Any other value; the message names ``argument``.
    """
    if unit not in UNITS:
        raise ValueError(f"{argument} must be 'iteration' or 'epoch', got {unit!r}")
    return str(unit)


def check_period(period: object, unit: str, argument: str = "period") -> float:
    """Returns ``period`` if it is a positive number (an integer when ``unit`` is iterations).

    Raises:
        TypeError: ``period`` is not a number.
        ValueError: ``period`` is not positive, or is fractional with ``unit='iteration'``.
    """
    if isinstance(period, bool) or not isinstance(period, numbers.Real):
        raise TypeError(f"{argument} must be a number, got {period!r}")
    value = float(period)
    if not value > 0:
        raise ValueError(f"{argument} must be > 0, got {period!r}")
    if unit == "iteration" and not value.is_integer():
        raise ValueError(
            f"{argument} must be a whole number of iterations when unit is 'iteration', "
            f"got {period!r}"
        )
    return period  # type: ignore[return-value]  # keeps int periods int (str() as ppe)


def get_trigger(trigger: TriggerLike) -> Trigger:
    """Builds a :class:`Trigger` from anything accepted where a trigger is expected.

    As ppe's ``get_trigger``:

    * a :class:`Trigger` is returned as is;
    * a callable ``fn(manager) -> bool`` is wrapped;
    * ``None`` gives a trigger that never fires;
    * a ``(period, unit)`` tuple gives ``IntervalTrigger(period, unit)`` with ``unit`` one of
      ``'iteration'`` or ``'epoch'``;
    * ``'auto'`` gives an :class:`~snapkeep.training.triggers.AutoTrigger` (snapkeep addition:
      the snapshot interval chosen from measurements).

    Raises:
        TypeError: ``trigger`` is none of the above.
        ValueError: The tuple has a bad unit or a non-positive period.
    """
    from snapkeep.training.triggers.interval_trigger import IntervalTrigger

    if isinstance(trigger, Trigger):
        return trigger
    if isinstance(trigger, str):
        if trigger != "auto":
            raise ValueError(f"trigger must be 'auto' when a string (the snapshot interval "
                             f"chosen from measurements), a Trigger, a callable, None or a "
                             f"(period, unit) tuple, got {trigger!r}")
        from snapkeep.training.triggers.auto_trigger import AutoTrigger

        return AutoTrigger()
    if callable(trigger):
        return _CallableTrigger(trigger)
    if trigger is None:
        return _CallableTrigger(never_fire_trigger)
    if isinstance(trigger, (tuple, list)) and len(trigger) == 2:
        period, unit = trigger
        return IntervalTrigger(period, unit)
    raise TypeError(
        "trigger must be a Trigger, a callable taking the manager, None, a "
        f"(period, 'iteration' | 'epoch') tuple or 'auto', got {trigger!r}"
    )
