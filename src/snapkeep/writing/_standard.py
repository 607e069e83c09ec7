"""ppe-compatible ``StandardWriter``: the base of writers that save on a worker per snapshot.

The worker (a thread or process made by :meth:`StandardWriter.create_worker`) runs the ticket the
saver staged for it; the save path itself is :class:`~snapkeep.writing._base.Writer`'s.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from snapkeep._core.errors import SnapshotSaveError
from snapkeep._core.save.executors import ThreadRunner
from snapkeep._core.save.saver import SaveHandle, Ticket
from snapkeep.writing._base import SaveFun, Writer


class StandardWriter(Writer):
    """Base class of writers that save on a worker per snapshot (ppe's ``StandardWriter``).

    ``__call__`` stages a consistent copy of the target (training may mutate it as soon as the
    call returns), then calls :meth:`create_worker` and starts the worker. At most
    ``max_pending`` snapshots are in flight; when full, ``on_full`` decides (``'block'``,
    ``'skip'``; see :class:`snapkeep._core.save.saver.Saver`). ``finalize()`` joins the workers and
    raises a failed save once as :class:`SnapshotSaveError` (a ``RuntimeError``, as ppe).

    Args:
        savefun: ``savefun(obj, file, **kwds)``; default ``torch.save``.
        fs: see :class:`Writer`.
        out_dir: see :class:`Writer`.
        max_pending: snapshots in flight at once (default 1); each holds one staging copy.
        on_full: ``'block'`` (default), ``'skip'`` or ``'replace'``.
        timeout_s: bound in seconds on waiting for a slot and on ``finalize``; None = unbounded
            while the worker is alive (a warning is logged every 30 s).
        staging_budget: see :class:`Writer`.
        kwds: keyword arguments passed to ``savefun``.
    """

    _runner_class = ThreadRunner

    def __init__(
        self, savefun: SaveFun = torch.save, fs: Any = None, out_dir: str = "", *,
        max_pending: int | None = None, on_full: str = "block", timeout_s: float | None = None,
        storage_options: Mapping[str, Any] | None = None, zip_crc32: bool = False,
        staging_budget: int | None = None, **kwds: Any,
    ) -> None:
        super().__init__(fs=fs, out_dir=out_dir, storage_options=storage_options,
                         max_pending=max_pending, on_full=on_full, timeout_s=timeout_s,
                         zip_crc32=zip_crc32, staging_budget=staging_budget)
        self._savefun = savefun
        self._kwds = kwds
        self._workers: list[tuple[Any, Ticket | None]] = []
        self._runs_ticket: set[int] = set()  # ids of workers that run their ticket themselves
        self._next_ticket: Ticket | None = None
        self._lock = threading.Lock()

    def __call__(
        self, filename: str, out_dir: str, target: Any, *, savefun: SaveFun | None = None,
        append: bool = False, **extra: Any,
    ) -> SaveHandle | None:
        self._reap(block=False)
        if self._saver.on_full == "block":
            self._reap(block=True, keep=self._saver.max_pending - 1)
        savefun = self._savefun if savefun is None else savefun
        ticket = self._submit(filename, out_dir, target, savefun, append, self._kwds, extra)
        if ticket is None:
            return None
        with self._lock:
            self._next_ticket = ticket
            try:
                worker = self.create_worker(filename, out_dir, ticket.staged, savefun=savefun,
                                            append=append, **self._kwds)
            except BaseException:
                self._saver.abandon(ticket, "create_worker failed")
                raise
            finally:
                runs_ticket = self._next_ticket is None  # the worker took it (_take_ticket)
                self._next_ticket = None
        if not runs_ticket:
            # a subclass worker that saves by itself (ppe's pattern: target=self.save) goes
            # through save(), which takes its own slot: give this unused one back first
            self._saver.discard(ticket)
        try:
            worker.start()
        except BaseException:
            self._saver.abandon(ticket, "its worker failed to start")
            raise
        if runs_ticket:
            self._runs_ticket.add(id(worker))
            self._workers.append((worker, ticket))
            self._saver.await_call(ticket)  # a budgeted snapshot: what the budget cannot hide
            return ticket.handle
        self._workers.append((worker, None))
        self.last_handle = None
        return None

    def create_worker(
        self, filename: str, out_dir: str, target: Any, *, savefun: SaveFun | None = None,
        append: bool = False, **savefun_kwargs: Any,
    ) -> Any:
        """Create (not start) the worker for one snapshot: an object with ``start``/``join``."""
        raise NotImplementedError

    def _take_ticket(self) -> Ticket | None:
        ticket, self._next_ticket = self._next_ticket, None
        return ticket

    def _work(
        self, ticket: Ticket | None, filename: str, out_dir: str, target: Any,
        savefun: SaveFun | None, append: bool, savefun_kwargs: Mapping[str, Any],
    ) -> None:
        """Body of a worker: run the staged ticket, or (a worker made by a direct
        ``create_worker`` call) a plain synchronous save."""
        if ticket is not None:
            self._saver.run(ticket)
            return
        try:
            self.save(filename, out_dir, target, savefun, append, **savefun_kwargs)
        except Exception as e:
            error = SnapshotSaveError(f"save of {filename!r} failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            self._saver.record_error(error)

    def _reap(self, *, block: bool, keep: int = 0) -> None:
        """Join finished workers; with ``block``, also join the oldest workers that do not run
        their ticket (made by a subclass's ``create_worker``, as ppe) until ``keep`` remain.

        Workers that run their ticket are never joined while running: the saver bounds them
        (``max_pending``, ``on_full``, ``timeout_s``), so a stalled save cannot hang a call.
        """
        others = [w for w, _ in self._workers if id(w) not in self._runs_ticket]
        to_join = len(others) - keep if block else 0
        remaining = []
        for worker, ticket in self._workers:
            must = to_join > 0 and id(worker) not in self._runs_ticket
            to_join -= int(must)
            alive = getattr(worker, "is_alive", None)
            if must or (callable(alive) and not worker.is_alive()):
                worker.join()
                self._runs_ticket.discard(id(worker))
                if ticket is not None and not ticket.handle.committed.done():
                    self._saver.abandon(ticket, "its worker exited without running it")
            else:
                remaining.append((worker, ticket))
        self._workers = remaining

    def finalize(self) -> None:
        if self._finalized:
            return
        try:
            self._reap(block=True)
        finally:
            super().finalize()
