"""Trigger that fires once (as ppe's ``OnceTrigger``)."""

from __future__ import annotations

from typing import Any

from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import Trigger

__all__ = ["OnceTrigger"]


class OnceTrigger(Trigger):
    """Fires the first time it is called, and optionally once more after a resume.

    Args:
        call_on_resume: Also fire on the first call after ``load_state_dict`` (i.e. after the
            training was restored from a snapshot).

    Attributes:
        finished: ``True`` when the trigger will not fire again; the manager then skips the
            extension's ``initialize`` (as ppe).
    """

    def __init__(self, call_on_resume: bool = False) -> None:
        self._flag_first = True
        self._flag_resumed = call_on_resume

    @property
    def finished(self) -> bool:
        return not (self._flag_first or self._flag_resumed)

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        fire = not self.finished
        self._flag_first = False
        self._flag_resumed = False
        return fire

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        return not self.finished

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{'_flag_first': bool}`` (ppe's layout)."""
        return {"_flag_first": self._flag_first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._flag_first = bool(state["_flag_first"])
