"""A snapshot trigger whose interval is chosen from measurements (snapkeep addition).

``manager.extend(extensions.snapshot(), trigger=triggers.AutoTrigger())`` (or
``trigger="auto"``): the snapshot extension fires when the interval chosen by
:class:`snapkeep.session.Cadence` (Young's rule with Daly's correction, ``T = sqrt(2 C M)``; see
:mod:`snapkeep._core.session.cadence`) has passed since the newest snapshot. The trigger times
each iteration (it is called once per iteration, after the update, as every ppe trigger); the
snapshot extension tells it each snapshot it took (:func:`note_snapshot`: the call's duration
and its commit future, for the time to durable) and its directory, where the run is recorded
for ``snapkeep status`` (``.snapkeep/goodput.json``: the restarts, the failures, the replay)
and read back for the failure rate.
"""

from __future__ import annotations

import weakref
from typing import Any

from snapkeep.distributed import is_distributed
from snapkeep.session import AutoInterval, Cadence, Choice, RunHistory
from snapkeep.store import Storage
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol
from snapkeep.training._trigger_util import Trigger

__all__ = ["AutoTrigger", "note_end", "note_snapshot"]


_triggers: weakref.WeakKeyDictionary[Any, AutoTrigger] = weakref.WeakKeyDictionary()


def note_snapshot(manager: Any, *, step: int, stall_s: float, committed: Any = None,
                  storage: Storage | None = None, directory: str = "") -> None:
    """The snapshot extension took a snapshot of ``manager`` at ``step`` (its call took
    ``stall_s`` seconds; ``committed``: its commit future, None for a synchronous writer;
    ``storage`` and ``directory``: where the run is recorded): told to the manager's
    :class:`AutoTrigger`, if it has one (training thread)."""
    trigger = _triggers.get(manager)
    if trigger is not None:
        trigger.snapshot_taken(step, stall_s=stall_s, committed=committed, storage=storage,
                               directory=directory)


def note_end(manager: Any, how: str) -> None:
    """The snapshot extension of ``manager`` saw the run end ``how`` (``'finished'``: its
    finalize; ``'failed'``: its on_error): recorded by the manager's :class:`AutoTrigger`."""
    trigger = _triggers.get(manager)
    if trigger is not None:
        trigger.ended(how)


class AutoTrigger(Trigger):
    """Fires the snapshot extension when the measured interval has passed (see the module
    docstring). For ``extensions.snapshot`` only: with another extension it never learns a
    save's cost and fires once, after the warm-up.

    Args:
        mtbf_s: the prior mean time between failures, seconds (> 0; default one day); the
            directory's history of failures refines it.
        settings: a full :class:`snapkeep.AutoInterval` instead (``min_steps``,
            ``max_steps``, ``warmup_steps``); not with ``mtbf_s``.

    Raises:
        TypeError, ValueError: a bad ``mtbf_s`` (named, with what is accepted), or both given.
        RuntimeError: at its first call under torch.distributed (one process only for now:
            each rank would decide from its own clock).
    """

    def __init__(self, mtbf_s: float | None = None, *,
                 settings: AutoInterval | None = None) -> None:
        if settings is not None and mtbf_s is not None:
            raise TypeError("give mtbf_s or settings=AutoInterval(mtbf_s=...), not both")
        if settings is not None and not isinstance(settings, AutoInterval):
            raise TypeError(f"settings must be a snapkeep.AutoInterval, got {settings!r}")
        self.settings = settings if settings is not None else (
            AutoInterval() if mtbf_s is None else AutoInterval(mtbf_s=mtbf_s))
        self.cadence = Cadence(self.settings)
        self.history: RunHistory | None = None
        self._first: int | None = None  # the first iteration this trigger saw
        self._ended: str | None = None

    @property
    def choice(self) -> Choice | None:
        """The current choice (see :class:`snapkeep.session.Choice`); None before the first
        snapshot was timed."""
        return self.cadence.choice

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        return True  # measured: not predictable

    def __call__(self, manager: ExtensionsManagerProtocol) -> bool:
        step = int(manager.iteration)
        if self._first is None:
            if is_distributed():
                raise RuntimeError(
                    "AutoTrigger (trigger='auto') chooses from this process's own clock: under "
                    "torch.distributed the ranks could decide differently; use a fixed "
                    "trigger=(N, 'iteration') there")
            self._first = step
            if step > 1:  # resumed (autoload restored the iteration): count from there
                self.cadence.resumed(step - 1)
        _triggers[manager] = self
        due = self.cadence.due(step)
        if self.history is not None:
            choice = self.cadence.choice
            self.history.step(step, step_s=self.cadence.step_s(),
                              interval_steps=choice.interval_steps if choice else None)
        return due

    def ended(self, how: str) -> None:
        """Record how the run ended (the first of ``'failed'`` / ``'finished'`` told)."""
        if self.history is not None and self._ended is None:
            self._ended = how
            self.history.ended(how)

    def snapshot_taken(self, step: int, *, stall_s: float, committed: Any,
                       storage: Storage | None, directory: str) -> None:
        """See :func:`note_snapshot`."""
        self.cadence.saved(step, stall_s=stall_s, committed=committed)
        if self.history is None and storage is not None:
            self.history = RunHistory(storage, directory)
            self.cadence.history = self.history
            first = self._first or 1
            if first > 1:
                self.history.resumed(first - 1)
        if self.history is not None:
            self.history.step(step, save_s=stall_s, saved=True)

    def __str__(self) -> str:
        return f"AutoTrigger(mtbf_s={self.settings.mtbf_s:g})"
