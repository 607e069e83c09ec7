"""The job's goodput: its runs in one output directory, and where the wall time went.

A door with ``every="auto"`` records each run (each process that trains in the directory) in
``<out_dir>/.snapkeep/goodput.json`` (rank 0, one atomic write through the storage layer, at
its first step, then at most every :data:`HEARTBEAT_S` seconds, and when it ends): when the process
started and trained its first step, the step it resumed from, its newest step and time, the
time its saves cost the loop, and how it ended. ``snapkeep status DIR`` summarises them
(:func:`summarize`), and :class:`~snapkeep._core.session.cadence.Cadence` reads the failures,
the uptime and the restart time from them (:class:`RunHistory`).

Accounting (seconds), from the first run's first step to the last record:

- ``restart_s``: for each run after the first, from the previous run's last record to this
  run's first step (the time the job was down, the process start, the resume); the previous
  run's training after its last record (at most :data:`HEARTBEAT_S`) is counted here too;
- ``replay_s``: the steps the previous run had reached beyond the step this run resumed from,
  trained again, at the previous run's seconds per step;
- ``save_s``: what the saves cost the loop (the stalls);
- ``trained_s``: the rest: training that counted.

A run counts as a failure when another run followed it and it had not recorded ``finished``
or ``preempted`` (killed, out of memory, a failed loop).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.format.json_records import (
    RecordError,
    int_field,
    number_field,
    parse_json,
    str_field,
)
from snapkeep._core.format.manifest import MANIFEST_DIR
from snapkeep._core.session.cadence import History
from snapkeep._core.storage import Storage

logger = logging.getLogger(__name__)

HISTORY_NAME = "goodput.json"
"""File name of the run history, under ``MANIFEST_DIR`` (``.snapkeep``)."""
FORMAT = 1
#: Seconds between two records of a run between saves (the heartbeat).
HEARTBEAT_S = 10.0
#: Most runs kept (the oldest are dropped), and the largest file read, bytes.
MAX_RUNS = 512
MAX_BYTES = 1 << 20
ENDINGS = ("running", "finished", "preempted", "failed")


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One run (process) in the directory. Times are seconds since the epoch (UTC) or seconds.

    Attributes:
        started_unix_s: the process started (``/proc``; else when the door was created).
        first_unix_s: it trained its first step (None: not yet).
        resumed_step: the step it resumed from (None: a fresh start).
        last_unix_s: its newest record.
        last_step: its newest step.
        step_s: its median seconds per step (None: not measured).
        save_s: what its saves cost the loop.
        saves: how many snapshots it took.
        interval_steps: the interval it chose last (None: not chosen yet).
        ended: ``running`` (or died without a word), ``finished``, ``preempted``, ``failed``.
        pid, host: the process.
    """

    started_unix_s: float
    first_unix_s: float | None = None
    resumed_step: int | None = None
    last_unix_s: float
    last_step: int = 0
    step_s: float | None = None
    save_s: float = 0.0
    saves: int = 0
    interval_steps: int | None = None
    ended: str = "running"
    pid: int = 0
    host: str = ""

    @classmethod
    def parse(cls, raw: Any) -> RunRecord:
        if not isinstance(raw, dict):
            raise RecordError("a run must be an object")
        ended = str_field(raw, "ended", max_chars=16)
        if ended not in ENDINGS:
            raise RecordError(f"field 'ended' must be one of {ENDINGS}, got {ended!r}")

        def maybe(name: str, parse: Any, **bounds: Any) -> Any:
            return None if raw.get(name) is None else parse(raw, name, **bounds)

        return cls(started_unix_s=number_field(raw, "started_unix_s"),
                   first_unix_s=maybe("first_unix_s", number_field),
                   resumed_step=maybe("resumed_step", int_field),
                   last_unix_s=number_field(raw, "last_unix_s"),
                   last_step=int_field(raw, "last_step"),
                   step_s=maybe("step_s", number_field, high=1e9),
                   save_s=number_field(raw, "save_s", high=1e12),
                   saves=int_field(raw, "saves"),
                   interval_steps=maybe("interval_steps", int_field),
                   ended=ended, pid=int_field(raw, "pid", high=1 << 31, default=0),
                   host=str_field(raw, "host", max_chars=1024, default=""))


@dataclass(frozen=True, kw_only=True)
class Goodput:
    """Where the job's wall time went (seconds; see the module docstring).

    Attributes:
        wall_s: from the first run's first step to the newest record.
        trained_s, save_s, restart_s, replay_s: its parts (they add up to ``wall_s``).
        runs: runs recorded; failures: those that died or failed before another run.
        restarts: restart times measured, seconds, oldest first.
        interval_steps: the interval the newest run chose (None: none chosen).
    """

    wall_s: float
    trained_s: float
    save_s: float
    restart_s: float
    replay_s: float
    runs: int
    failures: int
    restarts: tuple[float, ...] = ()
    interval_steps: int | None = None

    @property
    def ratio(self) -> float:
        """``trained_s / wall_s`` (1.0 before any time passed)."""
        return self.trained_s / self.wall_s if self.wall_s > 0 else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "restarts": list(self.restarts), "ratio": self.ratio}


def summarize(runs: list[RunRecord]) -> Goodput:
    """The goodput of ``runs`` (oldest first; see the module docstring)."""
    started = [r for r in runs if r.first_unix_s is not None]
    if not started:
        return Goodput(wall_s=0.0, trained_s=0.0, save_s=0.0, restart_s=0.0, replay_s=0.0,
                       runs=len(runs), failures=0)
    first = started[0].first_unix_s or 0.0
    wall = max(0.0, max(r.last_unix_s for r in started) - first)
    restart = replay = 0.0
    restarts: list[float] = []
    failures = 0
    for before, run in zip(started, started[1:]):
        if before.ended in ("running", "failed"):
            failures += 1
        gap = max(0.0, (run.first_unix_s or run.last_unix_s) - before.last_unix_s)
        restarts.append(gap)
        restart += gap
        if run.resumed_step is not None and before.step_s is not None:
            replay += max(0, before.last_step - run.resumed_step) * before.step_s
        elif run.resumed_step is None and before.step_s is not None:
            replay += max(0, before.last_step) * before.step_s  # started over from scratch
    save = sum(r.save_s for r in started)
    trained = max(0.0, wall - restart - replay - save)
    return Goodput(wall_s=wall, trained_s=trained, save_s=save, restart_s=restart,
                   replay_s=replay, runs=len(runs), failures=failures,
                   restarts=tuple(restarts), interval_steps=started[-1].interval_steps)


def history_path(storage: Storage, directory: str) -> str:
    return storage.join(directory, MANIFEST_DIR, HISTORY_NAME)


def read_runs(storage: Storage, directory: str) -> list[RunRecord]:
    """The runs recorded in ``directory``, oldest first (empty without a history).

    Raises:
        ValueError: the file is not a history as snapkeep writes it (the field named).
        OSError: it could not be read.
    """
    try:
        data = storage.read_bytes(history_path(storage, directory), max_bytes=MAX_BYTES)
    except FileNotFoundError:
        return []
    except OSError as e:
        if e.errno in (errno.EFBIG, errno.EINVAL) and not isinstance(e, SnapshotStorageError):
            raise ValueError(str(e)) from None
        raise
    raw = parse_json(data, max_bytes=MAX_BYTES)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT \
            or not isinstance(raw.get("runs"), list) or len(raw["runs"]) > MAX_RUNS:
        raise ValueError(f"not a snapkeep run history of format {FORMAT} (an object with "
                         f"'format': {FORMAT} and at most {MAX_RUNS} 'runs')")
    return [RunRecord.parse(r) for r in raw["runs"]]


def process_started_unix_s() -> float | None:
    """When this process started (seconds since the epoch), from ``/proc`` (the boot time in
    ``/proc/stat`` plus the start time in ``/proc/self/stat``); None where there is none."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f.read().decode().splitlines()
                        if line.startswith("btime "))
        ticks = int(stat[stat.rfind(")") + 2:].split()[19])
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


class RunHistory(History):
    """This run's record in the directory's history, and the history before it (what
    :class:`~snapkeep._core.session.cadence.Cadence` reads).

    Written by rank 0 only; a history that cannot be read is replaced (logged), one that
    cannot be written is logged, never raised: the snapshots are what matter.

    Args:
        storage, directory: the output directory.
        rank: this rank (only rank 0 writes).
        clock: seconds since the epoch (injected in tests).
    """

    def __init__(self, storage: Storage, directory: str, *, rank: int = 0,
                 clock: Any = time.time) -> None:
        self.storage = storage
        self.directory = directory
        self.rank = rank
        self._clock = clock
        try:
            self.before = read_runs(storage, directory)
        except (ValueError, OSError) as e:
            logger.warning("rank %d: the run history %s cannot be read (%s); starting a new one",
                           rank, history_path(storage, directory), e)
            self.before = []
        now = float(clock())
        started = process_started_unix_s()
        self.run = RunRecord(started_unix_s=min(now, started) if started else now,
                             last_unix_s=now, pid=os.getpid(), host=socket.gethostname())
        self._written = 0.0
        summary = summarize(self.before + [self.run])
        self._failures = summary.failures + (1 if self.before and self.before[-1].ended in (
            "running", "failed") else 0)  # the run before this one, which this one follows
        self._uptime = sum(max(0.0, r.last_unix_s - r.first_unix_s) for r in self.before
                           if r.first_unix_s is not None)
        self._restarts = list(summary.restarts)

    # -- History ---------------------------------------------------------------------------------
    def failures(self) -> int:
        return self._failures

    def uptime_s(self) -> float:
        run = self.run
        now = run.last_unix_s - run.first_unix_s if run.first_unix_s is not None else 0.0
        return self._uptime + max(0.0, now)

    def restart_s(self) -> float | None:
        """The median measured restart time, seconds; this run's own once it trained (its
        start to its first step) when no restart was measured."""
        now = self.restart_now()
        restarts = self._restarts + ([now] if now is not None else [])
        return statistics.median(restarts) if restarts else None

    def restart_now(self) -> float | None:
        """This run's restart: from the previous run's last record (or this process's start)
        to its first step."""
        first = self.run.first_unix_s
        if first is None:
            return None
        since = self.before[-1].last_unix_s if self.before else self.run.started_unix_s
        return max(0.0, first - since)

    # -- this run ----------------------------------------------------------------------------------
    def resumed(self, step: int | None) -> None:
        self.run = replace(self.run, resumed_step=step)

    def step(self, step: int, *, step_s: float | None = None, save_s: float = 0.0,
             saved: bool = False, interval_steps: int | None = None) -> None:
        """Training reached ``step`` (a save of ``save_s`` seconds when ``saved``); written at the
        first step and then at most every :data:`HEARTBEAT_S` seconds (one atomic write with
        an fsync: about 20 ms on the benchmarks' disk, so at most 0.2 % of the training)."""
        now = float(self._clock())
        run = self.run
        self.run = replace(
            run, first_unix_s=run.first_unix_s if run.first_unix_s is not None else now,
            last_unix_s=now, last_step=max(step, run.last_step),
            step_s=step_s if step_s is not None else run.step_s,
            save_s=run.save_s + max(save_s, 0.0), saves=run.saves + (1 if saved else 0),
            interval_steps=interval_steps if interval_steps is not None else run.interval_steps)
        if now - self._written >= HEARTBEAT_S:
            self._write()

    def ended(self, how: str) -> None:
        """Record how the run ended (one of :data:`ENDINGS`)."""
        self.run = replace(self.run, ended=how, last_unix_s=float(self._clock()))
        self._write()

    def summary(self) -> Goodput:
        return summarize(self.before + [self.run])

    def _write(self) -> None:
        self._written = float(self._clock())
        if self.rank != 0:
            return
        runs = (self.before + [self.run])[-MAX_RUNS:]
        data = json.dumps({"format": FORMAT, "runs": [asdict(r) for r in runs]},
                          sort_keys=True).encode()
        try:
            self.storage.makedirs(self.storage.join(self.directory, MANIFEST_DIR))
            self.storage.write_bytes(history_path(self.storage, self.directory), data,
                                     tag="goodput")
        except OSError as e:
            logger.warning("rank %d: could not record the run history in %s: %s", self.rank,
                           self.directory, e)


__all__ = ["ENDINGS", "HEARTBEAT_S", "HISTORY_NAME", "Goodput", "RunHistory", "RunRecord",
           "process_started_unix_s", "read_runs", "summarize"]
