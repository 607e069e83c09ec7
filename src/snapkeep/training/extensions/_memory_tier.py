"""The memory tier for ppe's manager: an adapter on the tier layer every door uses
(:class:`snapkeep.tiers.TieredSession`, here without a session of its own: each snapshot
extension holds its session; the engine's module docstring,
:mod:`snapkeep._core.tiers.memory_tier`, says what the tier keeps, where, and how it
recovers). Use it beside an autoloading snapshot extension, registered after it::

    manager.extend(extensions.snapshot(autoload=True), trigger=(1000, "iteration"))
    manager.extend(extensions.memory_tier(MemoryTier(every=50, replicas=1)))

The adapter gives the engine the manager's state (``manager.state_dict()``; with SHARDED
snapshots this rank's local shards, :meth:`~._sharded._ShardedSnapshot.memory_state`), the
storage step, the apply (``manager.load_state_dict`` in place; SHARDED: the shards checked
against the live ones, else storage reshards, then copied into them), and the staged copy of a
snapshot extension's writer at the same iteration (no second staging). A RAM step newer than
storage is persisted by the snapshot extension; ``finalize`` after the stop trigger fired
removes the rank's tier, a crashed or killed run leaves it for its restart.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import snapkeep.training.extensions._lineage as _lineage
from snapkeep.staging import StagedLoan, into_existing_state, optimizers_in
from snapkeep.tiers import (
    MemoryTier,
    Restored,
    TieredSession,
    check_into_live,
    copy_into_live,
    flat_keys,
    state_bytes,
)
from snapkeep.training import extension
from snapkeep.wrapping import canonical_tree, live_tree

logger = logging.getLogger(__name__)


def memory_tier(tier: MemoryTier) -> _MemoryTierExtension:
    """The memory-tier extension for ``tier``; extend the manager with it (its trigger is
    ``(tier.every, 'iteration')``). See the module docstring of :mod:`._memory_tier`.

    Raises:
        TypeError: ``tier`` is not a :class:`MemoryTier`.
    """
    if not isinstance(tier, MemoryTier):
        raise TypeError(f"memory_tier expects a MemoryTier(every=..., ...), got {tier!r}")
    return _MemoryTierExtension(tier)


class _MemoryTierExtension(extension.Extension):
    """See :func:`memory_tier`."""

    # a snapshot-priority extension, run after the snapshots registered before it, so it may
    # borrow their staged copy; its recovery still runs before their autoload: they call
    # recover_before_autoload first
    priority = extension.PRIORITY_SNAPSHOT
    needs_model_state = True
    _snapkeep_memory_tier = True  # _lineage.MEMORY_TIER_MARKER

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier
        self.trigger = (tier.every, "iteration")
        self.restored: Restored | None = None
        self.layer: TieredSession | None = None
        self._failed = False
        self._sharded: Any = None

    @property
    def engine(self) -> Any:
        """The tier's engine (:class:`snapkeep._core.tiers.memory_tier.TierEngine`; None before
        ``initialize``)."""
        return None if self.layer is None else self.layer.engine

    def initialize(self, manager: Any) -> None:  # type: ignore[override]
        """Open the engine (tmpfs check, claim, reclaim of dead jobs' tiers) and recover from
        RAM when a snapshot extension autoloads; once (the snapshot extensions call it before
        their autoload: ``_lineage.recover_before_autoload``).

        Raises:
            MemoryTierTooSmallError, NotPrivateError, ValueError, CollectiveTimeoutError: as
                :meth:`snapkeep._core.tiers.memory_tier.TierEngine.open` and ``recover``.
        """
        if self.layer is not None:
            return
        snapshots = _lineage.snapshot_extensions(manager)
        writers = [getattr(s, "writer", None) for s in snapshots] + [
            getattr(manager, "writer", None)]
        if any(getattr(w, "staging_budget", None) is not None for w in writers):
            raise ValueError(
                "memory tier: a snapshot writer of this manager has a staging_budget; the tier "
                "keeps a full copy of the state in node RAM, which no budget below the state's "
                "size can hold (it would be memory outside the budget). Pass "
                "staging_budget=None to the writer, or do not extend the manager with the tier")
        # SHARDED snapshots: each rank's RAM snapshot is its part of what they save
        self._sharded = next((s for s in snapshots if s.sharded_directories), None)
        # named after (and competing with) the snapshots of the whole manager: a
        # snapshot_object registered first must not move the tier, and a snapshot of a model
        # alone, however new, is not a resumable step of the run
        whole = [s for s in snapshots if s.of_manager] or snapshots
        layer = self.layer = TieredSession(None, self.tier, directory=str(manager.out),
                                           template=whole[0].store_template if whole else "")
        engine = layer.engine
        layer.open_tier(state_bytes(canonical_tree(manager, manager.state_dict())))
        _say_if_before_snapshot(manager, self)
        if not any(s.autoload for s in snapshots):
            return
        sharded = self._sharded

        def prepare(state: Any) -> Any:  # SHARDED: the live local shards, checked
            live = sharded.memory_template(manager, flat_keys(state), engine.rank)
            check_into_live(live, state)
            return live, state

        def apply(tree: Any, step: int, path: str) -> None:
            if sharded is not None:
                live, state = tree
                copy_into_live(live, state)  # the live local shards, in place
                sharded.apply_memory_state(manager, live, path, step, engine.rank)
            else:
                with into_existing_state(optimizers_in(manager)):  # in place where shapes
                    manager.load_state_dict(live_tree(manager, tree))  # match

        steps = [s for s in (x.listed_storage_step(manager) for x in whole) if s is not None]
        self.restored = layer.recover(max(steps, default=None), apply,
                                      prepare=prepare if sharded is not None else None)

    def __call__(self, manager: Any) -> None:
        """Keep this rank's state in RAM (see
        :meth:`snapkeep._core.tiers.memory_tier.TierEngine.save`),
        borrowing the copy a snapshot extension's writer staged at this iteration when one did.

        Raises:
            SnapshotSaveError, SnapshotTimeoutError: as ``TierEngine.save``.
        """
        layer = self.layer
        if layer is None:
            raise RuntimeError("memory tier: called before initialize")
        sharded, rank = self._sharded, layer.engine.rank
        if sharded is not None:  # this rank's local shards and its non-tensor state
            layer.keep(int(manager.iteration), lambda: sharded.memory_state(manager, rank))
        else:
            layer.keep(int(manager.iteration),
                       lambda: canonical_tree(manager, manager.state_dict()),
                       borrow=lambda: _borrow(manager))

    def wait(self) -> None:
        """Wait for the RAM snapshot in flight (see
        :meth:`snapkeep._core.tiers.memory_tier.TierEngine.wait`)."""
        if self.layer is not None:
            self.layer.wait()

    def on_error(self, manager: Any, exc: Exception, tb: types.TracebackType) -> None:
        """Keep the tier: the run did not finish."""
        self._failed = True

    def finalize(self, manager: Any) -> None:
        """Close the engine: remove this rank's tier when the run finished (the stop trigger
        fired and no iteration raised); raise a background failure not reported yet.

        Raises:
            SnapshotSaveError, SnapshotTimeoutError: as ``TierEngine.close``.
        """
        if self.layer is None:
            return
        try:
            finished = bool(manager.stop_trigger)
        except Exception:  # a manager without a stop trigger: treat the run as unfinished
            finished = False
        self.layer.close_tier(finished=finished, failed=self._failed)


def _say_if_before_snapshot(manager: Any, tier: _MemoryTierExtension) -> None:
    """Log (info) when the tier was registered before a snapshot extension of the whole
    manager: it then runs first at a step both take and stages its own copy."""
    order = _lineage.registered_extensions(manager)
    if not any(x is tier for x in order):
        return
    after = order[[x is tier for x in order].index(True) + 1:]
    if any(getattr(x, _lineage.SNAPSHOT_MARKER, False) and x.of_manager for x in after):
        logger.info("memory tier: registered before the snapshot extension, so a step both "
                    "take is staged twice; extend the manager with the tier after the snapshot")


def _borrow(manager: Any) -> StagedLoan | None:
    """The staged copy of this iteration's state that a snapshot extension's writer took (a
    snapshot of the whole manager, fired earlier in this iteration), lent; None when none did."""
    for snap in _lineage.snapshot_extensions(manager):
        loan = snap.lend_staged(manager)
        if loan is not None:
            return loan
    return None


__all__ = ["MemoryTier", "Restored", "memory_tier"]
