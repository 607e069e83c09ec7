"""Overlapped staging with a mutation tripwire.

A snapshot taken inside the training loop needs a consistent copy of the state, but only some of
it can change before the next ``optimizer.step()``: the parameters an optimizer owns and that
optimizer's state change *only* in ``step()``. So the call copies at once everything else --
non-tensor leaves, small tensors (< :data:`MIN_DEFERRED_BYTES`), module buffers (BatchNorm
statistics change in the next forward), and every tensor no guarded optimizer owns (an EMA copy
updated in place right after the call) -- and copies the optimizer-owned storages in a background
thread while the next forward/backward runs. Anything that would mutate them waits first: a step
pre-hook on every guarded optimizer, the next snapshot of the same writer, and ``finalize``.

The tripwire: each deferred tensor's version counter (``Tensor._version``, bumped by every
in-place operation through autograd's view of the tensor, including ``optimizer.step()`` and
``param.add_(...)`` under ``torch.no_grad()``) is recorded at the call and checked right before
and right after its storage is copied. A tensor changed before it was staged makes that snapshot
fail with :class:`StagingRaceError`, naming the tensor: it is never written torn.

What the counter cannot see: writes through ``param.data`` (``.data`` is a tensor with a
version counter of its own), raw-pointer kernels or C extensions writing the memory directly,
``torch.Tensor.set_``/``storage`` swaps, and writes from other processes (shared memory).
Such code must not run between a snapshot call and the next step, or overlap must be off
(``extensions.snapshot(overlap=False)``). Overlap is used only for CPU tensors of plain
``torch.Tensor``/``nn.Parameter`` type; anything else is captured at the call, as without
overlap.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from snapkeep._core.errors import StagingRaceError
from snapkeep._core.host_memory import COPY_CHUNK_BYTES
from snapkeep._core.staging import BufferSet, StageStats, atomic, stage_split

if TYPE_CHECKING:
    from snapkeep._core.ticket import SaveHandle

logger = logging.getLogger(__name__)

#: Storages smaller than this are copied at the call even when an optimizer owns them.
MIN_DEFERRED_BYTES = 1 << 20

_Ident = tuple[str, int, int]


def _ident(t: torch.Tensor) -> _Ident:
    s = t.untyped_storage()
    return (str(s.device), s.data_ptr(), s.nbytes())


def owned_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[_Ident]:
    """Storages of the parameters and state tensors of ``optimizers``: what only their
    ``step()`` changes."""
    owned: set[_Ident] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                owned.add(_ident(p))
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    owned.add(_ident(value))
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapPlan:
    """Which storages of the next snapshot may be staged in the background.

    Attributes:
        deferred: storage identities (device, address, bytes) owned by guarded optimizers.
        min_bytes: smaller storages are copied at the call.
        before_copy: called in the staging thread before the deferred copies start (a test
            seam: a gate that holds the copy until the test has mutated the state).
    """

    deferred: frozenset[_Ident]
    min_bytes: int = MIN_DEFERRED_BYTES
    before_copy: Callable[[], None] | None = None

    def stage(self, buffers: BufferSet, tree: Any) -> tuple[Any, StageStats,
                                                            Callable[[], StageStats] | None]:
        """Copy what must be copied now; return ``(staged tree, stats, finish)``, where
        ``finish()`` (None when nothing is deferred) copies the rest with the tripwire and
        returns the final statistics.

        Raises:
            TypeError: as :meth:`BufferSet.stage`.
        """
        named = list(_named_tensors(tree))
        by_storage: dict[_Ident, list[tuple[str, torch.Tensor, int]]] = {}
        for name, t in named:
            ident = _ident(t)
            by_storage.setdefault(ident, []).append((name, t, t._version))
        blocked = {ident for ident, members in by_storage.items()
                   if not all(_overlappable(t) for _, t, _ in members)}

        def defer(ident: _Ident) -> bool:
            return ident in self.deferred and ident not in blocked and ident[2] >= self.min_bytes

        staged, stats, later = stage_split(buffers, tree, defer)
        if not later:
            return staged, stats, None
        watched = [(by_storage[ident], dst, src) for ident, src, dst in later]
        deferred_bytes = sum(src.nbytes() for _, _, src in watched)

        def finish() -> StageStats:
            if self.before_copy is not None:
                self.before_copy()
            for members, dst, src in watched:
                _check(members, "before it was staged")
                for off in range(0, src.nbytes(), COPY_CHUNK_BYTES):
                    ctypes.memmove(dst.data_ptr() + off, src.data_ptr() + off,
                                   min(COPY_CHUNK_BYTES, src.nbytes() - off))
                _check(members, "while it was staged")
            return dataclasses.replace(stats, tensor_bytes=stats.tensor_bytes + deferred_bytes)

        return staged, stats, finish


def _check(members: list[tuple[str, torch.Tensor, int]], when: str) -> None:
    for name, t, version in members:
        if t._version != version:
            raise StagingRaceError(
                f"the tensor at {name!r} was modified in place after the snapshot call and "
                f"{when} (version {version} -> {t._version}); this snapshot was not written. "
                "Optimizer-owned tensors are staged in the background until the next "
                "optimizer.step(): modify them only through that optimizer's step, or call "
                "writer.wait() before modifying them, or pass overlap=False to the snapshot "
                "extension")


class StagingGuard:
    """Makes guarded optimizers' ``step()`` wait for a background staging (a step pre-hook).

    Args:
        timeout_s: bound on one wait (None: as long as the staging thread runs; it only
            copies memory).
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        self._timeout_s = timeout_s
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._hooked: dict[int, Any] = {}

    def guard(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Register the wait as a step pre-hook of each optimizer (once per optimizer)."""
        for optimizer in optimizers:
            if id(optimizer) not in self._hooked:
                self._hooked[id(optimizer)] = optimizer.register_step_pre_hook(self._before_step)

    def track(self, future: Any) -> None:
        """Make the next step wait for ``future`` (a staging future)."""
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]

    def wait(self) -> None:
        """Wait for every tracked staging; their errors are left to the snapshot's own
        reporting (raised at the next snapshot or ``finalize``)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.exception(timeout=self._timeout_s)
            except TimeoutError:
                logger.warning("an optimizer step waited %s s for background staging; going on",
                               self._timeout_s)

    def _before_step(self, *_: Any) -> None:
        self.wait()

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()


def arm(saver: Any, optimizers: Iterable[torch.optim.Optimizer], guard: StagingGuard, *,
        before_copy: Callable[[], None] | None = None) -> bool:
    """Make ``saver``'s next snapshot stage ``optimizers``' parameters and state in the
    background, their ``step()`` waiting for it (``guard``). Returns False (nothing armed) for a
    saver that does not stage (``SimpleWriter``) or without optimizers."""
    optimizers = list(optimizers)
    if not optimizers or not getattr(saver, "_stage", False):
        return False
    guard.guard(optimizers)
    saver.overlap_next(OverlapPlan(deferred=frozenset(owned_storages(optimizers)),
                                   before_copy=before_copy))
    return True


# -- the background staging thread ------------------------------------------------------------
def finish_in_background(handle: SaveHandle, finish: Callable[[], StageStats]) -> None:
    """Run ``finish`` (the rest of an :meth:`OverlapPlan.stage`) on the one background staging
    thread and resolve ``handle.staged`` with its stats or its error."""

    def work() -> None:
        try:
            stats = finish()
        except BaseException as e:  # reported through the snapshot's committed future
            logger.error("background staging of %s (step %s) failed: %s", handle.path,
                         handle.step, e)
            handle.staged.set_exception(e)
        else:
            handle.staged.set_result(stats)

    _overlap_stage_pool().submit(work)


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
