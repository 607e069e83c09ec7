"""Workers end with their torchrun launcher.

torchrun's agent starts each rank as its child and, on SIGTERM, forwards the signal. When the
agent itself is killed (``kill -9`` of the job's visible process, an OOM kill of the agent), its
workers are re-parented and train on: measured here with ``torchrun --nproc-per-node 2 -m
snapkeep.demo_sharded``, both workers were still training 10 s after the agent's SIGKILL and kept
the out_dir's lock, so the rerun of the same command stopped at start (``StoreLockedError``:
"in use by another trainer") instead of resuming. Under SLURM or Kubernetes the whole job is
killed at once; a bare torchrun has no such guarantee.

:func:`watch_launcher` makes a torchrun worker follow its agent: a daemon thread notices within
``interval_s`` that the parent process changed and ends the worker with SIGKILL, as if the job
had been killed whole. That is a crash snapkeep is built to survive: the rerun resumes from the
newest committed snapshot. ``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that
started the child ends, which a launcher may do while it lives on.

A worker that can still make something of its last moments registers
:func:`on_orphaned` (the preemption extension does): the watch then calls its handler once
instead of ending the worker at once, and ends it only if it still lives ``grace_s`` later.
torchrun's agent dies of a signal it does not handle, SIGUSR1 included (SLURM's
``--signal=USR1@<s>`` preemption notice sent to the agent, or to the whole job step): with the
handler its workers commit a preemption snapshot and exit instead of being killed before they
could.

The first worker to notice ends, and the other's next collective with it fails at once ("Connection
closed by peer"), often before its own watch looks again: :func:`end_if_orphaned`, called where an
iteration's error is handled (the manager's ``on_error``), ends that worker the same way, with the
same message instead of a traceback of the lost peer.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
"""Default seconds between two checks of the parent process."""

_started = False
_parent: int | None = None  # the agent's pid when the watch started
_lock = threading.Lock()
_orphan_handler: tuple[Callable[[int], None], float] | None = None  # (handler, grace_s)


def under_torchrun() -> bool:
    """Whether this process is a torchrun (torch.distributed.elastic) worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_launcher(interval_s: float = INTERVAL_S) -> bool:
    """Under torchrun, start (once per process) the thread that ends this worker when its agent
    is gone. Returns whether a watch runs. Nothing happens outside torchrun, on platforms without
    ``os.getppid`` semantics (Windows), or when the parent is already init (pid 1).

    Raises:
        ValueError: ``interval_s`` is not a positive number of seconds.
    """
    global _started, _parent
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) \
            or interval_s <= 0:
        raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    if not under_torchrun() or sys.platform == "win32":
        return False
    parent = os.getppid()
    if parent <= 1:
        return False
    with _lock:
        if _started:
            return True
        _started, _parent = True, parent
    thread = threading.Thread(target=_watch, args=(parent, float(interval_s)), daemon=True,
                              name="snapkeep-launcher-watch")
    thread.start()
    return True


def on_orphaned(handler: Callable[[int], None] | None, grace_s: float = 0.0) -> None:
    """When the agent is gone, call ``handler(agent_pid)`` once from the watch thread instead
    of ending this worker at once, and end it ``grace_s`` seconds later if it still lives (see
    the module docstring); ``None`` restores ending at once. The handler must only record (it
    runs on the watch thread while the training thread goes on).

    Raises:
        ValueError: ``grace_s`` is negative or not a number.
    """
    global _orphan_handler
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s < 0:
        raise ValueError(f"grace_s must be a number of seconds >= 0, got {grace_s!r}")
    _orphan_handler = None if handler is None else (handler, float(grace_s))


def end_if_orphaned() -> None:
    """End this worker now, as the watch would within ``interval_s``, when its torchrun agent is
    gone (see the module docstring); otherwise (or without a watch) return."""
    parent = _parent
    if parent is not None and os.getppid() != parent:
        _end(parent)


def _watch(parent: int, interval_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(interval_s):
        if os.getppid() != parent:
            registered = _orphan_handler
            if registered is not None:
                handler, grace_s = registered
                _say(f"snapkeep: torchrun's agent (pid {parent}) is gone; this worker (pid "
                     f"{os.getpid()}) snapshots and exits (ended in {grace_s:g} s at the "
                     "latest).\n")
                try:
                    handler(parent)
                except Exception:  # noqa: BLE001 -- the worker is ended below regardless
                    logger.exception("the orphaned-worker handler failed")
                stop.wait(grace_s)
            _end(parent)


def _say(line: str) -> None:
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 -- a closed stderr must not keep the worker alive
        pass


def _end(parent: int) -> None:
    _say(f"snapkeep: torchrun's agent (pid {parent}) is gone; ending this worker (pid "
         f"{os.getpid()}) as the job was killed. Rerun the same command to resume from the "
         "newest committed snapshot.\n")
    os.kill(os.getpid(), signal.SIGKILL)
