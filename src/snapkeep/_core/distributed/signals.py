"""Preemption signals for a door without a manager (the plain-loop Checkpointer): a handler only
records the signal; at a step boundary the ranks agree whether any of them was signalled (one
all-reduce of one integer on snapkeep's control group, bounded; a single process reads its own
flag), so every rank snapshots the same step.

The value a rank contributes is :func:`signalled` (the signal and this rank, so the maximum over
the ranks names a signal and a rank that received it), or 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from snapkeep._core.distributed.errors import CollectiveTimeoutError
from snapkeep._core.distributed.launcher import on_orphaned

logger = logging.getLogger(__name__)

#: Exit code after a preemption snapshot (128 + SIGTERM, what a process killed by SIGTERM
#: reports; torchrun and schedulers read it as 'terminated').
EXIT_CODE_PREEMPTED = 143

#: Exit code after a preemption whose step is NOT in storage: the grace period was too short
#: for this run's durable write, so the step went to the memory tier (node RAM and its peers)
#: or, without one, nothing new was committed (the newest committed snapshot is the resume
#: point). The run status says which (``preemption.committed_to``).
EXIT_CODE_PREEMPTED_NOT_DURABLE = 79

#: What a watch records when torchrun's agent is gone (a preemption request: SIGUSR1 from
#: SLURM's ``--signal`` kills an agent that does not forward it); no signal number is this
#: high, and it fits the 10 bits :func:`signalled` gives a signal.
AGENT_GONE = 0x3FF

#: The per-step agreement's value from a rank whose step raised (its door reports it through
#: :meth:`SignalWatch.agree` with ``failed=True``): above every :func:`signalled` value, so the
#: maximum over the ranks reports the failure, and the other ranks gather its error.
FAILED = 1 << 30

#: Signals a preemptible door catches by default: torchrun forwards SIGTERM to its workers;
#: SLURM sends SIGUSR1 ahead of the time limit with ``--signal=USR1@<seconds>``.
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def signalled(signum: int, rank: int) -> int:
    """The agreement's value from ``rank`` signalled with ``signum`` (> 0)."""
    return (signum << 20) | (rank & 0xFFFFF)


def describe_signal(agreed: int, received: Sequence[int]) -> str:
    """The status's reason: the signals received here (``'signal SIGTERM'``, ``"signal
    SIGUSR1, torchrun's agent gone"``), else the one ``agreed`` names with its rank."""
    if not received:
        return f"{describe_signal(0, [agreed >> 20])} on rank {agreed & 0xFFFFF}"
    names = sorted({signal_name(s) for s in received if s != AGENT_GONE})
    parts = ["signal " + ", ".join(names)] if names else []
    if AGENT_GONE in received:
        parts.append("torchrun's agent gone")
    return ", ".join(parts)


def signal_name(signum: int) -> str:
    """``'SIGTERM'``; ``"torchrun's agent gone"`` for :data:`AGENT_GONE`."""
    if signum == AGENT_GONE:
        return "torchrun's agent gone"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def parse_signals(signals: Sequence[signal.Signals | int]) -> tuple[signal.Signals, ...]:
    """``signals`` as ``signal.Signals``.

    Raises:
        ValueError: an unknown signal, none, or SIGKILL/SIGSTOP (they cannot be caught).
    """
    parsed = []
    for sig in signals:
        try:
            parsed.append(signal.Signals(sig))
        except ValueError:
            raise ValueError(f"signals must be signal numbers such as signal.SIGTERM, got "
                             f"{sig!r}") from None
    if not parsed or any(s in (signal.SIGKILL, signal.SIGSTOP) for s in parsed):
        raise ValueError(f"signals must be catchable (not SIGKILL/SIGSTOP), got {signals!r}")
    return tuple(parsed)


class SignalWatch:
    """Records ``signals`` (handlers installed by :meth:`install`, main thread only) and agrees
    across the ranks of ``control`` at :meth:`agree`.

    Args:
        signals: the signals to catch.
        control: snapkeep's control process group (None: one process).
        rank: this rank.
        timeout_s: bound of the agreement, seconds (the group's own timeout applies).
    """

    def __init__(self, signals: Sequence[signal.Signals | int], *, control: Any = None,
                 rank: int = 0, timeout_s: float = 600.0) -> None:
        self.signals = parse_signals(signals)
        self.control = control
        self.rank = rank
        self.timeout_s = timeout_s
        self.received: list[int] = []
        #: ``time.monotonic()`` when the first request arrived here (None: none yet)
        self.first_mono_s: float | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> bool:
        """Install the handlers; False (logged) off the main thread, where Python cannot.
        Under torchrun with ``control``, the agent's death counts as a request too
        (:func:`~snapkeep._core.distributed.launcher.on_orphaned`, bounded by ``timeout_s``)."""
        if self.control is not None:
            on_orphaned(self._on_agent_gone, self.timeout_s)
        if threading.current_thread() is not threading.main_thread():
            logger.warning("preemption: not on the main thread; signal handlers not installed")
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return True

    def uninstall(self, *, preempting: bool = False) -> None:
        """Put the previous handlers back (idempotent; main thread only); unless
        ``preempting`` (the agent watch must still wait for the snapshot), end at once again
        when torchrun's agent dies."""
        if self.control is not None and not preempting:
            on_orphaned(None)
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        if self.first_mono_s is None:  # only record: the boundary acts (async-signal safe)
            self.first_mono_s = time.monotonic()
        self.received.append(signum)

    def _on_agent_gone(self, agent_pid: int) -> None:
        if self.first_mono_s is None:  # the launcher watch's thread: only record
            self.first_mono_s = time.monotonic()
        self.received.append(AGENT_GONE)

    def agree_max(self, values: Sequence[float]) -> list[float]:
        """The element-wise maximum of ``values`` over the ranks (float64; collective with
        ``control``: every rank calls it at the same step; one process: ``values``).

        Raises:
            CollectiveTimeoutError: a rank died or did not take part in time.
        """
        if self.control is None:
            return [float(v) for v in values]
        flag = torch.tensor(list(values), dtype=torch.float64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        except RuntimeError as e:
            raise CollectiveTimeoutError(
                f"preemption plan: rank {self.rank} lost the other ranks (one died, hung for "
                f"more than {self.timeout_s:g} s or failed outside snapkeep): {e}") from e
        return [float(v) for v in flag.tolist()]

    def agree(self, *, failed: bool = False) -> int:
        """0 when no rank was signalled, else a :func:`signalled` value of a rank that was, or
        :data:`FAILED` when a rank's step raised (``failed=True`` there); collective with
        ``control``: every rank calls it at the same step.

        Raises:
            CollectiveTimeoutError: a rank died or did not take part in time.
        """
        local = FAILED if failed else \
            signalled(self.received[0], self.rank) if self.received else 0
        if self.control is None:
            return local
        flag = torch.tensor([local], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        except RuntimeError as e:
            raise CollectiveTimeoutError(
                f"preemption check: rank {self.rank} lost the other ranks (one died, hung for "
                f"more than {self.timeout_s:g} s or failed outside snapkeep): {e}") from e
        return int(flag.item())
