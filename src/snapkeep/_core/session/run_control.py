"""A door's run: its recorded status and, when asked for, its preemption hook.

Every door records the same states in ``.snapkeep/status.json`` (read by ``snapkeep status``):
``running`` at the step of its first load or save, then once ``preempted``, ``failed`` or
``finished``. With preemption on, the door asks :meth:`RunControl.agree` at each save (every
rank at the same step: collective under a process group); a nonzero answer means a rank was
signalled (or torchrun's agent died), the door takes that step's snapshot on every rank,
waits for its commit and calls :meth:`RunControl.preempted`, which records the state and
raises ``SystemExit(143)`` (ppe's and the manager's ``extensions.preemption`` exit code).

Which thread calls what: the training thread calls everything; :meth:`RunControl.install` and
:meth:`RunControl.close` put signal handlers in place and back only on the main thread (where
Python allows it; elsewhere logged and skipped).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from typing import Any

from snapkeep._core.distributed.signals import (
    DEFAULT_SIGNALS,
    EXIT_CODE_PREEMPTED,
    SignalWatch,
    describe_signal,
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
    """

    def __init__(self, storage: Storage, directory: str, *, rank: int = 0, world_size: int = 1,
                 signals: Sequence[signal.Signals | int] = (), control: Any = None,
                 timeout_s: float = 600.0) -> None:
        self.status = StatusLog(storage, directory, rank=rank, world_size=world_size)
        self.watch = SignalWatch(signals, control=control, rank=rank,
                                 timeout_s=timeout_s) if signals else None
        self.rank = rank
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

    def preempted(self, step: int, name: str, agreed: int) -> None:
        """Record ``preempted`` at ``step`` (snapshot ``name`` committed on every rank: the
        door waited) naming the signal and rank of ``agreed``."""
        self.preempting = True
        received = self.watch.received if self.watch is not None else []
        self.status.record("preempted", step, snapshots=(name,) if name else (),
                           reason=describe_signal(agreed, received))

    def exit_preempted(self, step: int) -> None:
        """Say that the preemption snapshot of ``step`` is committed and raise
        ``SystemExit(143)``."""
        logger.warning("rank %d: preemption snapshot of step %d committed; exiting with %d "
                       "(run the same command again to resume from it)", self.rank, step,
                       EXIT_CODE_PREEMPTED)
        raise SystemExit(EXIT_CODE_PREEMPTED)

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


__all__ = ["EXIT_CODE_PREEMPTED", "RunControl", "preemption_signals"]
