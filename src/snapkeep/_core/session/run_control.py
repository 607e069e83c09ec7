"""A door's run: its recorded status and, when asked for, its preemption hook.

Every door records the same states in ``.snapkeep/status.json`` (read by ``snapkeep status``):
``running`` at the step of its first load or save, then once ``preempted``, ``failed`` or
``finished``. With preemption on, the door asks :meth:`RunControl.agree` at each save (every
rank at the same step: collective under a process group); a nonzero answer means a rank was
signalled (or torchrun's agent died), the door takes that step's snapshot on every rank,
waits for its commit and calls :meth:`RunControl.preempted`, which records the state and
raises ``SystemExit(143)`` (ppe's and the manager's ``extensions.preemption`` exit code).

With a deadline (``grace_s``, ``$SNAPKEEP_GRACE_S`` or SLURM's end time; see
:mod:`snapkeep._core.session.deadline`), the door first asks :meth:`RunControl.plan` (collective:
the
smallest remaining time and the largest estimate over the ranks, so every rank decides the
same) whether this run's durable write fits; when it does not, the door commits the step to
its memory tier only (or nothing), never starting the durable write, and the process exits
with :data:`EXIT_CODE_PREEMPTED_NOT_DURABLE` (79) instead of 143.

Which thread calls what: the training thread calls everything; :meth:`RunControl.install` and
:meth:`RunControl.close` put signal handlers in place and back only on the main thread (where
Python allows it; elsewhere logged and skipped).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Sequence
from typing import Any

from snapkeep._core.distributed.signals import (
    DEFAULT_SIGNALS,
    EXIT_CODE_PREEMPTED,
    EXIT_CODE_PREEMPTED_NOT_DURABLE,
    SignalWatch,
    describe_signal,
)
from snapkeep._core.session.deadline import Estimate, Grace, Plan, check_grace_s, decide, grace_from
from snapkeep._core.session.run_status import StatusLog, failure_reason
from snapkeep._core.storage import Storage

logger = logging.getLogger(__name__)


def preemption_signals(preemption: bool | Sequence[signal.Signals | int]) -> tuple[int, ...]:
    """The signals a door's ``preemption=`` argument asks for: ``True`` SIGTERM and SIGUSR1,
    ``False`` none, or the given sequence.

    Raises:
        TypeError: ``preemption`` is neither a bool nor a sequence of signals.
        ValueError: a signal is unknown or cannot be caught (SIGKILL, SIGSTOP).
    """
    if preemption is False:
        return ()
    signals = DEFAULT_SIGNALS if preemption is True else preemption
    if not isinstance(signals, Sequence) or isinstance(signals, (str, bytes)):
        raise TypeError(f"preemption must be True, False or a sequence of signals "
                        f"(signal.SIGTERM, ...), got {preemption!r}")
    return tuple(SignalWatch(signals).signals)  # parsed: unknown or uncatchable refused


class RunControl:
    """One run of a door: its status log and, with ``signals``, its preemption watch.

    Args:
        storage: the storage of the output directory.
        directory: the output directory (``.snapkeep/status.json`` in it).
        rank: this rank (only rank 0 writes the status).
        world_size: the number of ranks, recorded.
        signals: the signals that request a preemption (empty: no preemption hook).
        control: snapkeep's control process group (None: one process): the agreement runs on
            it, and under torchrun the agent's death counts as a request.
        timeout_s: bound of the agreement, seconds.
        grace_s: seconds between the first preemption signal and SIGKILL; None: from
            ``$SNAPKEEP_GRACE_S``, else ``$SLURM_JOB_END_TIME``, else no deadline (see
            :func:`~snapkeep._core.session.deadline.grace_from`).

    Raises:
        ValueError: ``grace_s`` or ``$SNAPKEEP_GRACE_S`` is not a number of seconds > 0.
    """

    def __init__(self, storage: Storage, directory: str, *, rank: int = 0, world_size: int = 1,
                 signals: Sequence[signal.Signals | int] = (), control: Any = None,
                 timeout_s: float = 600.0, grace_s: float | None = None) -> None:
        self._grace_s = check_grace_s(grace_s)
        self.grace = grace_from(self._grace_s) if signals else Grace()
        self.status = StatusLog(storage, directory, rank=rank, world_size=world_size)
        self.watch = SignalWatch(signals, control=control, rank=rank,
                                 timeout_s=timeout_s) if signals else None
        self.rank = rank
        self.timeout_s = timeout_s
        self.step = 0  # the step of the last load or save
        self.started = False
        self.preempting = False

    def install(self) -> None:
        """Install the signal handlers (main thread only; no-op without preemption)."""
        if self.watch is not None:
            self.watch.install()

    def arm(self, signals: Sequence[signal.Signals | int], *, control: Any = None,
            timeout_s: float = 600.0) -> None:
        """Install the preemption hook now, for a door that learns its signals' scope later
        than its run starts (Lightning: at ``on_train_start``, once the process group
        exists); no-op without ``signals`` or when armed already."""
        if not signals or self.watch is not None:
            return
        self.grace = grace_from(self._grace_s)
        self.watch = SignalWatch(signals, control=control, rank=self.rank, timeout_s=timeout_s)
        self.preempting = False
        self.watch.install()

    def disarm(self) -> None:
        """Put the previous signal handlers back and drop the hook (idempotent): :meth:`agree`
        answers 0 until the next :meth:`arm`."""
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.uninstall(preempting=self.preempting)

    def at(self, step: int) -> None:
        """Note ``step`` (a load or a save); the first call records ``running`` at it."""
        self.step = step
        if not self.started:
            self.started = True
            self.status.record("running", step)

    def agree(self) -> int:
        """0 when no rank was signalled, else a :func:`~.signals.signalled` value naming a
        signal and a rank that received it; collective under a control group (every rank at
        the same save). Always 0 without preemption.

        Raises:
            CollectiveTimeoutError: a rank died or did not take part in time.
        """
        return self.watch.agree() if self.watch is not None else 0

    def plan(self, estimate: Estimate, *, tier: bool, clock: Any = time.monotonic,
             wall_clock: Any = time.time) -> Plan:
        """Where the preemption snapshot of this step goes (see
        :func:`~snapkeep._core.session.deadline.decide`): collective under a control group (one
        all-reduce of three numbers), so every rank decides the same from the smallest
        remaining time and the largest durable estimate; call it on every rank right after a
        nonzero :meth:`agree`. ``tier``: the door has a memory tier (the same on every rank).

        Raises:
            CollectiveTimeoutError: a rank died or did not take part in time.
        """
        first = self.watch.first_mono_s if self.watch is not None else None
        remaining = self.grace.remaining_s(signalled_mono_s=first, now_mono_s=clock(),
                                           now_unix_s=wall_clock())
        durable = estimate.durable_s
        values = [-remaining if not math.isinf(remaining) else -1e300,
                  durable if durable is not None else -1.0, 1.0 if durable is None else 0.0]
        if self.watch is not None:
            values = self.watch.agree_max(values)
        remaining = math.inf if values[0] <= -1e299 else -values[0]
        agreed = None if values[2] > 0 else values[1]
        where = decide(remaining, agreed, tier=tier)
        plan = Plan(where=where, remaining_s=remaining, durable_s=agreed,
                    source=self.grace.source, estimate=estimate)
        if where != "storage":
            logger.warning(
                "rank %d: preemption: %.1f s left before SIGKILL (deadline from %s), this "
                "run's durable write takes about %s: %s", self.rank, remaining,
                self.grace.source, "an unknown time (none measured yet)" if agreed is None
                else f"{agreed:.1f} s", "committing the step to the memory tier only; the "
                "durable write is skipped" if where == "ram" else "no memory tier: nothing "
                "new is committed (the newest committed snapshot stays the resume point)")
        return plan

    def preempted(self, step: int, name: str, agreed: int, plan: Plan | None = None) -> None:
        """Record ``preempted`` at ``step`` (snapshot ``name`` committed on every rank: the
        door waited; in RAM only or nowhere when ``plan`` says so) naming the signal and rank
        of ``agreed``, with ``plan``'s record."""
        self.preempting = True
        received = self.watch.received if self.watch is not None else []
        self.status.record("preempted", step, snapshots=(name,) if name else (),
                           reason=describe_signal(agreed, received),
                           preemption=plan.as_dict() if plan is not None else None)

    def exit_preempted(self, step: int, plan: Plan | None = None) -> None:
        """Say where the preemption snapshot of ``step`` is committed and raise
        ``SystemExit(143)`` (in storage), or ``SystemExit(79)`` (``plan`` put it in RAM
        only, or nowhere)."""
        if plan is None or plan.where == "storage":
            logger.warning("rank %d: preemption snapshot of step %d committed; exiting with %d "
                           "(run the same command again to resume from it)", self.rank, step,
                           EXIT_CODE_PREEMPTED)
            raise SystemExit(EXIT_CODE_PREEMPTED)
        logger.warning("rank %d: preemption: step %d %s; exiting with %d (run the same "
                       "command again: it resumes from %s)", self.rank, step,
                       "committed to the memory tier only (not to storage)"
                       if plan.where == "ram" else "not committed (no time, no memory tier)",
                       EXIT_CODE_PREEMPTED_NOT_DURABLE,
                       "RAM on these nodes, else storage's newest snapshot"
                       if plan.where == "ram" else "storage's newest snapshot")
        raise SystemExit(EXIT_CODE_PREEMPTED_NOT_DURABLE)

    def finished(self) -> None:
        """Record ``finished`` at the last step (only once the run started)."""
        if self.started:
            self.status.record("finished", self.step)

    def failed(self, error: BaseException | str) -> None:
        """Record ``failed`` at the last step, with the error's first line (each failing rank's
        for a ``RankFailedError``; only once the run started)."""
        if self.started:
            self.status.record("failed", self.step, reason=failure_reason(error))

    def close(self) -> None:
        """Put the previous signal handlers back (idempotent)."""
        self.disarm()


__all__ = ["EXIT_CODE_PREEMPTED", "EXIT_CODE_PREEMPTED_NOT_DURABLE", "RunControl",
           "preemption_signals"]
