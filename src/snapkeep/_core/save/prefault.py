"""No first-snapshot penalty: staging buffers allocated and faulted in before the first snapshot.

A background writer's first snapshot used to allocate its staging buffers (or a process writer's
shared-memory arena) and fault every page in while training waited: 9-24x the stall of later
snapshots. :func:`prefault_before_first_snapshot` does that work in a background thread as soon
as the state's layout is known, into the same buffers the first snapshot then reuses, so memory
stays one staging copy.

When is the layout known? Optimizers such as Adam create their state in their first ``step()``,
so while an optimizer has no state the prefault waits for the first step of every such optimizer
(a one-shot ``register_step_post_hook``); otherwise it starts at once. After a resume
(``after_first_step=True``) it always waits for the first step of every optimizer: filling the
buffers (faulting in as many fresh pages as the state has) then runs while training does
instead of delaying its start. A snapshot that arrives while the prefault still runs (or before
it started) waits for it, and stages exactly what it would have staged otherwise: the prefault
only allocates and zero-fills, it never reads the state's values.

A writer called directly (no manager) learns the layout only at its first call, so that call
faults its buffers in while the caller waits: on the 2-vCPU VM of the benchmarks, 1 GiB copied
into fresh pages took 1.34 s against 0.16 s into warm ones, a first call 9.9x a later one
(benchmarks/README.md, section 1). Faulting in with ``MADV_POPULATE_WRITE`` or in two threads
did not change that, and ``MADV_HUGEPAGE`` made it 3.4x slower there. Such a script gets the
extension's behaviour by calling ``writer.prefault(state_fn, optimizers)`` once its state exists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def prefault_before_first_snapshot(
    saver: Any, state_fn: Callable[[], Any], optimizers: Iterable[torch.optim.Optimizer],
    *, after_first_step: bool = False,
) -> None:
    """Prefault ``saver``'s staging buffers for the tree ``state_fn()`` returns, in a background
    thread, now or after the first step of each optimizer that has no state yet.

    Args:
        saver: a :class:`snapkeep._core.save.saver.Saver` (its ``prefault_async(tree)`` is called).
        state_fn: returns the tree a snapshot will stage (called in the caller's thread, or in
            the training thread right after an optimizer step).
        optimizers: the optimizers whose state is part of that tree.
        after_first_step: wait for the first step of every optimizer, also of those that have
            state (a resumed trainer: the preparation starts once training runs again).
    """
    optimizers = list(optimizers)
    lazy = optimizers if after_first_step else [o for o in optimizers if not o.state]
    if not lazy:
        _prefault(saver, state_fn)
        return
    waiting = {id(o) for o in lazy}
    lock = threading.Lock()
    handles: list[Any] = []

    def after_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        with lock:
            if id(optimizer) not in waiting:
                return
            waiting.discard(id(optimizer))
            done = not waiting
        if done:
            for handle in handles:
                handle.remove()
            _prefault(saver, state_fn)

    for optimizer in lazy:
        handles.append(optimizer.register_step_post_hook(after_step))
    logger.debug("staging buffers will be prefaulted after the first step of %d optimizer(s) "
                 "without state", len(lazy))


def _prefault(saver: Any, state_fn: Callable[[], Any]) -> None:
    """Never lets a preparation fail training: a state that cannot be built yet (an extension
    not initialized) is logged, and the first snapshot allocates as before."""
    try:
        tree = state_fn()
    except Exception as e:  # noqa: BLE001 -- an optimisation only; the snapshot reports its own
        logger.debug("staging buffers not prefaulted: the state could not be built yet (%s: %s)",
                     type(e).__name__, e)
        return
    saver.prefault_async(tree)
