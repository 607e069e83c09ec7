"""``extensions.preemption``: a signal becomes one committed snapshot on every rank and a clean
exit with a documented code.

An adapter on the run control every door uses (:class:`snapkeep.session.RunControl`, got from the
session of the manager's first snapshot extension: ``session.run_control(...)``). Flow (every
rank runs the extension at every iteration, after the snapshot extensions):

1. a signal handler (installed in ``initialize``, main thread) only records the signal;
2. at each iteration boundary the ranks agree whether any of them was signalled: one all-reduce
   of one integer on snapkeep's control process group (bounded by ``timeout_s``; single-process:
   the local flag), so every rank sees the request at the same iteration;
3. if so, the ranks agree on the deadline (one all-reduce; ``grace_s``, ``$SNAPKEEP_GRACE_S`` or
   SLURM's end time, against this run's measured durable saves): when the durable write fits
   (or no deadline is known), every snapshot extension of the manager snapshots this iteration
   (unless its trigger already did), the manager is finalized (which waits until the snapshots
   are committed), the ranks exchange the outcome, and every rank raises
   ``SystemExit(exit_code)`` (143). When it does not fit, no durable write is started: the
   iteration goes to the memory tier (``extensions.memory_tier``) when one is registered, else
   nowhere (the newest committed snapshot stays the resume point), and every rank exits with
   79 (:data:`~snapkeep.distributed.EXIT_CODE_PREEMPTED_NOT_DURABLE`); the run status says which;
4. a second signal meanwhile is only logged: snapshots commit atomically (temp + fsync + rename,
   a marker written last), so nothing can be half-committed by any signal, even SIGKILL.

Under torchrun, the agent dies of SIGUSR1 (it does not handle it) whether the signal was sent to
it alone or to the whole job step (SLURM's ``--signal=USR1@<s>``), and a worker whose agent is
gone is normally ended at once (``snapkeep._core.distributed.launcher``). With this extension the
worker instead records the agent's death as a preemption request (besides any signal it got
itself): every rank snapshots the same iteration, the status says ``preempted`` and each exits
with ``exit_code``; a worker still alive ``timeout_s`` after that is ended as before.

With ``requeue=True`` under SLURM (``SLURM_JOB_ID`` set), rank 0 runs ``scontrol requeue`` before
exiting, as Lightning does on SIGUSR1.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import types
from collections.abc import Sequence
from typing import Any

from snapkeep.distributed import EXIT_CODE_PREEMPTED, parse_signals
from snapkeep.session import RunControl, Session, check_grace_s
from snapkeep.store import check_timeout_s
from snapkeep.training import extension
from snapkeep.training.extensions._lineage import (
    MEMORY_TIER_MARKER,
    registered_extensions,
    snapshot_extensions,
)
from snapkeep.writing import Writer

logger = logging.getLogger(__name__)

PRIORITY_PREEMPTION = extension.PRIORITY_SNAPSHOT - 100
"""Runs after the snapshot extensions of the same iteration."""


def preemption(
    signals: Sequence[signal.Signals | int] = (signal.SIGTERM, signal.SIGUSR1),
    *,
    exit_code: int = EXIT_CODE_PREEMPTED,
    timeout_s: float = 600.0,
    requeue: bool = False,
    grace_s: float | None = None,
) -> Preemption:
    """Returns an extension that turns ``signals`` into a snapshot of the same iteration on
    every rank, then a clean exit (see the module docstring). Register it on every rank with
    the default trigger (every iteration), beside at least one snapshot extension.

    Args:
        signals: signals to catch (torchrun forwards SIGTERM to its workers; SLURM sends
            SIGUSR1 ahead of the time limit with ``--signal=USR1@<seconds>``).
        exit_code: the process exits with ``SystemExit(exit_code)`` after the snapshot is
            committed (default :data:`EXIT_CODE_PREEMPTED`, 143).
        timeout_s: bound in seconds of the per-iteration agreement and of the commit exchange.
        requeue: under SLURM, rank 0 requeues the job (``scontrol requeue $SLURM_JOB_ID``).
        grace_s: seconds between the first signal and SIGKILL (the launcher's grace period:
            Kubernetes' ``terminationGracePeriodSeconds``, a Spot notice); None: from
            ``$SNAPKEEP_GRACE_S``, else SLURM's ``$SLURM_JOB_END_TIME``, else no deadline. A
            durable write that would not finish in time is never started: the iteration goes
            to the memory tier (or nowhere) and the exit code is 79 (see the module docstring
            and docs/cluster.md).

    Raises:
        ValueError: an unknown signal, SIGKILL/SIGSTOP (cannot be caught), an ``exit_code``
            outside 0..255, a non-positive ``timeout_s`` or ``grace_s``.
    """
    return Preemption(signals=signals, exit_code=exit_code, timeout_s=timeout_s,
                      requeue=requeue, grace_s=grace_s)


class Preemption(extension.Extension):
    """See :func:`preemption`."""

    trigger = 1, "iteration"
    priority = PRIORITY_PREEMPTION
    needs_model_state = True

    def __init__(self, *, signals: Sequence[signal.Signals | int], exit_code: int,
                 timeout_s: float, requeue: bool, grace_s: float | None = None) -> None:
        parsed = parse_signals(signals)
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) \
                or not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code must be an int in 0..255, got {exit_code!r}")
        check_timeout_s(timeout_s)
        self.grace_s = check_grace_s(grace_s)
        self.signals = parsed
        self.exit_code = exit_code
        self.timeout_s = float(timeout_s)
        self.requeue = requeue
        self.preempted_at: int | None = None
        self._run: RunControl | None = None  # the run control (status, signals, deadline, exit)
        self._snapshotted: dict[int, int] = {}

    @property
    def received(self) -> list[int]:
        """The signals received so far on this rank (and torchrun's agent's death)."""
        run = self._run
        return run.watch.received if run is not None and run.watch is not None else []

    # -- lifecycle -----------------------------------------------------------------------------
    def initialize(self, manager: Any) -> None:
        """Get the run control from the session of the manager's first snapshot extension with
        a snapkeep writer (the status is recorded in its directory; without one it is not,
        said once), which installs the signal handlers (main thread only); under
        torch.distributed, snapkeep's control group (collective)."""
        from snapkeep.distributed import background_groups, is_distributed

        groups = background_groups(self.timeout_s) if is_distributed() else None
        arguments: dict[str, Any] = dict(
            rank=groups.rank if groups else 0, world_size=groups.world_size if groups else 1,
            signals=self.signals, control=groups.control if groups else None,
            timeout_s=self.timeout_s, grace_s=self.grace_s, step_name="iteration")
        session = _session(manager)
        if session is not None:
            self._run = session.run_control(**arguments)
        else:
            logger.warning("preemption: no snapshot extension with a snapkeep writer; the run's "
                           "status is not recorded")
            self._run = Session.unrecorded_run_control(**arguments)
        self._watch_snapshots(manager)
        self._run.at(int(manager.iteration))  # running

    def on_error(self, manager: Any, exc: Exception, tb: types.TracebackType) -> None:
        """Tell the other ranks that this rank's iteration raised, and record the run as
        ``failed`` in its status file (rank 0; :meth:`snapkeep.session.RunControl.tell_failure`).

        Under torch.distributed the other ranks are at (or on their way to) this iteration's
        agreement: this rank takes part in it with its failure and then in an exchange of
        outcomes, so they raise :class:`~snapkeep.errors.RankFailedError` naming this rank and
        its error (rank 0 records that in the status) instead of failing later on a lost rank.
        Not when the error came from a collective (the group may be broken)."""
        run = self._run
        if run is not None:
            run.at(int(manager.iteration))
            run.tell_failure(exc)

    def finalize(self, manager: Any) -> None:
        """Record ``finished`` in the status file unless preempted or failing (rank 0), and
        restore the previous signal handlers. Idempotent."""
        run = self._run
        if run is None or self.preempted_at is not None:
            return  # preempting: the handlers (and the agent watch) stay until the exit
        run.at(int(manager.iteration))
        error = sys.exc_info()[1]
        if error is not None and not isinstance(error, SystemExit) or \
                isinstance(error, SystemExit) and error.code not in (0, None):
            run.failed(error)  # a ``with manager:`` block left by an exception
        else:
            run.finished(reason="the manager was finalized")
        run.close()

    # -- the snapshot extensions -------------------------------------------------------------------
    def _watch_snapshots(self, manager: Any) -> None:
        """Remember the iteration of each snapshot extension's last snapshot, so a preemption at
        an iteration already snapshotted by its trigger does not save it twice."""
        for ext in snapshot_extensions(manager):
            if getattr(ext, "_snapkeep_preemption_watch", False):
                continue
            make = ext._make_snapshot

            def recording(mgr: Any, _make: Any = make, _ext: Any = ext) -> None:
                self._snapshotted[id(_ext)] = int(mgr.iteration)
                _make(mgr)

            ext._make_snapshot = recording
            ext._snapkeep_preemption_watch = True

    # -- each iteration --------------------------------------------------------------------------
    def __call__(self, manager: Any) -> None:
        run = self._run
        if run is None:
            raise RuntimeError("preemption: called before initialize")
        run.at(int(manager.iteration))
        agreed = run.agree()  # RankFailedError when another rank's iteration raised
        if agreed:
            self._preempt(manager, run, agreed)

    def _preempt(self, manager: Any, run: RunControl, agreed: int) -> None:
        iteration = int(manager.iteration)
        self.preempted_at = iteration
        tier = next((x for x in registered_extensions(manager)
                     if getattr(x, MEMORY_TIER_MARKER, False)), None)
        plan = run.plan(tier=tier is not None)  # the deadline, agreed by every rank
        run.requested(iteration, plan)
        snapshots = snapshot_extensions(manager)
        error: BaseException | None = None
        try:
            if plan.where == "storage":
                if not snapshots:
                    logger.error("preemption: the manager has no snapshot extension; exiting "
                                 "without a snapshot")
                self._watch_snapshots(manager)
                for ext in snapshots:
                    if self._snapshotted.get(id(ext)) != iteration:
                        ext._make_snapshot(manager)
                manager.finalize()  # waits until every snapshot is committed
            elif plan.where == "ram" and tier is not None:  # never a durable write
                tier(manager)
                tier.wait()
        except Exception as e:  # exchanged below: every rank raises, naming the failing one
            error = e
        run.together(error, f"preemption snapshot at iteration {iteration}")
        names = [n for n in (e.snapshot_name(manager) for e in snapshots) if n] \
            if plan.where == "storage" else []
        run.preempted(iteration, names, agreed, plan)
        if self.requeue and run.rank == 0:
            _requeue()
        run.close()
        run.exit_preempted(iteration, plan, exit_code_durable=self.exit_code)


def _session(manager: Any) -> Any:
    """The engine session of the manager's first snapshot extension with a snapkeep writer
    (the status goes in its directory), or None."""
    for ext in snapshot_extensions(manager):
        writer = ext.writer if ext.writer is not None else manager.writer
        if isinstance(writer, Writer):
            return ext.session(manager)
    return None


def _requeue() -> None:
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        logger.warning("preemption: requeue=True but SLURM_JOB_ID is not set; not requeued")
        return
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60,
                       capture_output=True)
    except (OSError, subprocess.SubprocessError) as e:
        stderr = getattr(e, "stderr", None)
        detail = f" ({stderr.decode(errors='replace').strip()})" if stderr else ""
        logger.error("preemption: scontrol requeue %s failed: %s%s; the snapshot is committed, "
                     "resubmit the job to resume from it", job, e, detail)
    else:
        logger.warning("preemption: requeued SLURM job %s", job)


__all__ = ["EXIT_CODE_PREEMPTED", "Preemption", "preemption"]
