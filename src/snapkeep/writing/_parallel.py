"""ppe-compatible ``ThreadWriter`` and ``ProcessWriter``."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from collections.abc import Mapping
from typing import Any

import torch

from snapkeep._core.save.engine import SaveEngine
from snapkeep._core.save.executors import ProcessRunner, Runner, ThreadRunner
from snapkeep._core.save.saver import Saver, Ticket
from snapkeep.writing._base import SaveFun
from snapkeep.writing._standard import StandardWriter


class ThreadWriter(StandardWriter):
    """Writes each snapshot on a background thread (ppe's ``ThreadWriter``).

    Unlike ppe, the target is first staged into reusable CPU buffers, so training may mutate it
    as soon as the call returns; a failed save raises :class:`~snapkeep.SnapshotSaveError` at the
    next call or at ``finalize()`` instead of only printing. See :class:`StandardWriter` for the
    arguments.
    """

    _runner_class = ThreadRunner

    def create_worker(
        self, filename: str, out_dir: str, target: Any, *, savefun: SaveFun | None = None,
        append: bool = False, **savefun_kwargs: Any,
    ) -> threading.Thread:
        """A (not started) daemon thread that writes one snapshot, on the saver's engine
        (:class:`snapkeep._core.save.engine.SaveEngine`)."""
        return self._saver.engine.unit(
            self._work, self._take_ticket(), filename, out_dir, target, savefun, append,
            savefun_kwargs, label=filename)


class RemoteSave(multiprocessing.Process):
    """Handle of one snapshot written by the writer's persistent worker process.

    It is what :meth:`ProcessWriter.create_worker` returns so that ppe code expecting a
    ``multiprocessing.Process`` (``start``, ``join``, ``exitcode``, ``is_alive``) keeps working,
    but it never forks the trainer: ``start()`` hands the staged snapshot to the one worker
    process that the writer started with ``spawn``, and ``join()`` waits for its commit.
    """

    def __init__(self, engine: SaveEngine, body: Any, args: tuple[Any, ...],
                 label: str) -> None:
        super().__init__(name="snapkeep-remote-save", daemon=True)
        self._engine = engine
        self._body = body
        self._body_args = args
        self._label = label
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        def run() -> None:
            ok = self._body(*self._body_args)
            self._failed = ok is False

        self._thread = self._engine.unit(run, label=self._label)  # dispatched to the worker
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def exitcode(self) -> int | None:  # type: ignore[override]
        if self._thread is None or self._thread.is_alive():
            return None
        return 1 if self._failed else 0


class WorkerProcessMixin:
    """What the process writers share: one persistent worker process (started at
    ``initialize``, so it boots while the trainer sets up) and savefuns that must be picklable."""

    _start_method: str
    _saver: Saver

    def _make_runner(self) -> Runner:
        return ProcessRunner(start_method=self._start_method)

    def initialize(self, out_dir: str) -> None:
        super().initialize(out_dir)  # type: ignore[misc]
        runner = self._saver.runner
        if isinstance(runner, ProcessRunner):
            runner.start()

    def __call__(self, filename: str, out_dir: str, target: Any, *,
                 savefun: SaveFun | None = None, append: bool = False, **extra: Any) -> Any:
        if savefun is not None:
            check_picklable(savefun)
        return super().__call__(  # type: ignore[misc]
            filename, out_dir, target, savefun=savefun, append=append, **extra)


class ProcessWriter(WorkerProcessMixin, StandardWriter):
    """Writes snapshots in one persistent worker process (ppe's ``ProcessWriter``).

    The worker is started once with ``spawn`` (never a fork of the trainer, so it is safe with
    CUDA and threads) and reused. Each snapshot is staged into a shared-memory arena that the
    worker maps once; the trainer's own tensors are never moved into shared memory. A worker that
    dies (killed, out of memory) before reporting a snapshot's commit is replaced at the next
    snapshot, and the trainer writes that snapshot itself (logged as a warning);
    :class:`~snapkeep.WorkerDiedError` is raised only when that write fails too.

    Args:
        savefun: must be picklable (a module-level function such as ``torch.save``).
        start_method: ``'spawn'`` (default) or ``'forkserver'``.
        **kwargs: the other options of :class:`StandardWriter`.

    Raises:
        TypeError: ``savefun`` cannot be pickled to the worker.
    """

    def __init__(
        self, savefun: SaveFun = torch.save, fs: Any = None, out_dir: str = "", *,
        start_method: str = "spawn", **kwargs: Any,
    ) -> None:
        self._start_method = start_method
        check_picklable(savefun)
        super().__init__(savefun=savefun, fs=fs, out_dir=out_dir, **kwargs)

    def create_worker(
        self, filename: str, out_dir: str, target: Any, *, savefun: SaveFun | None = None,
        append: bool = False, **savefun_kwargs: Any,
    ) -> multiprocessing.Process:
        """A (not started) handle that writes one snapshot in the persistent worker."""
        ticket = self._take_ticket()
        return RemoteSave(self._saver.engine, self._remote_body,
                          (ticket, filename, out_dir, target, savefun, append, savefun_kwargs),
                          filename)

    def _remote_body(
        self, ticket: Ticket | None, filename: str, out_dir: str, target: Any,
        savefun: SaveFun | None, append: bool, savefun_kwargs: Mapping[str, Any],
    ) -> bool:
        if ticket is None:  # a worker made by a direct create_worker call: write synchronously
            self._work(None, filename, out_dir, target, savefun, append, savefun_kwargs)
            return True
        return self._saver.run(ticket)


def check_picklable(savefun: Any) -> None:
    if savefun is None:
        return
    if getattr(savefun, "__module__", None) == "__main__":
        raise TypeError(
            f"savefun {getattr(savefun, '__qualname__', savefun)!r} is defined in the training "
            "script (__main__), which the ProcessWriter worker does not import (it never re-runs "
            "the script); define it in an importable module, or use ThreadWriter")
    try:
        pickle.dumps(savefun)
    except Exception as e:
        raise TypeError(
            f"savefun {savefun!r} cannot be pickled to the ProcessWriter worker ({e}); use a "
            "module-level function, or ThreadWriter for closures and lambdas"
        ) from e
