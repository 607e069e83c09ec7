"""When to save: ``every="auto"``, the snapshot interval chosen from this job's measurements.

The rule is Young's first-order optimum with Daly's higher-order correction:

- J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9),
  1974: ``T = sqrt(2 * C * M)``;
- J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3), 2006: ``T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C``
  for ``C < 2M``, else ``T = M``,

where ``T`` is the training time between two snapshots (seconds), ``C`` the time a save adds
to the training loop (the stall: the save call plus what the step after it lost; with a
background writer this, not the write, is what each snapshot costs) and ``M`` the mean time
between failures. In Daly's model the restart time ``R`` multiplies the expected run time by
``exp(R / M)`` and does not move the optimum; the time to durable ``D`` (call to commit) only
adds ``D / M`` to the expected loss per failure and does not move it either; both cost goodput
(``snapkeep status`` reports the restarts measured). ``D`` bounds the interval from below: a
snapshot is never due before the previous one is durable (with one in flight, a sooner one
would block the loop behind the write).

``M`` is estimated from this directory's history (:mod:`snapkeep._core.session.goodput`).
Before it has seen a failure, the prior counts as one: ``M = prior_mtbf_s + uptime``, so a
failure-free start raises the estimate no faster than its own uptime (a weaker prior let 33 s
without a failure lift a 60 s prior to 396 s, 16 times the true 25 s, in
``benchmarks/bench_cadence.py``'s real run). Once failures are seen, the failure rate's Gamma
prior has shape :data:`PRIOR_FAILURES` (0.03 of a failure) and mean ``1 / prior_mtbf_s``, so the
posterior mean gives ``M = (0.03 * prior_mtbf_s + uptime) / (0.03 + failures)``
(:func:`estimate_mtbf_s`) and the job's own rate soon dominates: with the one-day default and a
job failing every 20 minutes (1 GiB state), the simulation measured goodput 97.4 % of the best
fixed interval's with a prior counted as a whole failure, 99.27 % with 0.1 and 99.47 % with
0.03. Uptime is the training time of every run recorded there, this one included, and failures
the runs that ended without a snapshot of their last step (killed, failed). It grows as the job
runs without failing.

CheckFreq (Mohan et al., FAST 2021) chooses from the cost only: the most frequent interval
whose stall is at most 3.5 % of the training time, and not before the previous snapshot is
persisted (:func:`checkfreq_interval_s`); ``benchmarks/bench_cadence.py`` compares both.

:class:`Cadence` is called on the training thread: :meth:`Cadence.due` at each step,
:meth:`Cadence.saved` after each save call; the commit future's callback (any thread) records
the time to durable.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: CheckFreq's default bound of the checkpoint stall, a fraction of the training time.
CHECKFREQ_OVERHEAD = 0.035
#: Weight of the prior once failures are seen, in failures (the shape of the failure rate's
#: Gamma prior).
PRIOR_FAILURES = 0.03
#: Default prior mean time between failures (seconds): one failure a day.
DEFAULT_MTBF_S = 24 * 3600.0
_KEPT = 16  # recent samples kept of each measurement


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's interval ``sqrt(2 C M)`` (seconds of training between snapshots)."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval (seconds; see the module docstring): ``M`` when the save
    costs at least ``2M``; never below 0."""
    cost_s = max(cost_s, 0.0)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return max(0.0, math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0)
               - cost_s)


def checkfreq_interval_s(stall_s: float, durable_s: float,
                         overhead: float = CHECKFREQ_OVERHEAD) -> float:
    """CheckFreq's interval: the shortest whose stall is at most ``overhead`` of the training
    time (``stall_s / overhead``), and not shorter than the time to durable (seconds)."""
    return max(stall_s / overhead, durable_s)


def estimate_mtbf_s(prior_mtbf_s: float, *, uptime_s: float, failures: int) -> float:
    """The mean time between failures after ``failures`` in ``uptime_s`` seconds (see the module
    docstring): ``prior + uptime`` before any failure, then with the weak prior
    ``(0.03 * prior + uptime) / (0.03 + failures)``."""
    uptime_s = max(uptime_s, 0.0)
    if failures <= 0:
        return prior_mtbf_s + uptime_s
    return (PRIOR_FAILURES * prior_mtbf_s + uptime_s) / (PRIOR_FAILURES + failures)


def check_mtbf_s(mtbf_s: Any, argument: str = "mtbf_s") -> float:
    """``mtbf_s`` as a float of seconds > 0.

    Raises:
        TypeError: not a number.
        ValueError: not finite or not > 0.
    """
    if isinstance(mtbf_s, bool) or not isinstance(mtbf_s, (int, float)):
        raise TypeError(f"{argument} must be a number of seconds > 0 (the prior mean time "
                        f"between failures, e.g. 86400 for one a day), got {mtbf_s!r}")
    if not math.isfinite(mtbf_s) or mtbf_s <= 0:
        raise ValueError(f"{argument} must be a number of seconds > 0 (the prior mean time "
                         f"between failures, e.g. 86400 for one a day), got {mtbf_s!r}")
    return float(mtbf_s)


@dataclass(frozen=True, kw_only=True)
class AutoInterval:
    """The settings of ``every="auto"`` (``every=AutoInterval(...)`` to change them).

    Args:
        mtbf_s: the prior mean time between failures, seconds (> 0; default one day), used as
            one observed failure until the directory has seen one, then as 0.03 of one
            (:func:`estimate_mtbf_s`), so the directory's own failures soon outweigh it.
        min_steps: the shortest interval, steps (>= 1).
        max_steps: the longest interval, steps (None: unbounded).
        warmup_steps: steps timed before the first snapshot, which measures the save's cost
            (>= 1).

    Raises:
        TypeError, ValueError: a bad value (the argument named, with what is accepted).
    """

    mtbf_s: float = DEFAULT_MTBF_S
    min_steps: int = 1
    max_steps: int | None = None
    warmup_steps: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "mtbf_s", check_mtbf_s(self.mtbf_s))
        for name in ("min_steps", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (steps), got {value!r}")
        top = self.max_steps
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or top < self.min_steps):
            raise ValueError(f"max_steps must be None or an int >= min_steps "
                             f"({self.min_steps}), got {top!r}")


def check_every(every: Any, *, argument: str = "every") -> int | AutoInterval | None:
    """A door's ``every=``: an int >= 1 (steps), ``None``, ``"auto"`` or an
    :class:`AutoInterval` (``"auto"`` gives the default one).

    Raises:
        ValueError: anything else (the argument named, with the accepted values).
    """
    if every is None or isinstance(every, AutoInterval):
        return every
    if every == "auto":
        return AutoInterval()
    if isinstance(every, int) and not isinstance(every, bool) and every >= 1:
        return every
    raise ValueError(f"{argument} must be an int >= 1 (steps), 'auto' (chosen from the "
                     f"measured save cost and failure rate), snapkeep.AutoInterval(mtbf_s=...) "
                     f"or None, got {every!r}")


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One choice of the interval and what it came from (seconds; None where not measured)."""

    interval_steps: int
    interval_s: float | None
    step_s: float | None
    cost_s: float | None
    durable_s: float | None
    restart_s: float | None
    mtbf_s: float
    failures: int
    clamped: bool  # raised to the time to durable

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class History:
    """What :class:`Cadence` reads of the directory's past runs (see
    :class:`snapkeep._core.session.goodput.RunHistory`, which implements it)."""

    def failures(self) -> int:
        return 0

    def uptime_s(self) -> float:
        """Seconds trained by every run recorded, this one included."""
        return 0.0

    def restart_s(self) -> float | None:
        return None


class Cadence:
    """Decides at each step whether a snapshot is due (see the module docstring).

    Args:
        settings: the :class:`AutoInterval`.
        history: the directory's past runs (failures, uptime, restart time); default none.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, settings: AutoInterval, *, history: History | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.history = history if history is not None else History()
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=64)  # seconds per step, no save in it
        self._costs: deque[float] = deque(maxlen=_KEPT)
        self._durable: deque[float] = deque(maxlen=_KEPT)
        self._last: tuple[int, float] | None = None  # step and time of the last tick
        self._saved_at: tuple[int, float, float] | None = None  # step, time, call stall
        self._base: int | None = None  # the step of the newest save (or of the resume)
        self._dirty = False
        self.choice: Choice | None = None

    # -- observations --------------------------------------------------------------------------
    def resumed(self, step: int) -> None:
        """The run resumed from ``step`` (the interval counts from there)."""
        self._base = step

    def tick(self, step: int) -> None:
        """Training reached ``step`` (once per step; a repeated step is ignored)."""
        now = self._clock()
        last = self._last
        if last is not None and step <= last[0]:
            return
        if last is not None:
            per_step = (now - last[1]) / (step - last[0])
            saved = self._saved_at
            if saved is not None and saved[0] == last[0]:  # the save's step: its cost
                typical = self.step_s()
                if typical is not None:
                    excess = (now - last[1]) - typical * (step - last[0])
                    self._costs.append(max(excess, saved[2]))
                else:
                    self._costs.append(saved[2])
                self._saved_at = None
                self._choose()
            else:
                self._steps.append(per_step)
        if self._base is None:
            self._base = step
        self._last = (step, now)

    def saved(self, step: int, *, stall_s: float = 0.0, committed: Any = None) -> None:
        """A snapshot of ``step`` was taken; ``stall_s`` the save call's duration (its lower
        bound of the cost), ``committed`` its commit future (timed when it resolves; a failed
        or cancelled one is not counted)."""
        started = self._last[1] if self._last is not None and self._last[0] == step \
            else self._clock() - stall_s
        self._saved_at = (step, started, max(stall_s, 0.0))
        self._base = step
        if committed is not None:
            def done(future: Any) -> None:
                if not future.cancelled() and future.exception() is None:
                    with self._lock:
                        self._durable.append(self._clock() - started)
                        self._dirty = True  # re-chosen on the training thread
            committed.add_done_callback(done)

    # -- the decision ----------------------------------------------------------------------------
    def step_s(self) -> float | None:
        """Median seconds per step (steps without a save), None before one is timed."""
        return statistics.median(self._steps) if self._steps else None

    def due(self, step: int) -> bool:
        """Whether a snapshot is due at ``step`` (ticks ``step`` first)."""
        self.tick(step)
        base = self._base if self._base is not None else step
        if not self._costs and self._saved_at is None:  # nothing measured: after the warm-up
            return len(self._steps) >= self.settings.warmup_steps and step > base
        choice = self.choice
        if choice is None or self._dirty or self._stale(choice) or step % 64 == 0:
            choice = self._choose()  # as the measurements (and the uptime) change
        return choice is not None and step - base >= choice.interval_steps

    def _stale(self, choice: Choice) -> bool:
        return choice.step_s is None and self.step_s() is not None

    def _choose(self) -> Choice | None:
        """Choose the interval from the measurements now (None before a save was timed)."""
        step_s = self.step_s()
        with self._lock:
            cost = statistics.median(self._costs) if self._costs else None
            durable = max(self._durable) if self._durable else None
            self._dirty = False
        if cost is None:
            return None
        failures = self.history.failures()
        uptime = self.history.uptime_s()
        mtbf = estimate_mtbf_s(self.settings.mtbf_s, uptime_s=uptime, failures=failures)
        return self._set(choose(cost_s=cost, durable_s=durable, step_s=step_s, mtbf_s=mtbf,
                                restart_s=self.history.restart_s(), failures=failures,
                                settings=self.settings))

    def _set(self, choice: Choice) -> Choice:
        self.choice = choice
        return choice


def choose(*, cost_s: float, durable_s: float | None, step_s: float | None, mtbf_s: float,
           restart_s: float | None = None, failures: int = 0,
           settings: AutoInterval = AutoInterval()) -> Choice:
    """The interval for these measurements (seconds): Daly's (see the module docstring), never
    shorter than ``durable_s``, in steps of ``step_s`` (rounded, within ``settings``'s
    bounds; ``min_steps`` while the step time is unknown)."""
    interval = daly_interval_s(cost_s, mtbf_s)
    clamped = durable_s is not None and interval < durable_s
    if durable_s is not None:
        interval = max(interval, durable_s)
    if step_s is None or step_s <= 0:
        steps = settings.min_steps
    else:
        steps = max(settings.min_steps, math.ceil(interval / step_s - 1e-9))
        if settings.max_steps is not None:
            steps = min(steps, settings.max_steps)
    return Choice(interval_steps=steps, interval_s=interval, step_s=step_s, cost_s=cost_s,
                  durable_s=durable_s, restart_s=restart_s, mtbf_s=mtbf_s, failures=failures,
                  clamped=clamped)


__all__ = ["CHECKFREQ_OVERHEAD", "DEFAULT_MTBF_S", "PRIOR_FAILURES", "AutoInterval", "Cadence",
           "Choice", "History", "check_every", "check_mtbf_s", "checkfreq_interval_s", "choose",
           "daly_interval_s", "estimate_mtbf_s", "young_interval_s"]
