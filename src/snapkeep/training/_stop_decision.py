"""A manager's stop triggers decide once per iteration, and a snapshot carries that decision.

A stop trigger is called after each iteration's extensions: by the manager at the end of
``run_iteration`` (its internal copy) and by the loop's ``while not manager.stop_trigger``.
A stateful trigger (``EarlyStoppingTrigger``, ``MinValueTrigger``: a running mean of an
observation, a best value, a patience count) changes its state in that call. A snapshot taken
by an extension at iteration N ran *before* that call, so it held the trigger's state without
iteration N's observation; the resumed run, whose observation at N is empty, never made it:
an ``EarlyStoppingTrigger`` checked per epoch and killed after an epoch-end snapshot stopped at
iteration 21 instead of 18.

So the snapshot extension wraps both stop triggers of its manager in :class:`StopDecision`:
the wrapped trigger is called at most once per iteration, and a snapshot first makes that call
(with the observation of iteration N as the snapshot sees it) and saves the trigger's state
after it together with ``(N, decision)``. The manager's own later calls at iteration N return
that decision (in the uninterrupted run and in the resumed one, whose restored wrapper holds
it), so both runs make the same decisions at the same iterations. Both managers (snapkeep's
and ppe's) evaluate every extension trigger and run every other extension of the iteration
before the snapshot extensions, so the observation the snapshot's call sees is the iteration's
whole observation, as the uninterrupted run's later call saw it.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["StopDecision", "wrap_stop_triggers"]

logger = logging.getLogger(__name__)

#: The manager attributes holding stop triggers (snapkeep's and ppe's managers).
TRIGGER_ATTRIBUTES = ("_stop_trigger", "_internal_stop_trigger")


class StopDecision:
    """A stop trigger called at most once per iteration; other attributes are the trigger's.

    Training thread only. ``decided`` is ``(iteration, decision)`` of the last call.
    """

    def __init__(self, trigger: Any) -> None:
        self.trigger = trigger
        self.decided: tuple[int, bool] | None = None

    def _stateful(self) -> Any:
        """The object holding the trigger's state: ppe's manager wraps a trigger that is not
        one of ppe's (snapkeep's ``EarlyStoppingTrigger``) in its ``_CallableTrigger``, whose
        own ``state_dict`` is empty; the wrapped one's state is what must travel."""
        inner = self.trigger
        func = getattr(inner, "func", None)
        if type(inner).__name__ == "_CallableTrigger" and callable(getattr(func, "state_dict",
                                                                            None)):
            return func
        return inner

    def state_dict(self) -> Any:
        """The trigger's state (``{}`` when it keeps none)."""
        to_state = getattr(self._stateful(), "state_dict", None)
        return to_state() if callable(to_state) else {}

    def load_state_dict(self, state: Any) -> None:
        """Load what :meth:`state_dict` returned (a trigger without state ignores it)."""
        load = getattr(self._stateful(), "load_state_dict", None)
        if callable(load):
            load(state)

    def __call__(self, manager: Any) -> bool:
        iteration = int(manager.iteration)
        if self.decided is not None and self.decided[0] == iteration:
            return self.decided[1]
        decision = bool(self.trigger(manager))
        self.decided = (iteration, decision)
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["trigger"], name)

    def __deepcopy__(self, memo: dict[int, Any]) -> StopDecision:
        import copy

        copied = StopDecision(copy.deepcopy(self.trigger, memo))
        copied.decided = self.decided
        return copied


def _owner(manager: Any) -> Any:
    """The object whose attributes hold the triggers (ppe hands extensions a proxy whose
    ``_stop_trigger`` is a read-only property over the manager it wraps)."""
    inner = getattr(manager, "_manager", None)
    return inner if inner is not None and hasattr(inner, "_stop_trigger") else manager


def wrap_stop_triggers(manager: Any) -> dict[str, StopDecision]:
    """Wrap each stop trigger of ``manager`` (once; a second call returns the same wrappers)
    and return them by attribute name."""
    owner = _owner(manager)
    wrapped: dict[str, StopDecision] = {}
    for attribute in TRIGGER_ATTRIBUTES:
        trigger = getattr(owner, attribute, None)
        if trigger is None:
            continue
        if not isinstance(trigger, StopDecision):
            trigger = StopDecision(trigger)
            try:
                setattr(owner, attribute, trigger)
            except AttributeError:
                logger.warning("the manager's %s cannot be replaced; a resume may decide to stop "
                               "one check later than the uninterrupted run", attribute)
                continue
        wrapped[attribute] = trigger
    return wrapped
