"""Process groups for snapkeep's own collectives, kept apart from the training's.

Three gloo groups over all ranks, created once per process (a collective call: every rank creates
them at the same point, in ``initialize`` of the first sharded/preemption extension):

- ``commit``: used only by the background commit thread (DCP's planning collectives, gathering
  every rank's success and checksums). Nothing on the training thread uses it, so a commit never
  interleaves with the training's own collectives.
- ``control``: used only by the training thread for snapkeep's agreements (which snapshot to
  resume, the preemption flag, on-error snapshots).
- ``peer``: used only by the memory tier's background thread (peer copies of each rank's RAM
  snapshot), so a peer copy never interleaves with a commit or an agreement.

Both are created with ``timeout=timeout_s``, so a rank that died or hangs makes the others'
collectives on them fail within that time instead of blocking forever (gloo honours the group
timeout per operation).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import sys
import threading
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_cache: dict[float, Groups] = {}
_exit_hook_registered = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Groups:
    """snapkeep's process groups (see the module docstring).

    Attributes:
        rank: this process's rank in the default group.
        world_size: number of ranks.
        commit: group of the background commit thread.
        control: group of the training thread's agreements.
        peer: group of the memory tier's peer-copy thread.
        timeout_s: the bound of every collective on both groups.
    """

    rank: int
    world_size: int
    commit: dist.ProcessGroup
    control: dist.ProcessGroup
    peer: dist.ProcessGroup
    timeout_s: float


def require_initialized(who: str) -> None:
    """Raise unless ``torch.distributed`` has a default process group.

    Raises:
        RuntimeError: naming ``who`` and how to fix it.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{who} requires torch.distributed to be initialized "
            "(torch.distributed.init_process_group, e.g. under torchrun) before it is created")


def is_distributed() -> bool:
    """Whether a default process group exists (else snapkeep runs single-process)."""
    return dist.is_available() and dist.is_initialized()


def background_groups(timeout_s: float) -> Groups:
    """snapkeep's groups with collective timeout ``timeout_s`` (created on the first call with
    that timeout; a collective call on the first use: every rank must make it).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``timeout_s`` is not a positive number.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    require_initialized("snapkeep's distributed snapshots")
    with _lock:
        found = _cache.get(float(timeout_s))
        if found is not None:
            return found
        timeout = datetime.timedelta(seconds=float(timeout_s))
        commit = dist.new_group(backend="gloo", timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        peer = dist.new_group(backend="gloo", timeout=timeout)
        groups = Groups(rank=dist.get_rank(), world_size=dist.get_world_size(), commit=commit,
                        control=control, peer=peer, timeout_s=float(timeout_s))
        _cache[float(timeout_s)] = groups
        logger.debug("rank %d: created snapkeep's commit and control groups (timeout %.1f s)",
                     groups.rank, timeout_s)
        return groups


def forget_groups() -> None:
    """Drop the cached groups (after ``destroy_process_group``; the next call creates new ones)."""
    with _lock:
        _cache.clear()


def exit_cleanly_at_exit(code: int) -> None:
    """Make the coming interpreter exit end with ``code``, without interpreter teardown.

    For the exit snapkeep itself starts under torch.distributed (the preemption extension's
    ``SystemExit(code)`` after every rank has agreed and committed). Interpreter teardown with
    torch.distributed's gloo backend loaded sometimes aborts the process in C++ (SIGABRT,
    "terminate called without an active exception", exit -6 instead of ``code``): 1 exit in 24
    here with the process groups left alive, and still about 1 in 15 after destroying them at
    exit (PyTorch's own open issue: scripts must call ``destroy_process_group``, and even then
    objects holding the groups are torn down with the interpreter). So the hook registered here,
    which runs at exit after the script's ``finally`` blocks, destroys the process groups if the
    script has not, runs every other ``atexit`` handler (newest first, as the interpreter would:
    logging's flush, wandb's finish, ...), flushes stdout and stderr, and ends the process with
    ``os._exit(code)``, skipping only the teardown that aborts. An exception that escaped the
    script after the ``SystemExit`` (``sys.excepthook`` ran) exits with 1 instead. Registered
    once per process.
    """
    global _exit_hook_registered
    with _lock:
        if _exit_hook_registered:
            return
        _exit_hook_registered = True
    escaped: list[bool] = []
    previous_hook = sys.excepthook

    def excepthook(*args: Any) -> None:
        escaped.append(True)
        previous_hook(*args)

    sys.excepthook = excepthook
    atexit.register(_exit_without_teardown, code, escaped)


_finishing = False


def _exit_without_teardown(code: int, escaped: list[bool]) -> None:
    global _finishing
    if _finishing:  # reached again from the _run_exitfuncs call below
        return
    _finishing = True
    _destroy_if_alive()
    atexit._run_exitfuncs()  # the other handlers, newest first; each one's error is printed
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 -- a closed or broken stream: nothing left to flush
            pass
    os._exit(1 if escaped else code)


def _destroy_if_alive() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # exiting anyway: say why the groups were left to the interpreter
        logger.warning("could not destroy the process groups at exit: %s", e)
    forget_groups()
