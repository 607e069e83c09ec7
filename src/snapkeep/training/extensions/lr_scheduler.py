"""``LRScheduler``: steps a ``torch.optim.lr_scheduler`` scheduler from the manager (as ppe's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from snapkeep.training import extension
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import TriggerLike, get_trigger

__all__ = ["LRScheduler"]

Stepper = Callable[[ExtensionsManagerProtocol, Any], None]


def _observed(manager: ExtensionsManagerProtocol, key: str | None) -> Any:
    if key is None:
        return None
    if key not in manager.observation:
        raise ValueError(
            f"LRScheduler steps by the value {key!r}, which is not in the observation of "
            f"iteration {manager.iteration} (reported: {sorted(manager.observation)}); report "
            "it in this iteration (e.g. with an Evaluator on the same trigger) or pass stepper="
        )
    return manager.observation[key]


def _default_stepper(manager: ExtensionsManagerProtocol, scheduler: Any) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        LRScheduler.step_by_value("val/loss")(manager, scheduler)
    else:
        scheduler.step()


def _optimizer_stepped(scheduler: Any) -> bool:
    """Whether ``scheduler.optimizer.step()`` has run (the flags torch's schedulers set)."""
    optimizer = getattr(scheduler, "optimizer", None)
    if optimizer is None:
        return True
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and hasattr(
        optimizer.step, "_wrapped_by_lr_sched"
    ):  # torch >= 2.4 marks the optimizer on its first step
        return bool(getattr(optimizer, "_opt_called", False))
    if hasattr(optimizer.step, "_with_counter"):  # older torch counts the steps
        return int(getattr(optimizer, "_step_count", 0)) >= 1
    return True


class LRScheduler(extension.Extension):
    """Calls ``stepper(manager, scheduler)`` (default: ``scheduler.step()``) when triggered.

    As ppe's ``LRScheduler``: a ``ReduceLROnPlateau`` scheduler is stepped with the value of
    ``'val/loss'`` in the current observation by the default stepper. The scheduler's state is
    saved in the extension's ``state_dict`` (``{'scheduler': ...}``, ppe's layout), so a resumed
    run continues the schedule.

    Args:
        scheduler: A ``torch.optim.lr_scheduler`` scheduler (or any object with ``step``,
            ``state_dict`` and ``load_state_dict``).
        stepper: ``fn(manager, scheduler)`` that steps it; see :meth:`step_by_value`.
        trigger: When to step; default once per epoch.
        wait_for_first_optimizer_step: Skip stepping until the optimizer has stepped once (a
            ``GradScaler`` may skip the first steps; torch warns when a scheduler steps first).
        is_async: Kept for ppe compatibility (ppe's default True); snapkeep's manager runs
            every extension synchronously.

    Raises:
        TypeError: ``stepper`` is not callable.
    """

    def __init__(
        self,
        scheduler: Any,
        *,
        stepper: Stepper = _default_stepper,
        trigger: TriggerLike = (1, "epoch"),
        wait_for_first_optimizer_step: bool = False,
        is_async: bool = True,
    ) -> None:
        if not callable(stepper):
            raise TypeError(f"stepper must be callable as fn(manager, scheduler), got {stepper!r}")
        self.scheduler = scheduler
        self.stepper = stepper
        self.trigger = get_trigger(trigger)
        self.wait_for_first_optimizer_step = wait_for_first_optimizer_step
        self.is_async = is_async

    def __call__(self, manager: ExtensionsManagerProtocol) -> None:
        if self.wait_for_first_optimizer_step and not _optimizer_stepped(self.scheduler):
            return
        self.stepper(manager, self.scheduler)

    @staticmethod
    def step_by_value(key: str | None) -> Stepper:
        """A stepper calling ``scheduler.step(manager.observation[key])`` (``step(None)`` for a
        ``None`` key).

        The stepper raises ``ValueError`` naming the key when it is not in the observation.
        """

        def _stepper(manager: ExtensionsManagerProtocol, scheduler: Any) -> None:
            scheduler.step(_observed(manager, key))

        return _stepper

    def state_dict(self) -> dict[str, Any]:
        """``{'scheduler': scheduler.state_dict()}``."""
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the scheduler from :meth:`state_dict`'s output."""
        self.scheduler.load_state_dict(state["scheduler"])
