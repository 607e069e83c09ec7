"""Where a save runs: the caller's thread, a writer thread, or one persistent worker process.

A runner's ``run(job, staged)`` is called on the saver's dispatch thread (or the caller's thread
for :class:`InlineRunner`), one job at a time, and returns a :class:`CommitRecord` or raises.

:class:`ProcessRunner` starts one worker process with the ``spawn`` start method (never a fork of
the trainer, so CUDA contexts and threads are safe), once, and reuses it. Staged tensors reach it
through shared-memory arenas (see :mod:`.shm`); only metadata crosses the pipe. Every wait on the
worker also watches its liveness, so a dead worker raises :class:`WorkerDiedError` instead of
hanging (the saver then writes that snapshot in the trainer); the next job starts a fresh worker.

What the worker can receive is checked by :mod:`.sendable`; the worker's own loop is :mod:`.worker`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from snapkeep._core.errors import WorkerDiedError
from snapkeep._core.format.manifest import manifest_path
from snapkeep._core.save.commit import commit_job as execute
from snapkeep._core.save.job import CommitRecord, SaveJob
from snapkeep._core.save.sendable import check_sendable
from snapkeep._core.save.worker import worker_main

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """Runs one save job.

    ``run`` is called from a single thread at a time (the saver's dispatch thread, or the caller's
    thread for inline runners). It returns the commit record or raises the job's error; it must
    not hang while its worker is dead. ``close`` is idempotent.
    """

    #: whether ``run`` executes in another process (staged tensors must be in shared memory).
    in_process: bool
    #: whether ``run`` executes on a background thread (the saver must stage a copy first).
    background: bool

    def run(self, job: SaveJob, staged: Any, arena_name: str | None, storages: Any) -> CommitRecord:
        ...

    def close(self) -> None:
        ...


class InlineRunner:
    """Runs the job in the caller's thread (``SimpleWriter``)."""

    in_process = True
    background = False

    def run(self, job: SaveJob, staged: Any, arena_name: str | None, storages: Any) -> CommitRecord:
        return execute(job, staged)

    def close(self) -> None:
        pass


class ThreadRunner(InlineRunner):
    """Runs the job on the saver's background dispatch thread (thread writers)."""

    background = True


_MAIN_LOCK = threading.Lock()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a spawn child without re-running the trainer's ``__main__``.

    ``spawn`` normally re-imports the parent's main script in the child, which fails (or re-runs
    training) in scripts without an ``if __name__ == '__main__':`` guard -- ppe's fork-based
    writers never needed one. The worker's code lives in snapkeep, so the child needs nothing from
    ``__main__``: hide its path and spec while the preparation data is computed.
    """
    main = sys.modules.get("__main__")
    with _MAIN_LOCK:
        saved = {k: main.__dict__[k] for k in ("__file__", "__spec__")
                 if main is not None and k in main.__dict__}
        try:
            if main is not None:
                if "__file__" in saved:
                    delattr(main, "__file__")
                main.__spec__ = None
            yield
        finally:
            for k, v in saved.items():
                if main is not None:
                    setattr(main, k, v)


_STARTER: tuple[threading.Thread, queue.SimpleQueue[Any]] | None = None
_STARTER_LOCK = threading.Lock()
_START_TIMEOUT_S = 120.0


def _starter_loop(requests: queue.SimpleQueue[Any]) -> None:
    while True:
        fn, future = requests.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)


def _start_on_starter_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` (a ``Process.start``) on one long-lived daemon thread of this process.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that created the worker exits, not the process:
    a worker started from a writer's dispatch thread would be killed when that thread ends. This
    thread lives as long as the process.
    """
    global _STARTER
    with _STARTER_LOCK:
        if _STARTER is None or not _STARTER[0].is_alive():
            requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
            thread = threading.Thread(target=_starter_loop, args=(requests,), daemon=True,
                                      name="snapkeep-worker-starter")
            thread.start()
            _STARTER = (thread, requests)
        requests = _STARTER[1]
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    requests.put((fn, future))
    return future.result(timeout=_START_TIMEOUT_S)


def _forget_starter_in_child() -> None:
    global _STARTER, _STARTER_LOCK
    _STARTER = None
    _STARTER_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_starter_in_child)


class ProcessRunner:
    """Runs jobs in one persistent worker process started with ``spawn`` (process writers).

    Args:
        start_method: multiprocessing start method for the worker (``'spawn'`` or
            ``'forkserver'``; never a fork of the trainer).
    """

    in_process = False
    background = True

    def __init__(self, *, start_method: str = "spawn") -> None:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method must be 'spawn' or 'forkserver', got {start_method!r}"
            )
        self._ctx: Any = multiprocessing.get_context(start_method)
        self._owner_pid = os.getpid()
        self._process: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._known_arenas: set[str] = set()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def check_sendable(self, job: SaveJob, tree: Any) -> None:
        """Refuse, in the trainer and before the snapshot is accepted, what the worker could not
        receive (see :func:`check_sendable`); the worker is never involved, so it survives.

        Raises:
            TypeError: naming the key path, the reason, and ThreadWriter / module-level classes.
        """
        check_sendable(dict(job.savefun_kwargs), what="savefun_kwargs")
        check_sendable(job.savefun, what="savefun")
        check_sendable(tree)

    def start(self) -> None:
        """Start the worker if it is not running (idempotent; also restarts a dead one)."""
        with self._lock:
            if self._owner_pid != os.getpid():  # forked: start a worker of our own
                self._process = self._conn = None
                self._owner_pid = os.getpid()
            if self._process is not None and self._process.is_alive():
                return
            self._stop_locked()
            from snapkeep._core.save.shm import reclaim_dead_arenas

            reclaim_dead_arenas()  # a killed run's staging memory is freed by the next one
            parent, child = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(
                target=worker_main, args=(child, os.getpid()), daemon=True,
                name="snapkeep-writer",
            )
            with _main_module_hidden():
                _start_on_starter_thread(process.start)
            child.close()
            self._process, self._conn = process, parent
            self._known_arenas = set()
            logger.debug("started snapshot worker process pid=%s", process.pid)

    def run(self, job: SaveJob, staged: Any, arena_name: str | None, storages: Any) -> CommitRecord:
        with self._run_lock:  # one job at a time through the pipe
            return self._run(job, staged, arena_name, storages)

    def _run(
        self, job: SaveJob, staged: Any, arena_name: str | None, storages: Any
    ) -> CommitRecord:
        self.start()
        process, conn = self._process, self._conn
        if arena_name is not None and arena_name not in self._known_arenas:
            self._known_arenas.add(arena_name)
        try:
            conn.send(("job", (job, arena_name, staged, storages)))
        except (BrokenPipeError, OSError) as e:
            raise self._died(job, process) from e
        while True:
            ready = multiprocessing.connection.wait([conn, process.sentinel], timeout=5.0)
            if conn in ready:
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError) as e:
                    raise self._died(job, process) from e
                if kind == "ok":
                    return payload  # type: ignore[no-any-return]
                err, text = payload
                if isinstance(err, BaseException):
                    notes = [*getattr(err, "__notes__", []), "worker traceback:\n" + text]
                    setattr(err, "__notes__", notes)  # noqa: B010  (add_note is 3.11+)
                raise err
            if process.sentinel in ready or not process.is_alive():
                raise self._died(job, process)

    def forget_arenas(self, keep: set[str]) -> None:
        """Tell the worker to unmap the arenas it opened that are not in ``keep`` (replaced by a
        larger one when the state grew); a no-op when none is stale. Otherwise the worker's
        mapping would keep a replaced arena's memory alive until it exits."""
        with self._run_lock:  # the pipe carries one message at a time
            if self._conn is None or self._process is None or not self._process.is_alive():
                return
            if not self._known_arenas - keep:
                return
            self._known_arenas &= keep
            try:
                self._conn.send(("forget", sorted(keep)))
            except (BrokenPipeError, OSError):
                pass

    def _died(self, job: SaveJob, process: Any) -> WorkerDiedError:
        """The worker died before reporting ``job``'s commit: reap it, remove the temp files it
        left (named with its pid) and say which worker died, how, and while writing what. The
        saver then writes the job's staged copy in the trainer (see ``Saver.run``)."""
        process.join(timeout=1.0)
        with self._lock:
            self._stop_locked()  # also kills and reaps a worker that has not quite exited
        code = process.exitcode
        if code is not None:  # reaped: its temp files (named with its pid) are now stale
            storage = job.storage
            for directory in dict.fromkeys((storage.dirname(job.path),
                                            storage.dirname(manifest_path(storage, job.path)))):
                try:
                    storage.remove_stale_temps(directory)
                except Exception:  # never hide the death behind a clean-up failure
                    logger.warning("could not remove the temp files in %s left by the dead "
                                   "worker writing %s", directory, job.path, exc_info=True)
        return WorkerDiedError(
            f"the snapshot worker process (pid {process.pid}) died with exit code {code} "
            f"before reporting the commit of {job.path!r} (step {job.step})"
        )

    def _stop_locked(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if self._owner_pid != os.getpid():
            return  # a forked child: the worker belongs to the parent; leave it running
        if conn is not None:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        if process is not None:
            process.join(timeout=5.0)
            if process.is_alive():
                logger.warning("snapshot worker pid=%s did not stop; killing it", process.pid)
                process.kill()  # SIGTERM is ignored by the worker (see worker_main)
                process.join(timeout=5.0)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._stop_locked()


__all__ = [
    "InlineRunner", "ProcessRunner", "Runner", "ThreadRunner",
]
