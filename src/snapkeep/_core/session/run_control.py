"""A door's run: the one run control of every door (the plain-loop Checkpointer, ppe's
``extensions.preemption``, Lightning's ``ModelCheckpoint`` and the Hugging Face callback), got
through the door's session (:meth:`snapkeep._core.session.session.Session.run_control`).

It holds, in one shape:

- **the run status** in ``.snapkeep/status.json`` (read by ``snapkeep status``): ``running`` at
  the step of the first load or save (:meth:`RunControl.at`), then once ``preempted``,
  ``failed`` or ``finished``;
- **the signal flags**: the handlers (installed on the main thread only) only record the
  signal (:class:`~snapkeep._core.distributed.signals.SignalWatch`); nothing else of
  snapkeep's installs a signal handler;
- **the agreement at the next step** (:meth:`RunControl.agree`, every rank at the same step:
  one all-reduce of one int on snapkeep's control group): a nonzero answer means a rank was
  signalled (or torchrun's agent died); a rank whose step raised reports it there
  (:meth:`RunControl.tell_failure`) and every other rank raises ``RankFailedError`` naming it;
- **the deadline decision** (:meth:`RunControl.plan`; the grace from ``grace_s``,
  ``$SNAPKEEP_GRACE_S`` or SLURM's end time, see :mod:`snapkeep._core.session.deadline`): one
  all-reduce of three numbers, so every rank decides the same from the smallest remaining time
  and the largest estimate of this run's durable write (:attr:`RunControl.times`, fed by every
  durable save of the door's session: :meth:`Session.save` times its own). ``'storage'``: the
  door commits the step to storage; ``'ram'``: to its memory tier only, never starting the
  durable write; ``'none'``: (no tier) nothing new is committed. The door says whether it has
  a tier (``tier=``), nothing else: the decision is the same for every door;
- **the exit** (:meth:`RunControl.exit_preempted`): ``SystemExit(143)``
  (:data:`EXIT_CODE_PREEMPTED`, committed to storage) or ``SystemExit(79)``
  (:data:`EXIT_CODE_PREEMPTED_NOT_DURABLE`, in RAM only or nowhere).

A door's preemption, whichever door: ``agree()`` at each step; on a nonzero answer ``plan(tier=)``;
commit where the plan says (the door's own writer or tier), wait for it on every rank
(:meth:`RunControl.together` exchanges the outcome), ``preempted(...)``, ``exit_preempted(...)``.

Which thread calls what: the training thread calls everything; :meth:`RunControl.install`,
:meth:`RunControl.arm` and :meth:`RunControl.close` put signal handlers in place and back only
on the main thread (where Python allows it; elsewhere logged and skipped).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Sequence
from typing import Any

from snapkeep._core.distributed.agreement import exchange_outcomes
from snapkeep._core.distributed.errors import CollectiveTimeoutError, RankFailedError
from snapkeep._core.distributed.groups import exit_cleanly_at_exit
from snapkeep._core.distributed.signals import (
    DEFAULT_SIGNALS,
    EXIT_CODE_PREEMPTED,
    EXIT_CODE_PREEMPTED_NOT_DURABLE,
    FAILED,
    SignalWatch,
    describe_signal,
    signal_name,
)
from snapkeep._core.session.deadline import (
    Estimate,
    Grace,
    Plan,
    SaveTimes,
    check_grace_s,
    decide,
    grace_from,
)
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
    """One run of a door: its status log and, with ``signals``, its preemption watch, the
    deadline and the exit (see the module docstring). Get it from the door's session
    (:meth:`Session.run_control`).

    Args:
        storage: the storage of the output directory (None: the status is not recorded, for a
            door without a snapkeep store: ppe's own writers).
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
        step_name: what the door calls a step in messages (ppe: ``'iteration'``).

    Raises:
        ValueError: ``grace_s`` or ``$SNAPKEEP_GRACE_S`` is not a number of seconds > 0.
    """

    def __init__(self, storage: Storage | None, directory: str, *, rank: int = 0,
                 world_size: int = 1, signals: Sequence[signal.Signals | int] = (),
                 control: Any = None, timeout_s: float = 600.0,
                 grace_s: float | None = None, step_name: str = "step") -> None:
        self.step_name = step_name
        self._grace_s = check_grace_s(grace_s)
        self.grace = grace_from(self._grace_s) if signals else Grace()
        self.status = StatusLog(storage, directory, rank=rank, world_size=world_size) \
            if storage is not None else None
        self.watch = SignalWatch(signals, control=control, rank=rank,
                                 timeout_s=timeout_s) if signals else None
        self.times = SaveTimes()  # this run's durable saves, timed: the deadline's estimate
        self._control = control if signals else None  # kept after disarm: the exit needs it
        self.rank = rank
        self.timeout_s = timeout_s
        self.step = 0  # the step of the last load or save
        self.started = False
        self.preempting = False
        self._received: list[int] = []  # the signals received before the last disarm
        self._told = False  # a failure was exchanged (once per run)
        self._agreeing = False  # inside the agreement's collective

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
        self._control = control
        self.timeout_s = timeout_s
        self.preempting = False
        self.watch.install()

    def disarm(self) -> None:
        """Put the previous signal handlers back and drop the hook (idempotent): :meth:`agree`
        answers 0 until the next :meth:`arm`."""
        watch, self.watch = self.watch, None
        if watch is not None:
            self._received = list(watch.received)
            watch.uninstall(preempting=self.preempting)

    def at(self, step: int) -> None:
        """Note ``step`` (a load or a save); the first call records ``running`` at it."""
        self.step = step
        if not self.started:
            self.started = True
            self._record("running", step)

    @property
    def received(self) -> list[int]:
        """The signals received on this rank (and torchrun's agent's death), kept after
        :meth:`disarm`."""
        return self.watch.received if self.watch is not None else self._received

    @property
    def control(self) -> Any:
        """The control process group of the agreement (None: one process, or no preemption;
        kept after :meth:`disarm`)."""
        return self._control

    def agree(self) -> int:
        """0 when no rank was signalled, else a :func:`~.signals.signalled` value naming a
        signal and a rank that received it; collective under a control group (every rank at
        the same step). Always 0 without preemption.

        Raises:
            RankFailedError: another rank's step raised (it reported it with
                :meth:`tell_failure`): named, with its error, on every rank.
            CollectiveTimeoutError: a rank died or did not take part in time.
        """
        watch = self.watch
        if watch is None:
            return 0
        self._agreeing = True
        try:
            agreed = watch.agree()
        finally:
            self._agreeing = False
        if agreed == FAILED:
            self._told = True
            exchange_outcomes(watch.control, None, what=self._failed_at(),
                              timeout_s=self.timeout_s)
        return agreed

    def tell_failure(self, error: BaseException) -> None:
        """This rank's step raised ``error``: tell the other ranks (they are at, or on their
        way to, the step's :meth:`agree`; they raise ``RankFailedError`` naming this rank and
        its error, and rank 0 records it) and record ``failed``. Not when the error came from
        a collective (the group may be broken), nor twice, nor inside the agreement itself."""
        watch = self.watch
        if watch is not None and watch.control is not None and not self._told \
                and not self._agreeing and not isinstance(error, CollectiveTimeoutError):
            self._told = True
            try:
                watch.agree(failed=True)
                exchange_outcomes(watch.control, error, what=self._failed_at(),
                                  timeout_s=self.timeout_s)
            except RankFailedError:
                pass  # expected: it names this rank (and any other that failed)
            except CollectiveTimeoutError as e:
                logger.warning("rank %d: could not tell the other ranks about the error: %s",
                               self.rank, e)
        self.failed(error)

    def _failed_at(self) -> str:
        return f"training ({self.step_name} {self.step})"

    def together(self, error: BaseException | None, what: str) -> None:
        """Exchange this rank's outcome of ``what`` (a preemption commit) with the other ranks:
        every rank raises ``RankFailedError`` naming the failing ones (chained to ``error``
        where it failed), or none does.

        Raises:
            RankFailedError, CollectiveTimeoutError: see
                :func:`~snapkeep._core.distributed.agreement.exchange_outcomes`.
        """
        exchange_outcomes(self.control, error, what=what, timeout_s=self.timeout_s)

    def plan(self, estimate: Estimate | None = None, *, tier: bool,
             clock: Any = time.monotonic, wall_clock: Any = time.time) -> Plan:
        """Where the preemption snapshot of this step goes (see
        :func:`~snapkeep._core.session.deadline.decide`): collective under a control group (one
        all-reduce of three numbers), so every rank decides the same from the smallest
        remaining time and the largest durable estimate; call it on every rank right after a
        nonzero :meth:`agree`. ``tier``: the door has a memory tier (the same on every rank);
        ``estimate``: default :attr:`times`' (this run's measured durable saves).

        Raises:
            CollectiveTimeoutError: a rank died or did not take part in time.
        """
        if estimate is None:
            estimate = self.times.estimate()
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

    def requested(self, step: int, plan: Plan | None) -> None:
        """Note that a preemption was agreed at ``step`` (the door takes it where ``plan``
        says next): from now on the handlers stay until the exit, and it is logged."""
        self.preempting = True
        self.step = step
        received = self.received
        where = "storage" if plan is None else plan.where
        logger.warning("rank %d: preemption requested (signals here: %s); %s %d goes to %s, "
                       "then exiting with %d", self.rank,
                       [signal_name(s) for s in received] or "none", self.step_name, step, where,
                       exit_code(plan))

    def preempted(self, step: int, names: Sequence[str] | str, agreed: int,
                  plan: Plan | None = None, *, reason: str = "") -> None:
        """Record ``preempted`` at ``step`` (snapshots ``names`` committed on every rank: the
        door waited; in RAM only or nowhere when ``plan`` says so) naming the signal and rank
        of ``agreed`` (or ``reason``: a framework's own preemption), with ``plan``'s record
        where a deadline was known (without one there was nothing to decide: storage)."""
        self.preempting = True
        received = self.received
        if len(received) > 1:
            logger.warning("rank %d: %d further signal(s) arrived during the preemption; "
                           "ignored", self.rank, len(received) - 1)
        names = (names,) if isinstance(names, str) else tuple(names)
        self._record("preempted", step, snapshots=tuple(n for n in names if n),
                     reason=reason or describe_signal(agreed, received),
                     preemption=plan.as_dict() if plan is not None and plan.source else None)

    def exit_preempted(self, step: int, plan: Plan | None = None, *,
                       exit_code_durable: int = EXIT_CODE_PREEMPTED) -> None:
        """Say where the preemption snapshot of ``step`` is committed and raise
        ``SystemExit(143)`` (in storage; ``exit_code_durable``: ppe's ``exit_code=``), or
        ``SystemExit(79)`` (``plan`` put it in RAM only, or nowhere). Under a control group,
        and after a skipped durable write (a deadline leaves no time for a slow interpreter
        teardown, seconds on a loaded machine), the exit skips the interpreter's teardown
        (:func:`~snapkeep._core.distributed.groups.exit_cleanly_at_exit`: every ``atexit``
        handler runs, then ``os._exit``; teardown with gloo can abort with -6)."""
        code = exit_code(plan, durable=exit_code_durable)
        self.disarm()  # the previous handlers back (kept by the session's close meanwhile)
        if self.control is not None or code == EXIT_CODE_PREEMPTED_NOT_DURABLE:
            exit_cleanly_at_exit(code)
        if plan is None or plan.where == "storage":
            logger.warning("rank %d: preemption snapshot of %s %d committed; exiting with %d "
                           "(run the same command again to resume from it)", self.rank,
                           self.step_name, step, code)
            raise SystemExit(code)
        logger.warning("rank %d: preemption: %s %d %s; exiting with %d (run the same "
                       "command again: it resumes from %s)", self.rank, self.step_name, step,
                       "committed to the memory tier only (not to storage)"
                       if plan.where == "ram" else "not committed (no time, no memory tier)",
                       EXIT_CODE_PREEMPTED_NOT_DURABLE,
                       "RAM on these nodes, else storage's newest snapshot"
                       if plan.where == "ram" else "storage's newest snapshot")
        raise SystemExit(EXIT_CODE_PREEMPTED_NOT_DURABLE)

    def finished(self, reason: str = "") -> None:
        """Record ``finished`` at the last step (only once the run started)."""
        if self.started:
            self._record("finished", self.step, reason=reason)

    def failed(self, error: BaseException | str) -> None:
        """Record ``failed`` at the last step, with the error's first line (each failing rank's
        for a ``RankFailedError``; only once the run started)."""
        if self.started:
            self._record("failed", self.step, reason=failure_reason(error))

    def _record(self, state: str, step: int, **fields: Any) -> None:
        if self.status is not None:
            self.status.record(state, step, **fields)

    def close(self) -> None:
        """Put the previous signal handlers back (idempotent; see :meth:`disarm`)."""
        self.disarm()


def exit_code(plan: Plan | None, *, durable: int = EXIT_CODE_PREEMPTED) -> int:
    """The exit code of a preemption decided by ``plan``: ``durable`` (143) when the step is
    in storage (or no deadline decided), else :data:`EXIT_CODE_PREEMPTED_NOT_DURABLE` (79)."""
    return durable if plan is None or plan.where == "storage" \
        else EXIT_CODE_PREEMPTED_NOT_DURABLE


__all__ = ["EXIT_CODE_PREEMPTED", "EXIT_CODE_PREEMPTED_NOT_DURABLE", "RunControl", "exit_code",
           "preemption_signals"]
