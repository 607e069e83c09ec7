"""Overlapped staging, validated on the training thread.

A snapshot taken inside the training loop needs a consistent copy of the state, but only some of
it can change before the next ``optimizer.step()``: the parameters an optimizer owns and that
optimizer's state change *only* in ``step()``. So the call copies at once everything else --
non-tensor leaves, small tensors (< :data:`MIN_DEFERRED_BYTES`), module buffers (BatchNorm
statistics change in the next forward), and every tensor no guarded optimizer owns (an EMA copy
updated in place right after the call) -- and copies the optimizer-owned storages in a background
thread while the next forward/backward runs. Anything that would mutate them waits first: a step
pre-hook on every guarded optimizer, the next snapshot of the same writer, and ``finalize``.

Why the check is not made by the copying thread: each deferred tensor's version counter
(``Tensor._version``, bumped by every in-place operation through autograd's view of the tensor,
including ``optimizer.step()`` and ``param.add_(...)`` under ``torch.no_grad()``) is recorded at
the call. torch bumps it when the in-place kernel *finishes*, so a thread that reads the counter
while a write is still running sees the old value and would publish a torn copy. The background
thread therefore only copies. The verdict is given on the training thread, at the first *safe
point* after the copy finished (:class:`PendingVerdict`):

- the step pre-hook of a guarded optimizer, after waiting for the copy;
- the end of ``run_iteration`` (snapkeep's manager; only when the copy is already done);
- the next snapshot call;
- ``finalize`` (of the extension, the writer or the saver).

Every in-place write the training thread issued before that point has finished, so its counter
has moved. Counters unchanged: the copy holds the values of the call, and only then may the
writer publish it (``handle.staged`` resolves; the write waits for it, so a process worker is
never even sent an unvalidated snapshot). A counter moved: the snapshot is dropped (never written,
never resumed from) and the plan's ``on_race`` decides what the run does. Should the thread that
made the call end before any safe point (interpreter exit without ``finalize``), the writer gives
the verdict itself: that thread's writes have all finished.

What the counter cannot see: writes through ``param.data`` (``.data`` is a tensor with a
version counter of its own), raw-pointer kernels or C extensions writing the memory directly,
``torch.Tensor.set_``/``storage`` swaps, writes from other threads that are still running at the
safe point, and writes from other processes (shared memory). Such code must not run between a
snapshot call and the next step, or overlap must be off (``extensions.snapshot(overlap=False)``).
Overlap is used only for CPU tensors of plain ``torch.Tensor``/``nn.Parameter`` type; anything
else is captured at the call, as without overlap.

CUDA tensors are copied in the call today (:func:`snapkeep._core.save.staging.BufferSet.stage`
synchronises its side stream before the call returns). The same argument holds for an overlapped
device copy, with stream order in place of counters: a device-to-host copy enqueued on the
training's current stream *before the call returns* is ordered before every kernel launched after
the call on that stream, so the optimizer's in-place kernels cannot overtake it. A copy on a side
stream (or a kernel launched on another stream) is not ordered that way: the stream that writes
must first wait on an event recorded after the copy (``stream.wait_event``), or it may write the
memory while the copy reads it. A counter check would not help there either: counters move when a
kernel is *launched*, not when it runs.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from snapkeep._core.errors import SnapshotTimeoutError, StagingRaceError
from snapkeep._core.save.host_memory import COPY_CHUNK_BYTES
from snapkeep._core.save.staging import BufferSet, StageStats, atomic, stage_split

if TYPE_CHECKING:
    from snapkeep._core.save.ticket import SaveHandle

logger = logging.getLogger(__name__)

#: Storages smaller than this are copied at the call even when an optimizer owns them.
MIN_DEFERRED_BYTES = 1 << 20
#: How often a writer waiting for a verdict checks that the calling thread still runs, s.
_POLL_S = 0.5

#: A storage's identity: ``(device, address, bytes)``.
Ident = tuple[str, int, int]
#: ``on_race(error)``: what the run does when a counter moved (called on the training thread,
#: after the snapshot was dropped); raising stops the run there.
OnRace = Callable[[StagingRaceError], None]


def storage_ident(t: torch.Tensor) -> Ident:
    """``(device, address, bytes)`` of ``t``'s storage (a DTensor's: its local shard's)."""
    # a DTensor's own storage is not readable: its local shard's (what ``to_local()`` returns,
    # without that call's autograd Function, ~15 us)
    local = getattr(t, "_local_tensor", None)
    s = (t if local is None else local).untyped_storage()
    return (str(s.device), s.data_ptr(), s.nbytes())


def owned_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[Ident]:
    """Storages of the parameters and state tensors of ``optimizers`` (of a DTensor: its local
    shard's): what only their ``step()`` changes."""
    owned: set[Ident] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                owned.add(storage_ident(p))
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    owned.add(storage_ident(value))
    return owned


def _named_tensors(node: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if atomic(node):
        return
    if isinstance(node, torch.Tensor):
        yield path or "<root>", node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _named_tensors(value, f"{path}/{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _named_tensors(value, f"{path}/{i}" if path else str(i))


def _overlappable(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" \
        and t.layout == torch.strided


_Member = tuple[str, torch.Tensor, int]  # (tree path, tensor, version at the call)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapPlan:
    """Which storages of the next snapshot may be staged in the background.

    Attributes:
        deferred: storage identities (device, address, bytes) owned by guarded optimizers.
        min_bytes: smaller storages are copied at the call.
        before_copy: called in the staging thread before the deferred copies start (a test
            seam: a gate that holds the copy until the test has mutated the state).
        on_race: called on the training thread with the :class:`StagingRaceError` when a
            deferred tensor's version counter moved (the snapshot is already dropped); ``None``
            raises it there.
    """

    deferred: frozenset[Ident]
    min_bytes: int = MIN_DEFERRED_BYTES
    before_copy: Callable[[], None] | None = None
    on_race: OnRace | None = None

    def stage(self, buffers: BufferSet, tree: Any) -> tuple[Any, StageStats,
                                                            DeferredCopy | None]:
        """Copy what must be copied now; return ``(staged tree, stats, deferred)``, where
        ``deferred`` (None when nothing is deferred) copies the rest and knows the version
        counters recorded now.

        Raises:
            TypeError: as :meth:`BufferSet.stage`.
        """
        defer, by_storage = self.protection(tree)
        staged, stats, later = stage_split(buffers, tree, defer)
        if not later:
            return staged, stats, None
        return staged, stats, DeferredCopy(
            copies=[(dst, src) for _, src, dst in later],
            members=[m for ident, _, _ in later for m in by_storage[ident]],
            stats=stats, before_copy=self.before_copy)


    def protection(self, tree: Any) -> tuple[Callable[[Ident], bool],
                                              dict[Ident, list[_Member]]]:
        """``(defer, members)``: ``defer(ident)`` tells whether the storage ``ident`` (device,
        address, bytes) of ``tree`` may be copied after the call (a guarded optimizer owns it,
        it is large enough, and every tensor viewing it can be overlapped); ``members`` maps
        each storage to its ``(tree path, tensor, version counter now)``."""
        by_storage: dict[Ident, list[_Member]] = {}
        for name, t in _named_tensors(tree):
            by_storage.setdefault(storage_ident(t), []).append((name, t, t._version))
        blocked = {ident for ident, members in by_storage.items()
                   if not all(_overlappable(t) for _, t, _ in members)}

        def defer(ident: Ident) -> bool:
            return ident in self.deferred and ident not in blocked and ident[2] >= self.min_bytes

        return defer, by_storage


class DeferredCopy:
    """The background half of an overlapped staging: :meth:`copy` (any thread; only copies)
    and :meth:`moved` (the training thread, at a safe point after the copy)."""

    def __init__(self, *, copies: list[tuple[torch.UntypedStorage, torch.UntypedStorage]],
                 members: list[_Member], stats: StageStats,
                 before_copy: Callable[[], None] | None) -> None:
        self._copies = copies  # (buffer, source storage)
        self.members = members
        self._stats = stats
        self._before_copy = before_copy

    def copy(self) -> StageStats:
        """Copy the deferred storages into their buffers; return the snapshot's final stats."""
        if self._before_copy is not None:
            self._before_copy()
        for dst, src in self._copies:
            for off in range(0, src.nbytes(), COPY_CHUNK_BYTES):
                ctypes.memmove(dst.data_ptr() + off, src.data_ptr() + off,
                               min(COPY_CHUNK_BYTES, src.nbytes() - off))
        deferred_bytes = sum(src.nbytes() for _, src in self._copies)
        return dataclasses.replace(self._stats,
                                   tensor_bytes=self._stats.tensor_bytes + deferred_bytes)

    def moved(self) -> StagingRaceError | None:
        """The error naming the first deferred tensor whose version counter moved since the
        call, or None. Sound only on the thread that writes the tensors, after the copy."""
        return first_moved(self.members)


def first_moved(members: Iterable[tuple[str, torch.Tensor, int]]) -> StagingRaceError | None:
    """The :func:`race_error` of the first ``(tree path, tensor, version at the call)`` whose
    tensor's version counter moved since, or None."""
    for name, t, version in members:
        if t._version != version:
            return race_error(name, version, t._version)
    return None


def race_error(name: str, before: int, after: int) -> StagingRaceError:
    """The :class:`StagingRaceError` for the tensor at ``name`` (its counter ``before`` at the
    call, ``after`` at the verdict)."""
    return StagingRaceError(
        f"the tensor at {name!r} was modified in place after the snapshot call and before its "
        f"background copy was validated (version {before} -> {after}); that snapshot was "
        "dropped (not written, never resumed from). Optimizer-owned tensors are staged in the "
        "background until the next optimizer.step(): modify them only through that optimizer's "
        "step or after it, or pass overlap=False to the snapshot extension")


class BackgroundCopy(Protocol):
    """The background half of an overlapped staging: :class:`DeferredCopy` (single files),
    :class:`snapkeep._core.distributed.staging.ShardCopies` (sharded)."""

    def copy(self) -> Any:
        """Copy (any thread); returns what ``staged`` resolves with."""

    def moved(self) -> StagingRaceError | None:
        """The race, checked on the training thread after the copy."""


class Verdicted(Protocol):
    """What a verdict resolves: a :class:`~snapkeep._core.save.ticket.SaveHandle`, or a sharded
    save's (its ``path``, ``step`` and ``staged`` future)."""

    @property
    def path(self) -> str:
        """The snapshot's path (log lines)."""

    @property
    def step(self) -> int | None:
        """Its step (log lines)."""

    @property
    def staged(self) -> concurrent.futures.Future[Any]:
        """Resolved with the verdict."""


class PendingVerdict:
    """One overlapped snapshot between its call and its verdict.

    The copy runs on the one background staging thread (:meth:`start`); :meth:`settle` gives
    the verdict on the training thread (see the module docstring); the writer waits for it in
    :meth:`wait` before writing anything. ``handle.staged`` carries the verdict: the copy's
    result (single files: the final :class:`StageStats`), or the :class:`StagingRaceError` /
    copy error that drops the snapshot.
    """

    def __init__(self, handle: Verdicted | SaveHandle, deferred: BackgroundCopy,
                 on_race: OnRace | None) -> None:
        self.handle = handle
        self.on_race = on_race
        self._deferred = deferred
        self._caller = threading.current_thread()
        self._lock = threading.Lock()
        self.copied: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def start(self) -> None:
        """Start the copy on the background staging thread."""
        copied, deferred, handle = self.copied, self._deferred, self.handle

        def work() -> None:
            try:
                copied.set_result(deferred.copy())
            except BaseException as e:  # reported through the verdict
                logger.error("background staging of %s (step %s) failed: %s", handle.path,
                             handle.step, e)
                copied.set_exception(e)

        _overlap_stage_pool().submit(work)

    def made_here(self) -> bool:
        """Whether the current thread made the snapshot call (its waits are safe points)."""
        return threading.current_thread() is self._caller

    @property
    def settled(self) -> bool:
        return self.handle.staged.done()

    def settle(self, *, block: bool, timeout_s: float | None = None) -> StagingRaceError | None:
        """Give the verdict, on the thread that made the call (a safe point). With
        ``block=False`` nothing happens while the copy still runs. Returns the race error when
        a counter moved (the snapshot is dropped; the caller reports it), else None.

        Raises:
            SnapshotTimeoutError: ``block`` and the copy not done within ``timeout_s``.
        """
        if self.settled or (not block and not self.copied.done()):
            return None
        try:
            stats = self.copied.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise SnapshotTimeoutError(
                f"background staging of {self.handle.path!r} not done after {timeout_s} s") from e
        except BaseException as e:  # the copy failed: so does the snapshot
            self._decide(e)
            return None
        race = self._deferred.moved()
        self._decide(race if race is not None else stats)
        return race

    def wait(self, timeout_s: float | None, warn_after_s: float) -> StageStats:
        """The writer's wait for the verdict (any thread); returns the stats of a validated
        snapshot. Called by the thread that made the call (a synchronous save), or should that
        thread end first, the verdict is given here: its writes have all finished (a race is
        logged or raised as the drop, never passed to ``on_race``).

        Raises:
            StagingRaceError: a counter moved: the snapshot was dropped; write nothing.
            SnapshotTimeoutError: no verdict within ``timeout_s`` (None: as long as the thread
                that made the call runs, logging every ``warn_after_s`` seconds).
            Exception: the copy's own error.
        """
        if self.made_here():  # a synchronous save: the thread that must settle waits here
            race = self.settle(block=True, timeout_s=timeout_s)
            if race is not None:
                raise race
        start = time.monotonic()
        next_warn = start + warn_after_s
        while True:
            try:
                return self.handle.staged.result(timeout=_POLL_S)
            except concurrent.futures.TimeoutError:
                pass
            if not self._caller.is_alive():
                race = self.settle(block=True, timeout_s=timeout_s)
                if race is not None:
                    logger.warning("%s", race)
                continue
            now = time.monotonic()
            if timeout_s is not None and now - start >= timeout_s:
                raise SnapshotTimeoutError(
                    f"snapshot {self.handle.path!r} was not validated within {timeout_s} s "
                    "(its background copy is validated at the next optimizer step, snapshot or "
                    "finalize)")
            if now >= next_warn:
                next_warn = now + warn_after_s
                logger.warning("snapshot %s still waits for the training thread to validate "
                               "its background copy (%.0f s): the next optimizer.step(), "
                               "snapshot or finalize does", self.handle.path, now - start)

    def drop(self, error: BaseException) -> None:
        """Drop the snapshot without a verdict (its writer was closed first): never written."""
        self._decide(error)

    def _decide(self, outcome: Any) -> None:
        with self._lock:
            if self.settled:
                return
            if isinstance(outcome, BaseException):
                self.handle.staged.set_exception(outcome)
            else:
                self.handle.staged.set_result(outcome)


class StagingGuard:
    """The training-thread side of overlapped staging for one snapshot extension: makes
    guarded optimizers' ``step()`` wait for a background copy and validate it (a step pre-hook),
    and settles the savers it armed at the other safe points.

    Args:
        timeout_s: bound on the step's wait for one copy (None: as long as the staging thread
            runs; it only copies memory).
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        self._timeout_s = timeout_s
        self._savers: list[Any] = []
        self._hooked: dict[int, Any] = {}

    def guard(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Register the wait as a step pre-hook of each optimizer (once per optimizer)."""
        for optimizer in optimizers:
            if id(optimizer) not in self._hooked:
                self._hooked[id(optimizer)] = optimizer.register_step_pre_hook(self._before_step)

    def track(self, saver: Any) -> None:
        """Settle ``saver``'s overlapped snapshots (``saver.settle_overlap``) at this guard's
        safe points."""
        if not any(s is saver for s in self._savers):
            self._savers.append(saver)

    def settle(self, *, block: bool = True) -> None:
        """A safe point (training thread): validate every tracked snapshot whose copy is done;
        with ``block``, wait for the copies first.

        Raises:
            StagingRaceError: from the plan's ``on_race`` (``None`` or a strict extension).
        """
        for saver in list(self._savers):
            saver.settle_overlap(block=block)

    def _before_step(self, *_: Any) -> None:
        self.settle(block=True)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()


def arm(saver: Any, optimizers: Iterable[torch.optim.Optimizer], guard: StagingGuard, *,
        before_copy: Callable[[], None] | None = None, on_race: OnRace | None = None) -> bool:
    """Make ``saver``'s next snapshot stage ``optimizers``' parameters and state in the
    background, their ``step()`` waiting for it and validating it (``guard``); ``on_race`` as
    :class:`OverlapPlan`'s. Returns False (nothing armed) for a saver that does not stage
    (``SimpleWriter``) or without optimizers."""
    optimizers = list(optimizers)
    if not optimizers or not getattr(saver, "_stage", False):
        return False
    guard.guard(optimizers)
    guard.track(saver)
    saver.overlap_next(OverlapPlan(deferred=frozenset(owned_storages(optimizers)),
                                   before_copy=before_copy, on_race=on_race))
    return True


# -- the background staging thread ------------------------------------------------------------
_OVERLAP_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_OVERLAP_POOL_LOCK = threading.Lock()


def _overlap_stage_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One persistent thread for background staging (a thread started per snapshot cost the
    call ~1 ms on a busy machine; one staging runs at a time, since the next snapshot waits
    for the previous one's)."""
    global _OVERLAP_POOL
    with _OVERLAP_POOL_LOCK:
        if _OVERLAP_POOL is None:
            _OVERLAP_POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="snapkeep-overlap-stage")
        return _OVERLAP_POOL


def _forget_overlap_pool_in_child() -> None:
    """A forked child has the pool object but not its thread."""
    global _OVERLAP_POOL, _OVERLAP_POOL_LOCK
    _OVERLAP_POOL = None
    _OVERLAP_POOL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_overlap_pool_in_child)
