"""Preemption with a deadline: how long a preempted run has, how long its durable write takes,
and what fits.

A launcher that preempts a job gives it a grace period between its signal and SIGKILL
(Kubernetes' ``terminationGracePeriodSeconds``, 30 s by default, preStop hook included; GCP Spot
about 30 s; AWS Spot 2 minutes; SLURM's ``--signal=SIG@secs`` fires up to 60 s earlier than
asked and the job is killed ``KillWait`` seconds after its end time). Where it comes from
(:func:`grace_from`, first found wins):

1. the door's ``grace_s=`` argument (seconds from the first signal);
2. the environment variable ``SNAPKEEP_GRACE_S`` (seconds from the first signal; set it in the
   pod spec or job script to the launcher's grace);
3. SLURM's ``SLURM_JOB_END_TIME`` (the job's projected end, Unix seconds, exported to the job by
   Slurm 23.02 and later): the deadline is that time. Slurm exports neither the ``--signal``
   offset nor ``KillWait``; the end time is fixed at launch (a later ``scontrol update
   TimeLimit=`` is not seen), and a signal that arrives after it (the time limit's SIGTERM) has
   no known deadline from it.

With none, there is no deadline: the preemption snapshot is committed to storage, however long
it takes (as before).

The estimate (:class:`SaveTimes`) is this run's own measurement: for each durable save the door
times the call (staging, the part before training may go on) and the commit (from the call's
return until the commit future resolves), and keeps the largest of the last
:data:`KEPT` of each. A durable write at the preemption step is estimated as a save still in
flight (its commit estimate less the time it has run) plus one stage and one commit, times
:data:`MARGIN`, plus :data:`EXIT_S` for the status and the exit.

The decision (:func:`decide`, a pure function): ``'storage'`` when the durable write fits the
remaining time (or no deadline is known); else ``'ram'`` when a memory tier is configured (the
step goes to node RAM and its peers, the durable write is skipped and said so); else
``'none'`` (nothing new is committed; the newest committed snapshot stays the resume point).
Before this run measured a durable save, the estimate is unknown: ``'ram'`` with a tier (it
never starts a durable write it cannot time), else ``'storage'`` (the only way to keep the step).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GRACE_ENV = "SNAPKEEP_GRACE_S"
"""Environment variable: the grace period in seconds from the first preemption signal."""
SLURM_END_ENV = "SLURM_JOB_END_TIME"
"""SLURM's projected end of the job (Unix seconds), exported to the job's environment."""

MARGIN = 1.25
"""Factor applied to the measured durations of a durable write before comparing them."""
EXIT_S = 1.0
"""Seconds kept for recording the status and exiting after the commit."""
KEPT = 4
"""How many of the last measurements of each kind the estimate looks at (their maximum)."""

WHERE = ("storage", "ram", "none")


def check_grace_s(grace_s: Any) -> float | None:
    """``grace_s`` as seconds (float > 0), or None.

    Raises:
        ValueError: not None nor a finite number > 0 (named, with what to pass).
    """
    if grace_s is None:
        return None
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) \
            or not math.isfinite(grace_s) or grace_s <= 0:
        raise ValueError(f"grace_s must be a number of seconds > 0 (the time between the "
                         f"preemption signal and SIGKILL) or None (from ${GRACE_ENV}, "
                         f"${SLURM_END_ENV}, else no deadline), got {grace_s!r}")
    return float(grace_s)


@dataclass(frozen=True, kw_only=True)
class Grace:
    """Where a preemption's deadline comes from (see the module docstring).

    Attributes:
        grace_s: seconds from the first signal to SIGKILL; None when not known.
        end_unix_s: an absolute deadline (Unix seconds, SLURM's end time); None when not known.
        source: ``'grace_s='``, ``'$SNAPKEEP_GRACE_S'``, ``'$SLURM_JOB_END_TIME'`` or ``''``.
    """

    grace_s: float | None = None
    end_unix_s: float | None = None
    source: str = ""

    def remaining_s(self, *, signalled_mono_s: float | None, now_mono_s: float,
                    now_unix_s: float) -> float:
        """Seconds left before SIGKILL at ``now`` (``math.inf``: no deadline known here).
        ``signalled_mono_s``: ``time.monotonic()`` of the first signal this rank received
        (None: none here; another rank's deadline is agreed on)."""
        left = math.inf
        if self.grace_s is not None and signalled_mono_s is not None:
            left = self.grace_s - (now_mono_s - signalled_mono_s)
        if self.end_unix_s is not None and (signalled_mono_s is None or now_unix_s
                                            - (now_mono_s - signalled_mono_s)
                                            < self.end_unix_s):
            left = min(left, self.end_unix_s - now_unix_s)
        return left


def grace_from(grace_s: float | None, environ: Mapping[str, str] | None = None) -> Grace:
    """The grace of a run: ``grace_s`` (checked), else ``$SNAPKEEP_GRACE_S``, else
    ``$SLURM_JOB_END_TIME``, else none (see the module docstring).

    Raises:
        ValueError: ``grace_s`` or ``$SNAPKEEP_GRACE_S`` is not a number of seconds > 0, or
            ``$SLURM_JOB_END_TIME`` is not a number (the variable named).
    """
    env = os.environ if environ is None else environ
    if grace_s is not None:
        return Grace(grace_s=check_grace_s(grace_s), source="grace_s=")
    raw = env.get(GRACE_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"${GRACE_ENV} must be a number of seconds > 0 (the time between "
                             f"the preemption signal and SIGKILL), got {raw!r}; unset it for "
                             "no deadline")
        return Grace(grace_s=value, source="$" + GRACE_ENV)
    raw = env.get(SLURM_END_ENV, "").strip()
    if raw:
        try:
            end = float(raw)
        except ValueError:
            raise ValueError(f"${SLURM_END_ENV} must be Unix seconds, got {raw!r}") from None
        if end > 0:
            return Grace(end_unix_s=end, source="$" + SLURM_END_ENV)
    return Grace()


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What a durable write at the preemption step is expected to take, seconds (None: not
    measured yet in this run)."""

    stage_s: float | None
    commit_s: float | None
    pending_s: float
    durable_s: float | None

    def as_dict(self) -> dict[str, float | None]:
        return {"stage_s": self.stage_s, "commit_s": self.commit_s,
                "pending_s": self.pending_s, "durable_s": self.durable_s}


class SaveTimes:
    """This run's measured stage and commit durations of durable saves (see the module
    docstring). The training thread calls :meth:`staged`; the commit future's callback (any
    thread) calls :meth:`committed`."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._stage: deque[float] = deque(maxlen=KEPT)
        self._commit: deque[float] = deque(maxlen=KEPT)
        self._in_flight: dict[int, float] = {}  # id of a save -> monotonic time staged

    def start(self) -> float:
        """The start of a save's call (pass it to :meth:`staged`)."""
        return float(self._clock())

    def staged(self, started_s: float, committed: Any) -> None:
        """The save's call returned (it is staged); ``committed``: its commit future, timed
        when it resolves (a failed or cancelled commit is not counted)."""
        now = float(self._clock())
        key = id(committed)
        with self._lock:
            self._stage.append(now - started_s)
            self._in_flight[key] = now

        def done(future: Any) -> None:
            end = float(self._clock())
            with self._lock:
                began = self._in_flight.pop(key, None)
                if began is not None and not future.cancelled() and future.exception() is None:
                    self._commit.append(end - began)

        committed.add_done_callback(done)

    def estimate(self) -> Estimate:
        """The expected duration of a durable write now (see the module docstring)."""
        now = float(self._clock())
        with self._lock:
            stage = max(self._stage, default=None)
            commit = max(self._commit, default=None)
            pending = 0.0
            if commit is not None:
                for began in self._in_flight.values():
                    pending = max(pending, commit - (now - began))
        durable = None if stage is None or commit is None else \
            (pending + stage + commit) * MARGIN + EXIT_S
        return Estimate(stage_s=stage, commit_s=commit, pending_s=pending, durable_s=durable)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The agreed decision of a preemption (the same on every rank).

    Attributes:
        where: ``'storage'``, ``'ram'`` or ``'none'`` (see :func:`decide`).
        remaining_s: seconds left before SIGKILL when decided (the smallest over the ranks;
            ``math.inf``: no deadline known).
        durable_s: the estimated durable write (the largest over the ranks; None: unknown).
        source: where the deadline came from (:attr:`Grace.source`).
        estimate: this rank's :class:`Estimate`.
    """

    where: str
    remaining_s: float
    durable_s: float | None
    source: str
    estimate: Estimate

    def as_dict(self) -> dict[str, Any]:
        """The status's ``preemption`` record (JSON: an unknown deadline is None)."""
        return {"committed_to": self.where,
                "remaining_s": None if math.isinf(self.remaining_s) else
                round(self.remaining_s, 3),
                "durable_estimate_s": None if self.durable_s is None else
                round(self.durable_s, 3),
                "deadline_from": self.source or None,
                **{k: None if v is None else round(v, 3)
                   for k, v in self.estimate.as_dict().items()}}


def decide(remaining_s: float, durable_s: float | None, *, tier: bool) -> str:
    """``'storage'``, ``'ram'`` or ``'none'`` (see the module docstring): pure."""
    if math.isinf(remaining_s):
        return "storage"
    if durable_s is None:
        return "ram" if tier else "storage"
    if durable_s <= remaining_s:
        return "storage"
    return "ram" if tier else "none"


__all__ = ["EXIT_S", "GRACE_ENV", "MARGIN", "SLURM_END_ENV", "Estimate", "Grace", "Plan",
           "SaveTimes", "check_grace_s", "decide", "grace_from"]
