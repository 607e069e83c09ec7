"""ppe-compatible queue writers: ``QueueWriter``, ``ThreadQueueWriter``, ``ProcessQueueWriter``."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from snapkeep._core.errors import SnapshotSaveError, SnapshotTimeoutError, StagingRaceError
from snapkeep._core.save.executors import ThreadRunner
from snapkeep._core.save.saver import SaveHandle, Ticket
from snapkeep.writing._base import SaveFun, SimpleWriter, Writer
from snapkeep.writing._parallel import WorkerProcessMixin, check_picklable

logger = logging.getLogger(__name__)

#: Queue writers allow this many snapshots staged or in flight by default.
DEFAULT_QUEUE_PENDING = 2


class QueueWriter(Writer):
    """Base class of writers that feed snapshots through a queue to one consumer (ppe's
    ``QueueWriter``).

    The queue and its consumer are created when the writer is constructed
    (:meth:`create_queue`, :meth:`create_consumer`); each ``__call__`` stages a consistent copy of
    the target and puts a task on the queue; :meth:`consume` runs the tasks in order. Unlike ppe:
    the queue is bounded by ``max_pending`` staged snapshots (``on_full`` decides what happens when
    it is full, memory stays flat), a failing task does not kill the consumer (its error is raised
    once at the next call or at ``finalize()``), and a writer without ``out_dir`` writes into the
    manager's ``out`` instead of the working directory.

    Args:
        savefun: ``savefun(obj, file)``; default ``torch.save``; passed to :meth:`create_task`.
        fs: see :class:`Writer`.
        out_dir: see :class:`Writer`.
        task: a callable with ``Writer.__call__``'s interface put on the queue instead of the
            default task.
        max_pending: snapshots staged or in flight at once (default 2).
        on_full: ``'block'`` (default), ``'skip'`` or ``'replace'`` (drop the oldest snapshot still
            waiting in the queue).
        timeout_s: bound in seconds on waiting for a free slot and on ``finalize``.
    """

    _runner_class = ThreadRunner
    _default_max_pending = DEFAULT_QUEUE_PENDING

    def __init__(
        self, savefun: SaveFun = torch.save, fs: Any = None, out_dir: str = "",
        task: Any = None, *, max_pending: int | None = None, on_full: str = "block",
        timeout_s: float | None = None, storage_options: Mapping[str, Any] | None = None,
        zip_crc32: bool = False, staging_budget: int | None = None,
    ) -> None:
        super().__init__(fs=fs, out_dir=out_dir, storage_options=storage_options,
                         max_pending=max_pending, on_full=on_full, timeout_s=timeout_s,
                         zip_crc32=zip_crc32, staging_budget=staging_budget)
        self._savefun = savefun
        self._started = False
        self._queued: list[Ticket] = []  # tickets put on the queue and not yet known to be done
        self._default_task = self.create_task(savefun) if task is None else None
        self._task = self._default_task if task is None else task
        self._queue = self.create_queue()
        self._consumer = self.create_consumer(self._queue)
        self._consumer.start()
        self._started = True

    def __call__(
        self, filename: str, out_dir: str, target: Any, *, savefun: SaveFun | None = None,
        append: bool = False, **extra: Any,
    ) -> SaveHandle | None:
        ticket = self._submit(filename, out_dir, target, savefun or self._savefun, append, {},
                              extra)
        if ticket is None:
            return None
        self._queued = [t for t in self._queued if not t.handle.committed.done()]
        self._queued.append(ticket)
        self._queue.put((self._task, filename, out_dir, ticket.staged, savefun, append, ticket))
        self._saver.await_call(ticket)  # a budgeted snapshot: what the budget cannot hide
        return ticket.handle

    def create_task(self, savefun: SaveFun) -> Any:
        """The default task: a :class:`SimpleWriter` with ``savefun`` (as ppe)."""
        return SimpleWriter(savefun=savefun, fs=self._fs, out_dir=self.out_dir,
                            storage_options=self._storage_options, zip_crc32=self._zip_crc32)

    def create_queue(self) -> Any:
        """The queue between the trainer and the consumer."""
        return queue.Queue()

    def create_consumer(self, q: Any) -> Any:
        """The consumer (an object with ``start``/``join``) that runs :meth:`consume`."""
        return threading.Thread(target=self.consume, args=(q,), daemon=True,
                                name="snapkeep-queue-consumer")

    def consume(self, q: Any) -> None:
        """Run queued tasks until a ``None`` sentinel; one failing task never stops it."""
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                ticket = item[6] if _length(item) > 6 else None
                if ticket is None:
                    self._run_task(item)
                elif item[0] is self._default_task:
                    self._saver.run(ticket)
                else:
                    self._saver.run(ticket, execute=_custom_task(item))
            finally:
                q.task_done()

    def _run_task(self, item: Any) -> None:
        try:
            item[0](item[1], item[2], item[3], savefun=item[4], append=item[5])
        except Exception as e:
            error = SnapshotSaveError(f"queued snapshot task failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            logger.error("queued snapshot task failed: %s: %s", type(e).__name__, e)
            self._saver.record_error(error)

    def finalize(self) -> None:
        """Drain the queue, stop the consumer and the worker; raise a pending failure once."""
        if self._finalized:
            return
        race: BaseException | None = None
        try:  # a safe point: the consumer waits for the verdict of an overlapped snapshot
            self._saver.settle_overlap()
        except StagingRaceError as e:  # raised after the queue is drained and closed
            race = e
        try:
            if self._started:
                self._queue.put(None)  # the consumer exits after every queued task ran
                if not self._join_consumer(self._saver.timeout_s):
                    pending = self._saver.pending_paths()
                    self._finalized = True
                    self._saver.close(wait=False)
                    raise SnapshotTimeoutError(
                        f"finalize waited {self._saver.timeout_s} s for snapshot(s) {pending} "
                        "to commit; they are still being written")
                self._join_queue()
                self._started = False
            # The consumer has exited: a ticket it never ran (a custom consumer or queue that
            # dropped it) will never commit; release its slot instead of waiting forever.
            for ticket in self._queued:
                if not ticket.handle.committed.done():
                    self._saver.abandon(ticket, "the queue consumer exited without running it")
            self._queued = []
        finally:
            super().finalize()
        if race is not None:
            raise race

    def _join_queue(self) -> None:
        """``queue.join()`` (as ppe) once the consumer has exited, without the unbounded wait:
        items it never took are taken here first (their tickets are abandoned below), and a
        ``queue.Queue`` with tasks still marked unfinished is not waited on."""
        q = self._queue
        try:
            while q.empty() is False:  # `is False`: only a queue that says so is drained
                q.get_nowait()
                q.task_done()
        except (queue.Empty, ValueError):
            pass
        if isinstance(q, queue.Queue) and q.unfinished_tasks:
            logger.warning("the queue consumer exited with %d task(s) unfinished",
                           q.unfinished_tasks)
            return
        q.join()

    def _join_consumer(self, timeout_s: float | None) -> bool:
        """Join the consumer within ``timeout_s`` (None: while it runs, logging every
        ``warn_after_s``); False when it is still running after the bound."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            step = self._saver.warn_after_s
            if deadline is not None:
                step = min(step, max(0.0, deadline - time.monotonic()))
            self._consumer.join(step)
            alive = getattr(self._consumer, "is_alive", None)
            # Only a consumer that reports ``is_alive() is True`` is waited for again; one that
            # cannot tell (a custom consumer, a mock) is joined once, as ppe did.
            if not callable(alive) or alive() is not True:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            logger.warning("finalize still waiting for snapshot(s) %s to commit",
                           self._saver.pending_paths())


def _custom_task(item: Any) -> Any:
    """``execute`` for a ticket whose queue item carries a user task instead of the default."""

    def run(staged: Any) -> Any:
        return item[0](item[1], item[2], staged, savefun=item[4], append=item[5])

    return run


def _length(item: Any) -> int:
    try:
        return len(item)
    except TypeError:
        return 0


class ThreadQueueWriter(QueueWriter):
    """Queue writer whose consumer is a thread (ppe's ``ThreadQueueWriter``); see
    :class:`QueueWriter` for the arguments."""

    _runner_class = ThreadRunner


class ProcessQueueWriter(WorkerProcessMixin, QueueWriter):
    """Queue writer whose tasks are written by one persistent worker process (ppe's
    ``ProcessQueueWriter``).

    The consumer thread forwards each staged snapshot to a worker process started once with
    ``spawn`` (or ``forkserver``); staged tensors reach it through a reused shared-memory arena.
    Nothing of the trainer is forked or moved into shared memory (ppe moved the model's own
    parameters there, so the queued snapshot kept changing). See :class:`QueueWriter`.

    Args:
        start_method: ``'spawn'`` (default) or ``'forkserver'``.

    Raises:
        TypeError: ``savefun`` cannot be pickled to the worker.
    """

    def __init__(
        self, savefun: SaveFun = torch.save, fs: Any = None, out_dir: str = "",
        task: Any = None, *, start_method: str = "spawn", **kwargs: Any,
    ) -> None:
        check_picklable(savefun)
        self._start_method = start_method
        super().__init__(savefun=savefun, fs=fs, out_dir=out_dir, task=task, **kwargs)


__all__ = ["QueueWriter", "ThreadQueueWriter", "ProcessQueueWriter", "Ticket"]
