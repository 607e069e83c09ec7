"""The one background lane under every save: single-file writers' saver, sharded commits, the
memory tier's RAM snapshots and the Hugging Face owned save.

:class:`SaveEngine` runs units of background work (a commit, a RAM snapshot, a checkpoint
directory) one at a time, or up to ``max_in_flight`` at once, each on a thread of its own that
ends with it (no idle thread is left between saves), or, for an engine made with
``lane=True``, one after the other on one thread that waits between them until
:meth:`~SaveEngine.close` (``submit`` then returns without waiting for a new thread to be
scheduled: 2-5 ms of a sharded save's stall with 4 ranks on 2 cores). What it guarantees, for
every door alike:

- back-pressure: :meth:`~SaveEngine.submit` waits until fewer than ``max_in_flight`` units run;
- a handle: ``submit`` returns a :class:`concurrent.futures.Future` holding the unit's result or
  its original exception;
- a background failure is logged when it happens and raised once, at the next ``submit``,
  :meth:`~SaveEngine.wait` or :meth:`~SaveEngine.close`: as the original exception, or as what
  the owner's ``wrap`` makes of it (its documented error, the original chained as ``__cause__``);
- :meth:`~SaveEngine.close` waits at most ``timeout_s`` seconds
  (:class:`~snapkeep.errors.SnapshotTimeoutError` after that), then no thread of it is left
  running;
- an engine not closed by the end of the script is drained at interpreter exit by
  :mod:`.exit_drain` (a unit still running is waited for; a failed one is named and the exit
  status is 1).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from snapkeep._core.errors import SnapshotTimeoutError
from snapkeep._core.save.exit_drain import DrainedAtExit

logger = logging.getLogger(__name__)

#: ``wrap(label, error)``: the exception raised for a background failure (default: ``error``).
Wrap = Callable[[str, BaseException], BaseException]
#: ``timeout_message(labels, timeout_s)``: the text of the :class:`SnapshotTimeoutError`.
TimeoutMessage = Callable[[list[str], float], str]


def _same(label: str, error: BaseException) -> BaseException:
    return error


class SaveEngine(DrainedAtExit):
    """A background lane for saves (see the module docstring).

    Args:
        name: what it saves, for thread names and log lines (``'sharded commit'``).
        max_in_flight: most units running at once (>= 1).
        wrap: ``wrap(label, error)`` -> the exception to raise for a failed unit (chained from
            ``error`` when it is another object); default: the original exception.
        timeout_message: ``timeout_message(labels, timeout_s)`` -> the text of the
            :class:`SnapshotTimeoutError` of a wait that ran out.
        drain_at_exit: register with :mod:`.exit_drain` (False for an owner that drains it).
        lane: run the units of :meth:`submit` on one thread kept from the first ``submit``
            until :meth:`close` (``max_in_flight`` must be 1).

    Raises:
        ValueError: ``max_in_flight`` < 1, or > 1 with ``lane``.
    """

    def __init__(self, name: str, *, max_in_flight: int = 1, wrap: Wrap | None = None,
                 timeout_message: TimeoutMessage | None = None,
                 drain_at_exit: bool = True, lane: bool = False) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) \
                or max_in_flight < 1 or (lane and max_in_flight != 1):
            raise ValueError(f"max_in_flight must be an int >= 1 (1 with lane=True), got "
                             f"{max_in_flight!r}")
        self._lane: _Lane | None = _Lane(self) if lane else None
        self.name = name
        self.max_in_flight = max_in_flight
        self._wrap = wrap or _same
        self._timeout_message = timeout_message or (
            lambda labels, t: f"{name}: {labels} still not finished after {t:g} s")
        self._cond = threading.Condition()
        self._running: dict[Unit, str] = {}
        self._started: list[Unit] = []  # joined once their unit ended
        self._errors: collections.deque[tuple[str, BaseException]] = collections.deque()
        self._pid = 0
        self._closed = False
        if drain_at_exit:
            self._drain_at_exit_unless_closed()

    # -- training thread -------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any, label: str,
               timeout_s: float | None = None) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` in the background once fewer than ``max_in_flight`` units run.

        Args:
            label: what the unit saves (a path, ``'RAM snapshot of step 7'``), for messages.
            timeout_s: bound on the wait for a free lane (None: unbounded).

        Returns:
            The unit's future: its result, or its original exception.

        Raises:
            Exception: an earlier unit's failure, once (see ``wrap``).
            SnapshotTimeoutError: no lane freed within ``timeout_s``.
            RuntimeError: the engine is closed.
        """
        while True:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed; create a new one to save again")
            self._wait_until(lambda: len(self._running) < self.max_in_flight, timeout_s)
            self._join_ended()
            self.raise_pending_error()
            unit = self.unit(fn, *args, label=label)
            with self._cond:  # the lane taken in the same hold as the check: two threads
                # submitting at once never both take the last one
                if not self._closed and len(self._running) < self.max_in_flight:
                    self._running[unit] = unit.label
                    break
        if self._lane is not None:
            self._lane.run_next(unit)
        else:
            unit.start()
        return unit.future

    def unit(self, fn: Callable[..., Any], *args: Any, label: str) -> Unit:
        """A unit not started yet, for an owner whose own bookkeeping bounds what runs (the
        saver's slots): a ``threading.Thread`` (what ppe's ``ThreadWriter.create_worker``
        returns) that runs ``fn(*args)`` on this engine once started: counted in flight, its
        failure kept, drained at close; no wait for a free lane."""
        return Unit(self, fn, args, label)

    def _started_unit(self, unit: Unit, *, thread: bool = True) -> None:
        with self._cond:
            self._running[unit] = unit.label
            if thread:
                self._started.append(unit)

    def _ended_unit(self, unit: Unit, error: BaseException | None) -> None:
        if error is not None:  # kept, raised once on the training thread
            logger.error("snapkeep: %s: %s failed in the background: %s: %s", self.name,
                         unit.label, type(error).__name__, error)
        with self._cond:
            if error is not None:
                self._errors.append((unit.label, error))
            self._running.pop(unit, None)
            self._cond.notify_all()

    def record_error(self, label: str, error: BaseException) -> None:
        """Keep a failure the owner caught itself (a save whose error it handled on the unit's
        thread) to be raised once like a unit's."""
        with self._cond:
            self._errors.append((label, error))

    @property
    def busy(self) -> bool:
        """Whether a unit is running."""
        with self._cond:
            return bool(self._running)

    def pending_paths(self) -> list[str]:
        """Labels of the units running, then of the failures not raised yet (what the exit drain
        names)."""
        with self._cond:
            return list(self._running.values()) + [label for label, _ in self._errors]

    def join(self, timeout_s: float | None = None) -> None:
        """Wait until no unit runs; a failure stays kept (raised by :meth:`wait`, the next
        ``submit`` or :meth:`close`).

        Raises:
            SnapshotTimeoutError: still running after ``timeout_s`` seconds (they go on).
        """
        self._wait_until(lambda: not self._running, timeout_s)
        self._join_ended()

    def wait(self, timeout_s: float | None = None) -> None:
        """:meth:`join`, then raise a failure not raised yet (once).

        Raises:
            SnapshotTimeoutError: still running after ``timeout_s`` seconds (they go on).
            Exception: a unit's failure (see ``wrap``).
        """
        self.join(timeout_s)
        self.raise_pending_error()

    def _wait_until(self, ready: Callable[[], bool], timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not ready():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise SnapshotTimeoutError(self._timeout_message(
                        list(self._running.values()), float(timeout_s or 0.0)))
                self._cond.wait(remaining)

    def _join_ended(self) -> None:
        """Join the threads whose unit ended (each is past its last line, or nearly)."""
        with self._cond:
            ended = [t for t in self._started if t not in self._running]
            self._started = [t for t in self._started if t in self._running]
        for thread in ended:
            thread.join()

    def take_errors(self) -> list[tuple[str, BaseException]]:
        """The failures not raised yet, as ``(label, original exception)``, oldest first; they
        will not be raised (for an owner that logs them instead)."""
        with self._cond:
            errors = list(self._errors)
            self._errors.clear()
        return errors

    def raise_pending_error(self) -> None:
        """Raise the oldest failure not raised yet, once (see ``wrap``); log any others."""
        errors = self.take_errors()
        if not errors:
            return
        for label, other in errors[1:]:
            logger.error("snapkeep: %s: another background failure (%s): %s: %s", self.name,
                         label, type(other).__name__, other)
        label, cause = errors[0]
        error = self._wrap(label, cause)
        if error is cause:
            raise cause
        raise error from cause

    # -- end -------------------------------------------------------------------------------------
    def close(self, timeout_s: float | None = None, *, wait: bool = True) -> None:
        """Wait for the units running (at most ``timeout_s`` seconds, None: unbounded), then raise
        a failure not raised yet. Idempotent; closed also when it raises. No thread of the
        engine runs after it returned (a unit that outlived the timeout finishes on its own).

        Args:
            wait: False closes at once, for an owner that waited by its own bookkeeping (the
                saver's slots) and raises the failures itself (:meth:`raise_pending_error`).

        Raises:
            SnapshotTimeoutError: still running after ``timeout_s``.
            Exception: a unit's failure (see ``wrap``).
        """
        if self._closed:
            return
        try:
            if wait:
                self.wait(timeout_s)
        finally:
            self._mark_closed()
            self._join_ended()
            if self._lane is not None:
                self._lane.stop()


class Unit(threading.Thread):
    """One unit of background work on a :class:`SaveEngine` (see :meth:`SaveEngine.unit`): a
    daemon thread named ``snapkeep-<engine name>``; ``future`` holds its result or its original
    exception."""

    def __init__(self, engine: SaveEngine, fn: Callable[..., Any], args: tuple[Any, ...],
                 label: str) -> None:
        super().__init__(name=f"snapkeep-{engine.name.replace(' ', '-')}", daemon=True)
        self.engine, self.label = engine, label
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._fn, self._args = fn, args

    def start(self) -> None:
        self.engine._started_unit(self)
        try:
            super().start()
        except BaseException as e:  # no thread: nothing in flight
            self.engine._ended_unit(self, None)
            self.future.set_exception(e)
            raise

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():  # cancelled before it ran
            self._fn = self._args = None  # type: ignore[assignment]
            self.engine._ended_unit(self, None)
            return
        error: BaseException | None = None
        try:
            result = self._fn(*self._args)
        except BaseException as e:
            error = e
            self.future.set_exception(e)
        else:
            self.future.set_result(result)
        finally:
            self._fn = self._args = None  # type: ignore[assignment]  # staged copies: freed
            self.engine._ended_unit(self, error)


class _Lane:
    """The one thread of a ``lane=True`` engine: runs each unit given to :meth:`run_next` in
    turn (at most one is queued: the engine's back-pressure waited for the previous one);
    started at the first unit, ended by :meth:`stop`, and again at the next unit in a process
    forked since (a thread does not survive ``fork``)."""

    def __init__(self, engine: SaveEngine) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._next: Unit | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._stopping = False

    def run_next(self, unit: Unit) -> None:
        """Run ``unit`` next (taken by :meth:`SaveEngine.submit`).

        Raises:
            RuntimeError: the engine was closed meanwhile (the unit never runs)."""
        self._engine._started_unit(unit, thread=False)
        with self._cond:
            if self._stopping:  # closed since submit took the lane
                self._engine._ended_unit(unit, None)
                unit.future.set_exception(RuntimeError(f"{self._engine.name}: closed"))
                raise RuntimeError(f"{self._engine.name}: closed; create a new one to save again")
            self._next = unit
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._loop, name=f"snapkeep-{self._engine.name.replace(' ', '-')}",
                    daemon=True)
                try:
                    self._thread.start()
                except BaseException as e:  # no thread: nothing in flight
                    self._next, self._thread = None, None
                    self._engine._ended_unit(unit, None)
                    unit.future.set_exception(e)
                    raise
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._stopping:
                    self._cond.wait()
                unit, self._next = self._next, None
                if unit is None:
                    return
            try:
                unit.run()  # keeps its own failure; nothing else may end the lane
            except BaseException as e:  # noqa: BLE001
                logger.error("snapkeep: %s: the lane outlived an error of its own: %s: %s",
                             self._engine.name, type(e).__name__, e)

    def stop(self) -> None:
        """End the thread once its unit (if any) ended; wait for that only when the engine
        waited for its units (a unit past a close's timeout finishes on its own)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread() \
                and self._pid == os.getpid() and not self._engine.busy:
            thread.join()


__all__ = ["SaveEngine", "TimeoutMessage", "Unit", "Wrap"]
