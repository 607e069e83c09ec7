"""Where a save runs: the caller's thread, a writer thread, or one persistent worker process.

A runner's ``run(job, staged)`` is called on the saver's dispatch thread (or the caller's thread
for :class:`InlineRunner`), one job at a time, and returns a :class:`CommitRecord` or raises.

:class:`ProcessRunner` starts one worker process with the ``spawn`` start method (never a fork of
the trainer, so CUDA contexts and threads are safe), once, and reuses it. Staged tensors reach it
through shared-memory arenas (see :mod:`.shm`); only metadata crosses the pipe. Every wait on the
worker also watches its liveness, so a dead worker raises :class:`WorkerDiedError` instead of
hanging (the saver then writes that snapshot in the trainer); the next job starts a fresh worker.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from snapkeep._core.commit import commit_job as execute
from snapkeep._core.errors import SnapshotError, WorkerDiedError
from snapkeep._core.job import CommitRecord, SaveJob
from snapkeep._core.manifest import manifest_path
from snapkeep._core.storage import set_publish_guard

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


class _RemoteError(Exception):
    """Stands in for a worker exception that could not be pickled back."""


class TrainerDiedError(SnapshotError, RuntimeError):
    """Raised in the worker right before it would publish a file whose trainer has died: nothing
    a dead trainer started may become visible after its death."""


# -- what the worker can receive --------------------------------------------------------------
_WORKER_HINT = ("the ProcessWriter worker never imports the training script (__main__) and "
                "cannot receive lambdas, local classes or OS handles; define the class at module "
                "level in an importable module, or use ThreadWriter")


class _Unsendable(Exception):
    pass


class _WorkerPickler(pickle.Pickler):
    """Pickles like the pipe does, skipping tensors (they travel through shared memory), and
    refuses what would pickle here but not unpickle in the worker: classes and functions of
    ``__main__`` or local to a function."""

    def persistent_id(self, obj: Any) -> Any:
        return "tensor" if _is_tensor(obj) else None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            module = getattr(obj, "__module__", None)
            qualname = getattr(obj, "__qualname__", "")
            if module == "__main__":
                raise _Unsendable(f"{qualname} is defined in __main__ (the training script)")
            if "<locals>" in qualname or "<lambda>" in qualname:
                raise _Unsendable(f"{module}.{qualname} is a lambda or local definition")
        return NotImplemented


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _dumps_for_worker(obj: Any) -> None:
    buffer = io.BytesIO()
    _WorkerPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)


def _first_unsendable(node: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], str] | None:
    """The key path of the first leaf the worker cannot receive and why."""
    try:
        _dumps_for_worker(node)
        return None
    except RecursionError:
        return path, "it is nested too deeply to pickle"
    except Exception as e:
        reason = f"{type(e).__name__}: {e}" if not isinstance(e, _Unsendable) else str(e)
    if isinstance(node, dict):
        for key, value in node.items():
            found = _first_unsendable(key, (*path, f"<key {key!r}>")) or \
                _first_unsendable(value, (*path, key))
            if found is not None:
                return found
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            found = _first_unsendable(value, (*path, i))
            if found is not None:
                return found
    return path, reason


_PLAIN_LEAVES = (int, float, complex, str, bytes, bool, type(None))


def _plainly_sendable(tree: Any) -> bool:
    """Fast path: only plain containers, tensors and builtin scalars (a state_dict, an optimizer
    state): nothing the worker could fail to import."""
    import collections

    import torch

    leaves = (*_PLAIN_LEAVES, torch.dtype, torch.device)
    tensor = torch.Tensor
    stack = [tree]
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > 10_000_000:
            return False
        kind = type(node)
        if kind in leaves or isinstance(node, tensor):
            continue
        if kind is dict or kind is collections.OrderedDict:
            extra = getattr(node, "__dict__", None)
            if extra:
                stack.append(dict(extra))
            for key in node:
                if type(key) not in _PLAIN_LEAVES:
                    return False
            stack.extend(node.values())
        elif kind is list or kind is tuple or kind is torch.Size:
            stack.extend(node)
        else:
            return False
    return True


def check_sendable(tree: Any, *, what: str = "the state") -> None:
    """Check, in the trainer, that the worker process can receive ``tree`` (tensors excepted:
    they are staged into shared memory).

    Raises:
        TypeError: naming the key path of the first leaf that cannot be sent, why, and what to do
            (a module-level class, or ThreadWriter).
    """
    if _plainly_sendable(tree):
        return
    found = _first_unsendable(tree, ())
    if found is None:
        return
    path, reason = found
    where = "/".join(map(str, path)) or "<root>"
    raise TypeError(f"{what} at {where} cannot be sent to the ProcessWriter worker ({reason}); "
                    f"{_WORKER_HINT}")


# -- worker process ---------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1


def _die_with_trainer() -> None:
    """Linux: have the kernel SIGKILL this worker when the thread that started it (the trainer's
    long-lived starter thread, see :func:`_start_on_starter_thread`) dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); the worker relies on its "
                           "parent-alive check alone", ctypes.get_errno())
    except (OSError, AttributeError) as e:
        logger.warning("prctl unavailable (%s); the worker relies on its parent-alive check", e)


def _trainer_alive_check(parent_pid: int) -> Callable[[], bool]:
    """``alive()`` for the trainer ``parent_pid``: exact while the worker is its direct child
    (spawn: re-parenting means it died); by pid otherwise (forkserver)."""
    if os.getppid() == parent_pid:
        return lambda: os.getppid() == parent_pid

    def alive() -> bool:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    return alive


_TRAINER_SIGNALS = tuple(getattr(signal, name) for name in
                         ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                         if hasattr(signal, name))


def _worker_main(conn: Any, parent_pid: int) -> None:
    """Worker process entry point: serve jobs until told to stop, then exit at once.

    SIGINT, SIGTERM, SIGHUP and SIGUSR1/2 are ignored (they reach the whole process group:
    Ctrl-C, a scheduler's SIGTERM; the trainer decides,
    and its ``finalize()`` waits for the save in flight). The worker dies with its trainer
    (``PR_SET_PDEATHSIG``), and checks that the trainer is alive right before publishing each
    file, so nothing a dead trainer started becomes visible after its death.

    Every job was committed (fsynced) and answered before the loop ends, so the interpreter's
    teardown (about a second with torch loaded) is skipped and ``finalize()`` returns promptly.
    """
    # Signals sent to the whole process group (Ctrl-C, a scheduler's SIGTERM, SLURM's SIGUSR1)
    # are the trainer's to handle (extensions.preemption snapshots on them, and the worker must
    # live to write that snapshot); the worker dies with its trainer instead.
    for signum in _TRAINER_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _die_with_trainer()
    alive = _trainer_alive_check(parent_pid)
    if not alive():
        os._exit(0)

    def guard() -> None:
        if not alive():
            raise TrainerDiedError(f"the trainer (pid {parent_pid}) died; not publishing")

    set_publish_guard(guard)
    _serve(conn, alive)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _serve(conn: Any, alive: Callable[[], bool]) -> None:
    """Worker process loop: receive jobs, execute them, send back records or errors.

    A message that cannot be unpickled here (a class the worker cannot import) is answered with
    an error; the worker keeps serving."""
    import torch  # noqa: F401  (import once, before the first job)

    from snapkeep._core.shm import ArenaReader

    reader = ArenaReader()
    while True:
        if not conn.poll(1.0):
            if not alive():  # the trainer died: nothing left to serve
                return
            continue
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            message = pickle.loads(data)
        except Exception as e:
            reply_error: tuple[str, Any] = ("error", (_RemoteError(
                f"the worker could not receive the snapshot ({type(e).__name__}: {e}); "
                f"{_WORKER_HINT}"), traceback.format_exc()))
            try:
                conn.send(reply_error)
            except (BrokenPipeError, OSError):
                return
            continue
        if message is None:
            return
        kind, payload = message
        if kind == "forget":
            reader.forget_except(set(payload))
            continue
        job, arena_name, skeleton, storages = payload
        try:
            obj = reader.rebuild(arena_name, skeleton, storages) if arena_name else skeleton
            record = execute(job, obj)
            del obj
            reply: tuple[str, Any] = ("ok", record)
        except BaseException as e:  # sent back and re-raised in the trainer
            text = traceback.format_exc()
            try:
                pickle.loads(pickle.dumps(e))  # must also rebuild in the trainer
                err: BaseException = e
            except Exception:
                err = _RemoteError(f"{type(e).__name__}: {e}")
            reply = ("error", (err, text))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


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
            from snapkeep._core.shm import reclaim_dead_arenas

            reclaim_dead_arenas()  # a killed run's staging memory is freed by the next one
            parent, child = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(
                target=_worker_main, args=(child, os.getpid()), daemon=True,
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
                process.kill()  # SIGTERM is ignored by the worker (see _worker_main)
                process.join(timeout=5.0)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._stop_locked()
