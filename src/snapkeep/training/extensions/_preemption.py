"""``extensions.preemption``: a signal becomes one committed snapshot on every rank and a clean
exit with a documented code.

Flow (every rank runs the extension at every iteration, after the snapshot extensions):

1. a signal handler (installed in ``initialize``, main thread) only records the signal;
2. at each iteration boundary the ranks agree whether any of them was signalled: one all-reduce
   of one integer on snapkeep's control process group (bounded by ``timeout_s``; single-process:
   the local flag), so every rank sees the request at the same iteration;
3. if so, every snapshot extension of the manager snapshots this iteration (unless its trigger
   already did), the manager is finalized (which waits until the snapshots are committed), the
   ranks exchange the outcome, and every rank raises ``SystemExit(exit_code)``;
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
import threading
import types
from collections.abc import Sequence
from typing import Any

from snapkeep.distributed import (
    AGENT_GONE,
    EXIT_CODE_PREEMPTED,
    describe_signal,
    parse_signals,
    signal_name,
    signalled,
)
from snapkeep.store import check_timeout_s
from snapkeep.training import extension
from snapkeep.training.extensions._lineage import snapshot_extensions
from snapkeep.training.extensions._run_status import StatusRecorder

logger = logging.getLogger(__name__)

PRIORITY_PREEMPTION = extension.PRIORITY_SNAPSHOT - 100
"""Runs after the snapshot extensions of the same iteration."""

_FAILED = 1 << 30
"""The per-iteration agreement's value from a rank whose iteration raised (its ``on_error``):
the other ranks then gather its error and raise :class:`~snapkeep.errors.RankFailedError`.
Above every ``snapkeep.distributed.signalled`` value, so the maximum over the ranks reports
the failure."""


def preemption(
    signals: Sequence[signal.Signals | int] = (signal.SIGTERM, signal.SIGUSR1),
    *,
    exit_code: int = EXIT_CODE_PREEMPTED,
    timeout_s: float = 600.0,
    requeue: bool = False,
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

    Raises:
        ValueError: an unknown signal, SIGKILL/SIGSTOP (cannot be caught), an ``exit_code``
            outside 0..255, or a non-positive ``timeout_s``.
    """
    return Preemption(signals=signals, exit_code=exit_code, timeout_s=timeout_s,
                      requeue=requeue)


class Preemption(extension.Extension):
    """See :func:`preemption`."""

    trigger = 1, "iteration"
    priority = PRIORITY_PREEMPTION
    needs_model_state = True

    def __init__(self, *, signals: Sequence[signal.Signals | int], exit_code: int,
                 timeout_s: float, requeue: bool) -> None:
        parsed = parse_signals(signals)
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) \
                or not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code must be an int in 0..255, got {exit_code!r}")
        check_timeout_s(timeout_s)
        self.signals = parsed
        self.exit_code = exit_code
        self.timeout_s = float(timeout_s)
        self.requeue = requeue
        self.received: list[int] = []
        self.preempted_at: int | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._groups: Any = None
        self._snapshotted: dict[int, int] = {}
        self._agreeing = False  # inside the agreement's collective
        self._told = False  # a failure was exchanged (once per run)
        self._status = StatusRecorder()  # .snapkeep/status.json, for the job script

    # -- lifecycle -----------------------------------------------------------------------------
    def initialize(self, manager: Any) -> None:
        """Install the signal handlers (main thread only) and, under torch.distributed,
        snapkeep's control group (collective)."""
        from snapkeep.distributed import background_groups, is_distributed

        if is_distributed():
            from snapkeep.distributed import on_orphaned

            self._groups = background_groups(self.timeout_s)
            on_orphaned(self._on_agent_gone, self.timeout_s)
        if threading.current_thread() is not threading.main_thread():
            logger.warning("preemption: not on the main thread; signal handlers not installed")
        else:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._watch_snapshots(manager)
        self._status.start(manager, snapshot_extensions(manager),
                           rank=self._groups.rank if self._groups else 0,
                           world_size=self._groups.world_size if self._groups else 1)

    def on_error(self, manager: Any, exc: Exception, tb: types.TracebackType) -> None:
        """Tell the other ranks that this rank's iteration raised, and record the run as
        ``failed`` in its status file (rank 0).

        Under torch.distributed the other ranks are at (or on their way to) this iteration's
        agreement: this rank takes part in it with its failure and then in an exchange of
        outcomes, so they raise :class:`~snapkeep.errors.RankFailedError` naming this rank and
        its error (rank 0 records that in the status) instead of failing later on a lost rank.
        Not when the error came from a collective (the group may be broken)."""
        from snapkeep.distributed import exchange_outcomes
        from snapkeep.errors import CollectiveTimeoutError, RankFailedError

        if self._groups is not None and not self._told and not self._agreeing \
                and not isinstance(exc, CollectiveTimeoutError):
            self._told = True
            try:
                self._all_reduce(_FAILED)
                exchange_outcomes(self._groups.control, exc, what=_failed_at(manager),
                                  timeout_s=self.timeout_s)
            except RankFailedError:
                pass  # expected: it names this rank (and any other that failed)
            except CollectiveTimeoutError as e:
                logger.warning("rank %d: could not tell the other ranks about the error: %s",
                               self._groups.rank, e)
        self._status.failed(manager, exc)

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        self.received.append(signum)  # only record: the boundary acts (async-signal safe)

    def _on_agent_gone(self, agent_pid: int) -> None:
        """torchrun's agent died (the launcher watch's thread): a preemption request."""
        self.received.append(AGENT_GONE)

    def finalize(self, manager: Any) -> None:
        """Record ``finished`` in the status file unless preempted or failing (rank 0), and
        restore the previous signal handlers. Idempotent."""
        if self.preempted_at is None:
            self._status.finalize(manager)
        if self._groups is not None and self.preempted_at is None:  # preempting: the watch
            from snapkeep.distributed import on_orphaned  # must still wait for it

            on_orphaned(None)
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._previous.clear()

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
        requested = self._agree(manager)
        if not requested:
            return
        self._preempt(manager, requested)

    def _agree(self, manager: Any) -> int:
        """0 when no rank was signalled, else a ``snapkeep.distributed.signalled`` value of
        some rank that was.
        Raises :class:`~snapkeep.errors.RankFailedError` when a rank reports its failure
        instead (see :meth:`on_error`)."""
        rank = self._groups.rank if self._groups else 0
        local = signalled(self.received[0], rank) if self.received else 0
        if self._groups is None:
            return local
        value = self._all_reduce(local)
        if value == _FAILED:
            from snapkeep.distributed import exchange_outcomes

            self._told = True
            exchange_outcomes(self._groups.control, None, what=_failed_at(manager),
                              timeout_s=self.timeout_s)
        return value

    def _all_reduce(self, value: int) -> int:
        """The maximum of ``value`` over the ranks (one collective on the control group)."""
        import torch
        import torch.distributed as dist

        from snapkeep.errors import CollectiveTimeoutError

        flag = torch.tensor([value], dtype=torch.int32)
        self._agreeing = True
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._groups.control)
        except RuntimeError as e:
            raise CollectiveTimeoutError(
                f"preemption check: rank {self._groups.rank} lost the other ranks (one died, "
                f"hung for more than {self.timeout_s:g} s or failed outside snapkeep): {e}"
            ) from e
        finally:
            self._agreeing = False
        return int(flag.item())

    def _preempt(self, manager: Any, agreed: int) -> None:
        from snapkeep.distributed import exchange_outcomes

        iteration = int(manager.iteration)
        self.preempted_at = iteration
        rank = self._groups.rank if self._groups else 0
        logger.warning("rank %d: preemption requested (signals here: %s); snapshotting "
                       "iteration %d on every rank, then exiting with %d", rank,
                       [signal_name(s) for s in self.received] or "none", iteration,
                       self.exit_code)
        error: BaseException | None = None
        snapshots = snapshot_extensions(manager)
        if not snapshots:
            logger.error("preemption: the manager has no snapshot extension; exiting without "
                         "a snapshot")
        try:
            self._watch_snapshots(manager)
            for ext in snapshots:
                if self._snapshotted.get(id(ext)) != iteration:
                    ext._make_snapshot(manager)
            manager.finalize()  # waits until every snapshot is committed
        except Exception as e:  # exchanged below: every rank raises, naming the failing one
            error = e
        exchange_outcomes(self._groups.control if self._groups else None, error,
                          what=f"preemption snapshot at iteration {iteration}",
                          timeout_s=self.timeout_s)
        if len(self.received) > 1:
            logger.warning("rank %d: %d further signal(s) arrived during the preemption "
                           "snapshot; ignored (the snapshot is committed)", rank,
                           len(self.received) - 1)
        self._status.preempted(
            manager, snapshots=[n for n in (e.snapshot_name(manager) for e in snapshots) if n],
            reason=describe_signal(agreed, self.received))
        if self.requeue and rank == 0:
            _requeue()
        if self._groups is not None:
            from snapkeep.distributed import exit_cleanly_at_exit

            exit_cleanly_at_exit(self.exit_code)  # teardown with gloo can abort (exit -6)
        logger.warning("rank %d: preemption snapshot of iteration %d committed; exiting with %d "
                       "(run the same command again to resume from it)", rank, iteration,
                       self.exit_code)
        raise SystemExit(self.exit_code)


def _failed_at(manager: Any) -> str:
    return f"training (iteration {int(manager.iteration)})"


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
