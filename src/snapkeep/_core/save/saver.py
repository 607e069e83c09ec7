"""The saver: staging, back-pressure, commit, retention and error surfacing for one writer.

The save path, top to bottom: :meth:`Saver.submit` (back-pressure, stage) -> :meth:`Saver.run`
(``store.commit_job`` through the runner, in whichever thread or process it runs; when a worker
process dies before reporting the commit, the trainer writes the same staged copy itself) -> the
retention stage of the save (:class:`~snapkeep._core.store.files.Retain`: ``store.retain``, in the
trainer process) -> post-commit hooks (ppe's ``_add_cleanup_hook``) -> the slot is released.

``submit(job, tree)`` waits for a free buffer set (back-pressure), stages ``tree`` into it and
returns a :class:`Ticket` whose :class:`SaveHandle` has two futures: ``staged`` (resolved before
``submit`` returns: training may mutate the state now) and ``committed`` (durable). Whoever
executes the ticket (the caller for a synchronous writer, a writer thread, a queue consumer that
forwards to the worker process) calls ``run(ticket)``. A synchronous save is the same path plus
running the ticket at once.

Back-pressure: at most ``max_pending`` snapshots are staged or being written at once, each
holding one reusable buffer set (so memory is bounded by ``max_pending`` copies of the state). When
all are busy, ``on_full`` decides:

- ``'block'`` (default): wait for a slot; a log line every ``warn_after_s`` names the snapshot being
  waited on; ``timeout_s`` bounds the wait with :class:`SnapshotTimeoutError`.
- ``'skip'``: drop the new snapshot (logged) and return ``None``.
- ``'replace'``: drop the oldest snapshot that has not started writing (logged) and take its slot;
  when every pending snapshot is already being written, block as ``'block'``.

A snapshot in flight (handle, slot, ticket) is :mod:`.ticket`.

Lending (:meth:`Saver.lend`): a slot keeps its staged copy after the commit, until it is staged
again; a second reader of the same state at the same step (the memory tier) borrows it instead
of staging a second copy, and the slot is not staged again while the loan is out (a snapshot
that needs it waits, as for a slot still being written, whatever ``on_full``: a lent slot holds
no snapshot in flight, so ``'skip'`` and ``'replace'`` drop nothing for it).

Staging budget (``staging_budget``, bytes): a snapshot whose tensors exceed it is staged and
written in pieces through a ring of that size instead of a full copy (see :mod:`.budget`); the
writer that dispatched the ticket then waits in :meth:`await_call` for the part the budget cannot
hide. Needs an in-process runner (a thread); such snapshots are never lent.

Errors: a failed background save is raised once, as :class:`SnapshotSaveError` with the original
exception as ``__cause__``, at the next ``save()`` or at ``finalize()``; later saves still run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from snapkeep._core.errors import (
    SnapshotError,
    SnapshotSaveError,
    SnapshotStorageError,
    SnapshotTimeoutError,
    StagingRaceError,
    WorkerDiedError,
)
from snapkeep._core.load.preflight import check_timeout_s
from snapkeep._core.save.budget import (
    BudgetStats,
    Ring,
    build_stream,
    check_staging_budget,
    tensor_bytes,
)
from snapkeep._core.save.commit import commit_job
from snapkeep._core.save.engine import SaveEngine
from snapkeep._core.save.executors import Runner
from snapkeep._core.save.exit_drain import DrainedAtExit
from snapkeep._core.save.job import CommitRecord, SaveJob
from snapkeep._core.save.overlap import PendingVerdict
from snapkeep._core.save.staging import BufferSet, StageStats
from snapkeep._core.save.ticket import SaveHandle, Slot, StagedLoan, Ticket
from snapkeep._core.store.files import Retain

logger = logging.getLogger(__name__)

PostCommitHook = Callable[[CommitRecord], None]

ON_FULL_POLICIES = ("block", "skip", "replace")


class Saver(DrainedAtExit):
    """Stages, queues and commits snapshots for one writer (see module docstring).

    Args:
        runner: where jobs run (inline, thread, process).
        max_pending: most snapshots staged or in flight at once (>= 1).
        on_full: ``'block'``, ``'skip'`` or ``'replace'``.
        timeout_s: bound on a blocked ``save`` waiting for a slot, and on ``finalize``; ``None``
            waits as long as the worker is alive, logging every ``warn_after_s`` seconds.
        warn_after_s: interval of the "still waiting" log line, seconds.
        stage: copy the state before returning (True for background runners). A synchronous
            runner writes the caller's objects directly.
        staging_budget: most bytes of host memory a snapshot's staging may hold (see
            :mod:`.budget`); None: a full copy of the state per snapshot in flight.

    Raises:
        ValueError: ``max_pending`` < 1, an unknown ``on_full``, or a bad ``staging_budget``
            (also for a runner in another process).
    """

    def __init__(
        self, runner: Runner, *, max_pending: int = 1, on_full: str = "block",
        timeout_s: float | None = None, warn_after_s: float = 30.0, stage: bool | None = None,
        staging_budget: int | None = None,
    ) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        if on_full not in ON_FULL_POLICIES:
            raise ValueError(f"on_full must be one of {ON_FULL_POLICIES}, got {on_full!r}")
        check_timeout_s(timeout_s, none_ok=True)
        self.staging_budget = check_staging_budget(staging_budget)
        if self.staging_budget is not None and not runner.in_process:
            raise ValueError(
                "staging_budget is for writers that write on a thread of the training process "
                "(ThreadWriter, the doors' default, ThreadQueueWriter); a process writer "
                "reads a full staged copy from shared memory. Pass staging_budget=None or use "
                "ThreadWriter(staging_budget=...)")
        self._ring: Ring | None = None
        self._streams: set[Any] = set()  # budgeted snapshots whose stager may still run
        self.last_budget_stats: BudgetStats | None = None
        self.runner = runner
        self.max_pending = max_pending
        self.on_full = on_full
        self.timeout_s = timeout_s
        self.warn_after_s = warn_after_s
        self._stage = runner.background if stage is None else stage
        self._slots: list[Slot] = []
        self._cond = threading.Condition()
        #: where the writers' background saves run (ThreadWriter's threads, ProcessWriter's
        #: dispatch to its worker) and where a failure is kept until raised once; the slots
        #: below bound what runs, this saver drains it (at close, and at interpreter exit)
        self.engine = SaveEngine("writer", drain_at_exit=False)
        self._hooks: list[PostCommitHook] = []
        self.last_stage_stats: StageStats | None = None
        self._prefaulted = threading.Event()  # clear while a prefault thread fills a slot
        self._prefaulted.set()
        self._prefault_thread: threading.Thread | None = None
        self._next_overlap: Any = None  # an OverlapPlan for the next submit (overlap.py)
        self._verdicts: list[PendingVerdict] = []  # overlapped snapshots not validated yet
        self._drain_at_exit_unless_closed()  # committed at interpreter exit if still pending

    # -- public ----------------------------------------------------------------------------------
    def add_post_commit_hook(self, hook: PostCommitHook) -> None:
        """Run ``hook(record)`` after each commit, in the trainer process, on the dispatch thread
        (caller's thread for inline runners). A failing hook is logged, never fatal."""
        self._hooks.append(hook)

    def submit(self, job: SaveJob, tree: Any, *, retain: Retain | None = None,
               incremental: Any = None) -> Ticket | None:
        """Reserve a slot (per ``on_full``), stage ``tree`` into it and return the ticket.

        ``retain``: the retention stage run after the commit (the store, policy and lineage).
        ``incremental``: the :class:`~snapkeep._core.tiers.incremental.IncrementalPlan` of an
        incremental snapshot (``tree`` is the plan's tree): confirmed before the write and
        finished when the save ends, whichever way (see :meth:`run`). Its staged copy is never
        lent (it lacks the unchanged tensors).

        Returns ``None`` when the snapshot was skipped (``on_full='skip'``).

        Raises:
            SnapshotSaveError: an earlier background save failed (raised once).
            SnapshotTimeoutError: no slot freed within ``timeout_s``.
            RuntimeError: the saver is closed.
        """
        if self._closed:
            raise RuntimeError("this writer is finalized; create a new writer to save again")
        plan, self._next_overlap = self._next_overlap, None
        self.settle_overlap()  # a safe point: the previous snapshot's verdict first
        self.raise_pending_error()
        check = getattr(self.runner, "check_sendable", None)
        if check is not None and self._stage:  # a process worker: refuse what it cannot receive
            check(job, tree)
        handle = SaveHandle(path=job.path, step=job.step)
        if incremental is not None:  # in flight until it ends, whichever way
            handle.committed.add_done_callback(lambda f: incremental.finish(
                None if f.cancelled() or f.exception() is not None else f.result()))
        slot = self._acquire_slot(handle)
        if slot is None:
            handle.committed.cancel()
            return None
        try:
            # a save that failed while this call waited for its slot surfaces now, not one
            # call later
            self.raise_pending_error()
            self._wait_prefault()
            deferred = None
            stream = self._stream_for(job, tree, plan) if incremental is None else None
            if stream is not None:
                job = dataclasses.replace(job, savefun=stream.savefun)
                staged, stats = stream.skeleton, _no_stats()
                if stream.members:
                    deferred = stream
                with self._cond:
                    self._streams.add(stream)
                stream.start()
            elif self._stage and plan is not None:
                staged, stats, deferred = plan.stage(slot.buffers, tree)
            else:
                staged, stats = slot.buffers.stage(tree) if self._stage else (tree, _no_stats())
        except SnapshotStorageError as e:  # staging memory (a process writer's arena)
            handle.committed.cancel()
            self._release(slot, handle)
            raise SnapshotStorageError(f"snapshot {job.path}: {e}", errno=e.errno,
                                       filename=e.filename, size_bytes=e.size_bytes) from e
        except BaseException:
            handle.committed.cancel()
            self._release(slot, handle)
            raise
        self.last_stage_stats = stats
        if stream is not None:
            stream.verdict_wait = None if deferred is None else (
                lambda: handle.verdict.wait(self.timeout_s, self.warn_after_s))
        elif self._stage and incremental is None:  # kept for a loan until staged again
            with self._cond:
                slot.holds, slot.staged = handle, staged
        if deferred is None:
            if stream is None:
                handle.staged.set_result(stats)
        else:
            verdict = handle.verdict = PendingVerdict(handle, deferred, plan.on_race)
            with self._cond:
                self._verdicts.append(verdict)
            verdict.start()
        return Ticket(slot=slot, handle=handle, job=job, staged=staged, retain=retain,
                      incremental=incremental, stream=stream)

    def await_call(self, ticket: Ticket) -> None:
        """For a budgeted snapshot (:mod:`.budget`), called on the training thread once the
        ticket was handed to whoever writes it: wait until every storage that no guarded
        optimizer protects is staged (the stall the budget cannot hide). Nothing for other
        snapshots. A stream that failed meanwhile returns at once (its error is the save's).

        Raises:
            SnapshotTimeoutError: not staged within ``timeout_s``.
        """
        stream = ticket.stream
        if stream is None:
            return
        stream.wait_call(self.timeout_s)
        if ticket.handle.verdict is None and not ticket.handle.staged.done():
            ticket.handle.staged.set_result(StageStats(
                tensor_bytes=stream.stats.state_bytes if stream.stats else 0,
                allocated_bytes=0, num_storages=0))

    def _stream_for(self, job: SaveJob, tree: Any, plan: Any) -> Any:
        """The :class:`~snapkeep._core.save.budget.Stream` of a budgeted snapshot, or None (no
        budget, nothing staged, or the state's tensors fit the budget).

        Raises:
            ValueError: a budget with a ``savefun`` other than ``torch.save`` or append mode.
        """
        if self.staging_budget is None or not self._stage:
            return None
        from snapkeep._core.format.codec import record_alignment, torch_save

        if job.append or job.savefun not in (torch.save, torch_save) or job.savefun_kwargs:
            raise ValueError(
                "staging_budget streams torch.save files: the writer's savefun must be "
                f"torch.save (got {job.savefun!r}, kwargs {job.savefun_kwargs!r}) and append "
                "False; pass staging_budget=None to stage a full copy for another savefun")
        base = torch.serialization._get_storage_alignment()  # type: ignore[attr-defined]
        return build_stream(tree, budget_bytes=self.staging_budget, ring_for=self._ring_for,
                            plan=plan, previous=self.last_budget_stats,
                            alignment=lambda skeleton: record_alignment(skeleton, base))

    def _ring_for(self, size: int) -> Ring:
        """This saver's ring (one for all its streams), made at the first budgeted snapshot."""
        with self._cond:
            if self._ring is None:
                self._ring = Ring(size)
            return self._ring

    def overlap_next(self, plan: Any) -> None:
        """Stage the next :meth:`submit` (same thread) per ``plan``
        (:class:`snapkeep._core.save.overlap.OverlapPlan`): part now, the rest in the background.
        ``handle.staged`` resolves when that copy has been validated at a safe point
        (:meth:`settle_overlap`), and the write waits for it."""
        self._next_overlap = plan

    def settle_overlap(self, *, block: bool = True) -> None:
        """A safe point for overlapped staging (see :mod:`snapkeep._core.save.overlap`), called on
        the training thread: give the verdict of every overlapped snapshot whose copy is done
        (``block``: wait for the copies first, bounded by ``timeout_s``). A snapshot whose
        counters moved is dropped; each plan's ``on_race`` is then called (all verdicts are
        given first).

        Raises:
            StagingRaceError: from an ``on_race`` (``None`` raises).
            SnapshotTimeoutError: ``block`` and a copy not done within ``timeout_s``.
        """
        with self._cond:
            verdicts = list(self._verdicts)
        races = []
        try:
            for verdict in verdicts:
                race = verdict.settle(block=block, timeout_s=self.timeout_s)
                if race is not None:
                    races.append((verdict.on_race, race))
        finally:
            with self._cond:
                self._verdicts = [v for v in self._verdicts if not v.settled]
        for on_race, race in races:
            if on_race is None:
                raise race
            on_race(race)

    def wait(self, timeout_s: float | None = None) -> None:
        """Settle overlapped snapshots (:meth:`settle_overlap`), then wait until nothing is
        pending.

        Raises:
            SnapshotTimeoutError: still pending after ``timeout_s`` seconds.
            StagingRaceError: as :meth:`settle_overlap`.
        """
        self.settle_overlap()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while any(s.handle is not None for s in self._slots):
                if not self._wait_step(deadline, "all pending snapshots"):
                    pending = [s.handle.path for s in self._slots if s.handle is not None]
                    raise SnapshotTimeoutError(
                        f"snapshots {pending} still not committed after {timeout_s} s"
                    )

    @property
    def pending(self) -> int:
        with self._cond:
            return sum(1 for s in self._slots if s.handle is not None)

    def pending_paths(self) -> list[str]:
        """Paths of the snapshots staged or being written, oldest slot first."""
        with self._cond:
            return [s.handle.path for s in self._slots if s.handle is not None]

    def save_now(self, job: SaveJob, tree: Any, *, retain: Retain | None = None) -> CommitRecord:
        """Synchronous save: ``submit`` + ``run`` in the caller's thread; raises its error."""
        ticket = self.submit(job, tree, retain=retain)
        if ticket is None:
            raise SnapshotError(f"snapshot {job.path!r} was skipped")
        self.run(ticket, report=False)
        return ticket.handle.committed.result()

    def lend(self, handle: SaveHandle) -> StagedLoan | None:
        """Lend the staged copy of ``handle``'s snapshot (see :class:`StagedLoan`, which says
        why reading it is safe), whether it is still being written or already committed.

        Returns None when there is nothing to lend: a saver that does not stage
        (``SimpleWriter`` writes the caller's own objects), a closed one, a snapshot skipped or
        whose staging failed, or a copy already staged over by a later snapshot.
        """
        with self._cond:
            if not self._stage or self._closed:
                return None
            slot = next((s for s in self._slots if s.holds is handle and s.staged is not None),
                        None)
            if slot is None:
                return None
            slot.loans += 1
            tree = slot.staged
        returned = threading.Event()

        def release() -> None:
            with self._cond:
                if returned.is_set():
                    return
                returned.set()
                slot.loans -= 1
                close = slot.close_when_returned and slot.loans == 0
                self._cond.notify_all()
            if close:
                _close_buffers(slot)

        return StagedLoan(tree=tree, handle=handle, _release=release,
                          _timeout_s=self.timeout_s, _warn_after_s=self.warn_after_s)

    def raise_pending_error(self) -> None:
        """Raise the oldest unreported background failure, once; log any others."""
        self.engine.raise_pending_error()

    def close(self, timeout_s: float | None = None, *, wait: bool = True) -> None:
        """Wait for pending snapshots, stop the background thread and worker; idempotent.

        Args:
            timeout_s: bound on the wait (default: the saver's ``timeout_s``).
            wait: False closes at once, after a wait that already timed out: the worker is
                stopped and a still-running thread save finishes on its own.

        Raises:
            SnapshotSaveError: a background save failed and was not reported yet.
            SnapshotTimeoutError: pending snapshots did not commit within ``timeout_s``.
        """
        if self._closed:
            return
        try:
            if wait:
                self.wait(timeout_s if timeout_s is not None else self.timeout_s)
        finally:
            self._mark_closed()
            self._prefaulted.wait()  # a bounded memset; its buffers are closed next
            # ... and the thread itself ended: a daemon thread still unwinding when the
            # interpreter exits is stopped inside torch's C++ frames, and the process aborts
            # ("terminate called without an active exception", exit 134) after a clean close
            if self._prefault_thread is not None:
                self._prefault_thread.join()
                self._prefault_thread = None
            with self._cond:  # a background staging copy (bounded) as well
                copies = [v.copied for v in self._verdicts]
            concurrent.futures.wait(copies)
            with self._cond:  # never validated (closed without a wait): never written
                unsettled, self._verdicts = self._verdicts, []
            for verdict in unsettled:
                verdict.drop(SnapshotError(
                    f"snapshot {verdict.handle.path!r} was not written: the writer was closed "
                    "before its background copy was validated"))
            self.runner.close()
            self.engine.close(wait=False)  # the slots were waited for above
            with self._cond:
                lent = [s for s in self._slots if s.loans]
                for slot in lent:  # closed by the last return of a loan
                    slot.close_when_returned = True
            for slot in self._slots:
                if slot not in lent:
                    _close_buffers(slot)
            with self._cond:
                streams, self._streams = list(self._streams), set()
            for stream in streams:  # no stager copies into the ring once it is unmapped
                stream.close()
            if self._ring is not None:
                self._ring.close()
                self._ring = None
            with self._cond:  # a closed saver keeps no staging copies of the state
                for slot in self._slots:
                    slot.holds = slot.staged = None
                self._slots = [s for s in self._slots if s.handle is not None]
        self.raise_pending_error()

    def prefault_async(self, tree: Any) -> None:
        """Allocate and fault in the first slot's staging buffers for a tree shaped like
        ``tree`` in a background thread (see :mod:`snapkeep._core.save.prefault`); a snapshot
        arriving meanwhile waits for it. Does nothing for a saver that does not stage, a closed
        one, or while a snapshot holds the slot. A failure is logged (the snapshot that follows
        reports its own)."""
        from snapkeep._core.save.staging import prefault

        if self.staging_budget is not None and tensor_bytes(tree) > self.staging_budget:
            return  # streamed through the ring: a full set of buffers would break the budget
        with self._cond:
            if not self._stage or self._closed or not self._prefaulted.is_set():
                return
            if not self._slots:
                self._slots.append(Slot(buffers=self._new_buffers()))
            slot = self._slots[0]
            if slot.handle is not None or slot.loans:
                return
            slot.holds = slot.staged = None  # its buffers are written next
            self._prefaulted.clear()

        def work() -> None:
            try:
                nbytes = prefault(slot.buffers, tree)
                logger.debug("prefaulted %d bytes of staging buffers", nbytes)
            except (TypeError, RuntimeError, MemoryError, OSError) as e:
                logger.warning("could not prepare staging buffers before the first snapshot "
                               "(%s: %s); the first snapshot allocates them", type(e).__name__, e)
            finally:
                self._prefaulted.set()

        thread = threading.Thread(target=work, name="snapkeep-prefault", daemon=True)
        self._prefault_thread = thread
        thread.start()

    def _wait_prefault(self) -> None:
        if not self._prefaulted.wait(self.timeout_s):
            raise SnapshotTimeoutError(
                f"staging buffers were still being prepared after {self.timeout_s} s")

    # -- internals ------------------------------------------------------------------------------
    def _acquire_slot(self, handle: SaveHandle) -> Slot | None:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                for slot in self._slots:
                    if slot.handle is None and not slot.loans:
                        slot.handle, slot.started = handle, False
                        slot.holds = slot.staged = None  # staged over next
                        return slot
                if len(self._slots) < self.max_pending:
                    slot = Slot(buffers=self._new_buffers(), handle=handle)
                    self._slots.append(slot)
                    return slot
                # a slot only lent (its snapshot committed) frees within a bounded serialisation:
                # wait for it; skip (and replace) only for snapshots still in flight
                only_lent = any(s.handle is None for s in self._slots)
                if self.on_full == "skip" and not only_lent:
                    busy = [s.handle.path for s in self._slots if s.handle is not None]
                    logger.warning(
                        "skipping snapshot %s (step %s): %d snapshot(s) still in flight %s "
                        "(on_full='skip')", handle.path, handle.step, len(busy), busy)
                    return None
                if self.on_full == "replace" and not only_lent:
                    for slot in self._slots:
                        old = slot.handle
                        if old is not None and not slot.started and not slot.loans \
                                and old.committed.cancel():
                            # its queued ticket is skipped by the dispatcher (cancelled future)
                            logger.warning(
                                "replacing pending snapshot %s (step %s) by %s (step %s) "
                                "(on_full='replace')", old.path, old.step, handle.path,
                                handle.step)
                            slot.handle = handle
                            slot.holds = slot.staged = None
                            return slot
                if not self._wait_step(deadline, handle.path):
                    busy = [s.handle.path for s in self._slots if s.handle is not None]
                    lent = [s.holds.path for s in self._slots
                            if s.handle is None and s.loans and s.holds is not None]
                    raise SnapshotTimeoutError(
                        f"snapshot {handle.path!r} waited {self.timeout_s} s for a slot: "
                        f"{self.max_pending} earlier snapshot(s) still writing {busy}"
                        + (f", or with their staged copy {lent} lent to the memory tier"
                           if lent else "")
                        + "; raise timeout_s or max_pending, or use on_full='skip'"
                    )

    def _wait_step(self, deadline: float | None, what: str) -> bool:
        """One bounded wait on the condition; False when the deadline passed. Caller holds it."""
        start = time.monotonic()
        step = self.warn_after_s
        if deadline is not None:
            remaining = deadline - start
            if remaining <= 0:
                return False
            step = min(step, remaining)
        if not self._cond.wait(timeout=step):
            waited = time.monotonic() - start
            busy = [s.handle.path for s in self._slots if s.handle is not None]
            lent = [s.holds.path for s in self._slots if s.loans and s.holds is not None]
            logger.warning("still waiting for snapshot(s) %s to commit%s before %s (%.0f s)",
                           busy, f" and for the staged copies of {lent} lent to another "
                           "reader (the memory tier)" if lent else "", what, waited)
        return deadline is None or time.monotonic() < deadline

    def _release(self, slot: Slot, handle: SaveHandle) -> None:
        with self._cond:
            if slot.handle is handle:
                slot.handle = None
                slot.started = False
            self._cond.notify_all()

    def _new_buffers(self) -> BufferSet:
        if self.runner.in_process:
            return BufferSet()
        from snapkeep._core.save.shm import SharedArena

        return BufferSet(SharedArena())

    def run(
        self, ticket: Ticket, *, report: bool = True,
        execute: Callable[[Any], CommitRecord | None] | None = None,
    ) -> bool:
        """Execute a ticket: write, commit, release its slot, run hooks.

        Args:
            ticket: from :meth:`submit`.
            report: keep a failure for :meth:`raise_pending_error` (background saves).
            execute: run ``execute(staged)`` instead of the runner (a user-supplied queue task);
                it may return a :class:`CommitRecord` or ``None``.

        Returns:
            True when committed, False when it failed or was replaced. The outcome is always set
            on ``ticket.handle.committed``.
        """
        slot, handle = ticket.slot, ticket.handle
        with self._cond:
            if not handle.committed.set_running_or_notify_cancel():
                if ticket.stream is not None:
                    ticket.stream.close()
                return False  # replaced while queued; its slot was already handed over
            slot.started = True
        staged = ticket.staged
        try:
            return self._run(ticket, staged, execute, report)
        finally:
            if ticket.stream is not None:  # whichever way it ended: the ring is free again
                ticket.stream.close()
                with self._cond:
                    self._streams.discard(ticket.stream)
                if ticket.stream.stats is not None:
                    self.last_budget_stats = ticket.stream.stats

    def _run(self, ticket: Ticket, staged: Any,
             execute: Callable[[Any], CommitRecord | None] | None, report: bool) -> bool:
        slot, handle, job = ticket.slot, ticket.handle, ticket.job
        try:
            if ticket.stream is not None and execute is not None:
                raise ValueError("a budgeted snapshot (staging_budget) is written by snapkeep's "
                                 "own commit; a custom queue task cannot write it")
            if handle.verdict is not None and ticket.stream is None:
                # overlapped staging: nothing before the verdict
                handle.verdict.wait(self.timeout_s, self.warn_after_s)
            if ticket.incremental is not None:  # unchanged tensors hashed against their blobs
                if execute is not None:
                    raise ValueError("an incremental snapshot is written by snapkeep's own "
                                     "commit; a custom queue task cannot write it")
                ticket.incremental.confirm()
            if execute is not None:
                record = execute(staged) or CommitRecord(
                    path=job.path, size_bytes=0, checksum=None, write_s=0.0, step=job.step)
            elif self.runner.in_process:
                record = self.runner.run(job, staged, None, None)
            else:
                arena: Any = slot.buffers.allocator  # a SharedArena for out-of-process runners
                skeleton, table = arena.export(staged)
                forget = getattr(self.runner, "forget_arenas", None)
                if forget is not None:  # arenas replaced when the state grew: unmap them
                    forget({n for s in list(self._slots)
                            if (n := getattr(s.buffers.allocator, "name", None))})
                try:
                    record = self.runner.run(job, skeleton, arena.name, table)
                except WorkerDiedError as died:
                    if self._closed:  # finalize stopped the worker after its wait ran out
                        raise WorkerDiedError(f"{died}; the writer was finalized, so that "
                                              "snapshot was not committed") from died
                    record = _write_in_trainer(job, staged, died)
        except StagingRaceError as e:  # dropped; the run was told at the verdict
            logger.info("snapshot %s (step %s) dropped: %s", job.path, job.step, e)
            handle.committed.set_exception(e)
            self._release(slot, handle)
            return False
        except BaseException as e:
            error = SnapshotSaveError(
                f"background save of {job.path!r} (step {job.step}) failed: "
                f"{type(e).__name__}: {e}; earlier snapshots are intact. Fix the cause (chained "
                "below); under a manager, snapshot(on_save_error='log') keeps training after it")
            error.__cause__ = e
            if report:
                logger.error("snapshot %s (step %s) failed: %s: %s", job.path, job.step,
                             type(e).__name__, e)
                self.engine.record_error(job.path, error)
            handle.committed.set_exception(e)
            self._release(slot, handle)
            return False
        del staged
        if ticket.incremental is not None:  # no longer in flight: retention may count it
            ticket.incremental.finish(record)
        # retention and post-commit hooks first: once every slot is free, wait() and finalize()
        # may return, and by then everything about the snapshot must be done
        if ticket.retain is not None:
            ticket.retain.after_commit(record)
        handle.committed.set_result(record)
        self._run_hooks(record)
        self._release(slot, handle)
        return True

    def record_error(self, error: SnapshotSaveError) -> None:
        """Keep a background failure for :meth:`raise_pending_error`."""
        self.engine.record_error("(a queued task)", error)

    def abandon(self, ticket: Ticket, reason: str) -> None:
        """Give up a ticket that will never run (its worker exited without running it)."""
        if ticket.handle.committed.cancel():
            logger.warning("snapshot %s (step %s) was not written: %s", ticket.job.path,
                           ticket.job.step, reason)
            if ticket.stream is not None:
                ticket.stream.close()
            self._release(ticket.slot, ticket.handle)

    def discard(self, ticket: Ticket) -> None:
        """Give back the slot of a ticket that will not be used (its snapshot is written by
        another save); nothing is logged."""
        if ticket.handle.committed.cancel():
            if ticket.stream is not None:
                ticket.stream.close()
            self._release(ticket.slot, ticket.handle)

    def _run_hooks(self, record: CommitRecord) -> None:
        for hook in list(self._hooks):
            try:
                hook(record)
            except Exception:  # retention etc. must never stop training
                logger.exception("post-commit hook %r failed after %s", hook, record.path)


def _close_buffers(slot: Slot) -> None:
    """Release a slot's staging memory (a process writer's shared arena; heap buffers are
    freed with the slot)."""
    close = getattr(slot.buffers.allocator, "close", None)
    if close is not None:
        close()


def _write_in_trainer(job: SaveJob, staged: Any, died: WorkerDiedError) -> CommitRecord:
    """The worker died before reporting ``job``'s commit: write the same staged copy here, as the
    thread writers do (same commit, manifest and checksum). Had the worker already committed it,
    the atomic replace swaps in the same content with its own new manifest.

    Raises:
        WorkerDiedError: this write failed too; names both causes, chained from this one.
    """
    try:
        record = commit_job(job, staged)
    except Exception as e:
        raise WorkerDiedError(
            f"{died}, and the trainer's own write of that snapshot failed too "
            f"({type(e).__name__}: {e}); it was not committed. A new worker starts with the "
            "next snapshot") from e
    logger.warning("%s%s; the trainer wrote that snapshot itself. A new worker starts with the "
                   "next snapshot", _rank_prefix(), died)
    return record


def _rank_prefix() -> str:
    """``'rank N: '`` under torchrun (its ``RANK``; a dead worker is one rank's news among many
    ranks' logs), else ``''``."""
    rank = os.environ.get("RANK", "").strip()
    return f"rank {rank}: " if rank.isdigit() else ""


def _no_stats() -> StageStats:
    return StageStats(tensor_bytes=0, allocated_bytes=0, num_storages=0)


__all__ = [
    "ON_FULL_POLICIES", "PostCommitHook", "SaveHandle", "Saver", "Ticket",
]
