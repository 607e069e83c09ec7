"""The ProcessWriter worker process: serves save jobs sent by :class:`.executors.ProcessRunner`.

It runs in a ``spawn`` child (never a fork of the trainer), ignores the signals meant for the
trainer, dies with it (``PR_SET_PDEATHSIG``, and a parent-alive check right before each publish),
and answers every job with its :class:`~.job.CommitRecord` or its error.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from snapkeep._core.errors import SnapshotError
from snapkeep._core.save.commit import commit_job as execute
from snapkeep._core.save.sendable import WORKER_HINT
from snapkeep._core.storage import set_publish_guard

logger = logging.getLogger(__name__)


class _RemoteError(Exception):
    """Stands in for a worker exception that could not be pickled back."""


class TrainerDiedError(SnapshotError, RuntimeError):
    """Raised in the worker right before it would publish a file whose trainer has died: nothing
    a dead trainer started may become visible after its death."""


_PR_SET_PDEATHSIG = 1


def _die_with_trainer() -> None:
    """Linux: have the kernel SIGKILL this worker when the thread that started it (the trainer's
    long-lived starter thread, see :func:`.executors._start_on_starter_thread`) dies."""
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


def worker_main(conn: Any, parent_pid: int) -> None:
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

    from snapkeep._core.save.shm import ArenaReader

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
                f"{WORKER_HINT}"), traceback.format_exc()))
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
