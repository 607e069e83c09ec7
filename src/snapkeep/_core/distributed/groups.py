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

All three are created with ``timeout=timeout_s``, so a rank that died or hangs makes the others'
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

from snapkeep._core.distributed.launcher import watch_launcher
from snapkeep._core.load.preflight import check_timeout_s

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
        timeout_s: the bound of every collective on the three groups.

    The groups are released at interpreter exit (:func:`release_groups`); reading one after that
    raises ``RuntimeError``.
    """

    rank: int
    world_size: int
    timeout_s: float
    _held: dict[str, dist.ProcessGroup] = dataclasses.field(repr=False)

    @property
    def commit(self) -> dist.ProcessGroup:
        return self._group("commit")

    @property
    def control(self) -> dist.ProcessGroup:
        return self._group("control")

    @property
    def peer(self) -> dist.ProcessGroup:
        return self._group("peer")

    def _group(self, name: str) -> dist.ProcessGroup:
        group = self._held.get(name)
        if group is None:
            raise RuntimeError(f"snapkeep's {name} process group was released at interpreter "
                               "exit; nothing can run collectives on it any more")
        return group

    def release(self) -> None:
        """Destroy the three groups if torch still registers them, then drop them, so that their
        gloo worker threads are joined now (the destructor releases the GIL while it joins).
        Idempotent."""
        held = list(self._held.values())
        self._held.clear()
        if dist.is_available() and dist.is_initialized():
            for group in held:
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError, KeyError):  # already destroyed by the script
                    pass
        del held  # the last references: ~ProcessGroupGloo joins its threads here


def require_initialized(who: str) -> None:
    """Raise unless ``torch.distributed`` has a default process group.

    Raises:
        RuntimeError: naming ``who`` and how to fix it.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{who} requires torch.distributed to be initialized "
            "(torch.distributed.init_process_group, e.g. under torchrun) before it is created")


def job_rank() -> int:
    """This process's rank in the job: the default process group's when one is initialized,
    else torchrun's ``RANK`` environment variable, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def job_world_size() -> int:
    """The number of ranks in the job: the default process group's when one is initialized,
    else torchrun's ``WORLD_SIZE`` environment variable, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


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
    check_timeout_s(timeout_s)
    require_initialized("snapkeep's distributed snapshots")
    watch_launcher()  # a worker orphaned by a killed torchrun ends instead of holding the lock
    with _lock:
        found = _cache.get(float(timeout_s))
        if found is not None:
            return found
        timeout = datetime.timedelta(seconds=float(timeout_s))
        held = {name: dist.new_group(backend="gloo", timeout=timeout)
                for name in ("commit", "control", "peer")}
        groups = Groups(rank=dist.get_rank(), world_size=dist.get_world_size(),
                        timeout_s=float(timeout_s), _held=held)
        if not _cache and not _release_registered:
            _register_release()
        _cache[float(timeout_s)] = groups
        logger.debug("rank %d: created snapkeep's commit and control groups (timeout %.1f s)",
                     groups.rank, timeout_s)
        return groups


def forget_groups() -> None:
    """Drop the cached groups (after ``destroy_process_group``; the next call creates new ones)."""
    with _lock:
        _cache.clear()


_release_registered = False


def _register_release() -> None:
    global _release_registered
    _release_registered = True
    atexit.register(release_groups)


def release_groups() -> None:
    """Release every group snapkeep created (:meth:`Groups.release`); registered with ``atexit``
    when the first groups are created.

    Why at exit: a gloo group that outlives the script into interpreter finalization keeps its
    worker threads, and a worker that drops the last reference to a collective's tensors there
    needs the GIL, which finalization no longer grants: the thread is unwound through a
    ``noexcept`` destructor and the process aborts (SIGABRT, "terminate called without an active
    exception", exit -6 after a run that succeeded). The script's own
    ``destroy_process_group()`` does not prevent it: snapkeep's extensions still hold the groups.
    Measured with the 2-rank torchrun status test worker: 6 aborts in 30 runs before, 0 in 40
    with this release (``atexit`` handlers run after the exit drain, before finalization).
    """
    with _lock:
        groups = list(_cache.values())
        _cache.clear()
    for found in groups:
        found.release()


def exit_cleanly_at_exit(code: int) -> None:
    """Make the coming interpreter exit end with ``code``, without interpreter teardown.

    For the exit snapkeep itself starts under torch.distributed (the preemption extension's
    ``SystemExit(code)`` after every rank has agreed and committed). Interpreter teardown with
    torch.distributed's gloo backend loaded sometimes aborts the process in C++ (SIGABRT,
    "terminate called without an active exception", exit -6 instead of ``code``): 1 exit in 24
    here with the process groups left alive, and still about 1 in 15 after destroying them at
    exit: a gloo worker thread alive into finalization needs the GIL to drop a collective's
    tensors (see :func:`release_groups`, which now removes that cause for every exit). The
    preemption exit keeps this second guard: the hook registered here,
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
