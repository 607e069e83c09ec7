"""The last snapshot is never lost at interpreter exit.

A script that ends (or raises) without ``finalize()``/``close()`` still has snapshots staged or
being written. At exit, every live saver of this process is closed with a bounded wait
(:data:`EXIT_WAIT_S`), saying on stderr (through logging's WARNING level) what it waits for.

When it runs matters. Thread writers commit through snapkeep's thread pools, and
``concurrent.futures`` refuses new work once its own exit hook ran (``RuntimeError: cannot
schedule new futures after interpreter shutdown``). That hook is a ``threading._register_atexit``
callback, which the interpreter runs (newest first) before it joins threads and long before the
``atexit`` handlers. So :func:`install` registers the drain there too, after importing
``concurrent.futures.thread`` so that the drain is newer and runs first, while the pools still
work. A plain ``atexit`` handler stays registered as the fallback for interpreters without that
hook (it finds every saver already closed otherwise).

A snapshot that cannot be committed (its save failed, or it is still pending after the bound)
is named in an ERROR log line, and the process then exits with status 1 instead of 0 (through an
``atexit`` handler that first runs the other handlers, flushes stdout and stderr, then
``os._exit``), so a job scheduler sees the loss.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 -- its exit hook must be older than the drain's
import logging
import os
import sys
import threading
import weakref
from typing import Any, Protocol

logger = logging.getLogger(__name__)

#: Bound of the wait at exit, seconds, per saver.
EXIT_WAIT_S = 60.0
#: Exit status of a process whose last snapshots could not be committed at exit.
EXIT_STATUS_LOST = 1


class Drainable(Protocol):
    """What the drain needs of a saver (:class:`snapkeep._core.save.saver.Saver`)."""

    @property
    def pid(self) -> int:
        ...

    @property
    def closed(self) -> bool:
        ...

    def pending_paths(self) -> list[str]:
        ...

    def close(self, timeout_s: float | None = None) -> None:
        ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_drained = False
_lost: list[str] = []


class DrainedAtExit:
    """The ``pid``/``closed`` half of :class:`Drainable`, and the registration with the drain,
    for a class that holds snapshots in flight (:class:`~snapkeep._core.save.saver.Saver`, and
    :class:`~snapkeep._core.save.engine.SaveEngine`, the lane of the sharded saver, the memory
    tier and the Hugging Face owned save); the class supplies ``pending_paths`` and ``close``.

    The class calls :meth:`_drain_at_exit_unless_closed` once, when it is ready to save, and
    :meth:`_mark_closed` when it closes (also when a close gives up after its wait ran out).
    """

    _pid: int
    _closed: bool

    def _drain_at_exit_unless_closed(self) -> None:
        self._pid = os.getpid()
        self._closed = False
        _LIVE.add(self)  # what register() does; the class supplies the rest of Drainable

    def _mark_closed(self) -> None:
        self._closed = True
        _LIVE.discard(self)

    @property
    def pid(self) -> int:
        """The process that created it (a forked child does not drain it at exit)."""
        return self._pid

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (or gave up after its wait ran out)."""
        return self._closed


def register(saver: Drainable) -> None:
    """Drain ``saver`` at exit unless it was closed by then."""
    _LIVE.add(saver)


def discard(saver: Drainable) -> None:
    """``saver`` was closed: nothing to drain."""
    _LIVE.discard(saver)


def drain(timeout_s: float = EXIT_WAIT_S) -> list[str]:
    """Close every live saver of this process, each with a wait of at most ``timeout_s``.

    Never raises. Returns the paths of the snapshots that were not committed (empty when all
    were); each is named in an ERROR log line.
    """
    lost: list[str] = []
    for saver in list(_LIVE):
        if saver.closed or saver.pid != os.getpid():
            continue  # a forked child: the parent's threads and worker are not ours to wait for
        paths = saver.pending_paths()
        if paths:
            logger.warning("snapkeep: waiting up to %.0f s at exit for %d pending snapshot(s) "
                           "%s; call close() (Checkpointer) or finalize() (writer, manager) to "
                           "wait explicitly", timeout_s, len(paths), paths)
        try:
            saver.close(timeout_s)
        except Exception as e:  # a failed or timed-out save: name it, exit non-zero
            names = paths or ["(an earlier snapshot)"]
            logger.error("snapkeep: snapshot(s) %s not committed at exit: %s: %s",
                         names, type(e).__name__, e)
            lost.extend(names)
        else:
            if paths:
                logger.warning("snapkeep: committed %s at exit", paths)
    return lost


def _drain_at_exit() -> None:
    global _drained
    with _lock:
        if _drained:
            return
        _drained = True
    lost = drain()
    if lost:
        _lost.extend(lost)
        atexit.register(_exit_with_loss)  # the newest handler: runs first, runs the others


_finishing = False


def _exit_with_loss() -> None:
    global _finishing
    if _finishing:
        return
    _finishing = True
    logger.error("snapkeep: exiting with status %d: snapshot(s) %s were not committed",
                 EXIT_STATUS_LOST, _lost)
    atexit._run_exitfuncs()  # the other handlers, newest first (logging's flush, ...)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 -- a closed or broken stream: nothing left to flush
            pass
    os._exit(EXIT_STATUS_LOST)


def install() -> None:
    """Register the drain (see the module docstring); once per process, at import."""
    register_threading = getattr(threading, "_register_atexit", None)
    if register_threading is not None:
        register_threading(_drain_at_exit)
    atexit.register(_drain_at_exit)


install()

__all__ = ["EXIT_STATUS_LOST", "EXIT_WAIT_S", "Drainable", "DrainedAtExit", "discard", "drain",
           "register"]
