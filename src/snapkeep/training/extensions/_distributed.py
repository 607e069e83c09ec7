"""The snapshot extension under ``torch.distributed`` (``snapshot(saver_rank=...)``, ppe's
``_DistributedSnapshot``): only the saver rank writes, deletes and locks; every rank loads the
snapshot the saver rank chose, and every rank's RNG state travels in the saver's snapshot.

Autoload with every rank agreeing.

ppe's distributed autoload lets each rank pick and fall back on its own, so ranks that do not
see the same files (node-local disks; one rank's newest file missing or corrupt) resume at
different iterations. Here, on snapkeep's ``control`` group (bounded by ``timeout_s``):

1. every rank lists its directory; the candidates are the union, newest first;
2. the saver rank verifies each candidate (checksum against its manifest) until one passes; a
   candidate the saver rank lacks or cannot verify is skipped by all ranks together;
3. every other rank uses its own copy when it has one that verifies, else receives the saver
   rank's verified bytes (one broadcast): node-local directories work, where only the saver
   rank's disk holds the snapshots;
4. every rank loads and applies it; the outcomes are exchanged, so a rank that fails makes
   every rank raise the same :class:`~snapkeep.errors.RankFailedError` naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed

from snapkeep.distributed import (
    all_gather,
    background_groups,
    exchange_outcomes,
)
from snapkeep.layout import capture_rng_state, restore_rng_state
from snapkeep.store import (
    Entry,
    SnapshotStore,
    check_timeout_s,
)
from snapkeep.training.extensions._snapshot_extension import SnapshotExtension

logger = logging.getLogger(__name__)

RANK_RNG_KEY = "_rng_state_by_rank"
"""Key of the per-rank RNG states in a distributed manager snapshot (list indexed by rank)."""


class _DistributedSnapshot(SnapshotExtension):
    """Snapshot under ``torch.distributed``: only ``saver_rank`` writes; all ranks load the
    snapshot the saver rank chose (as ppe's ``_DistributedSnapshot``)."""

    def __init__(self, *, saver_rank: int, timeout_s: float | None = None, **kwargs: Any
                 ) -> None:
        super().__init__(**kwargs)
        self.timeout_s = check_timeout_s(timeout_s, none_ok=True) or 600.0
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise RuntimeError(
                "snapshot(saver_rank=...) requires torch.distributed to be initialized "
                "(torch.distributed.init_process_group) before the extension is created")
        self._size = torch.distributed.get_world_size()
        self._rank = torch.distributed.get_rank()
        if isinstance(saver_rank, bool) or not isinstance(saver_rank, int) \
                or not 0 <= saver_rank < self._size:
            raise ValueError(
                f"saver_rank must be an int in [0, {self._size}), got {saver_rank!r}")
        self._saver_rank = saver_rank
        self._rank_rng: list[Any] | None = None

    def _is_saver(self) -> bool:
        return self._rank == self._saver_rank

    def _make_snapshot(self, manager: Any, *, on_error: bool = False) -> None:
        """One snapshot on every rank (collective, bounded): gather every rank's RNG state to
        the saver rank (so a resumed rank continues its own random stream; restoring the
        saver's state everywhere would make ranks identical), let the saver rank write, then
        exchange the outcome so that a failure on the saver rank (or any other) raises the same
        :class:`~snapkeep.errors.RankFailedError` on every rank, within ``timeout_s``."""

        def save(m: Any) -> None:
            super(_DistributedSnapshot, self)._make_snapshot(m, on_error=on_error)

        size = self._size
        if size == 1:
            save(manager)
            return
        groups = background_groups(self.timeout_s)
        what = f"snapshot at iteration {manager.iteration} (saver rank {self._saver_rank})"
        self._rank_rng = None
        if self._target is None and getattr(manager, "_save_rng_state", False):
            self._rank_rng = all_gather(groups.control, capture_rng_state(),
                                            what=f"{what}: gathering RNG states",
                                            timeout_s=groups.timeout_s)
        error: BaseException | None = None
        try:
            save(manager)
        except Exception as e:  # exchanged below: every rank raises, naming this one
            error = e
        finally:
            self._rank_rng = None
        exchange_outcomes(groups.control, error, what=what, timeout_s=groups.timeout_s)

    def _state(self, manager: Any) -> Any:
        state = super()._state(manager)
        if self._rank_rng is not None and isinstance(state, dict):
            state = {**state, RANK_RNG_KEY: self._rank_rng}
        return state

    def _strip_rank_state(self, state: Any) -> Any:
        if isinstance(state, Mapping) and RANK_RNG_KEY in state:
            return {k: v for k, v in state.items() if k != RANK_RNG_KEY}
        return state

    def _restore_rank_state(self, state: Any) -> None:
        per_rank = state.get(RANK_RNG_KEY) if isinstance(state, Mapping) else None
        if not per_rank:
            return
        if len(per_rank) != self._size:
            if self._rank == 0:  # the same on every rank: said once per job
                logger.warning("snapshot holds RNG states of %d ranks, world size is %d; every "
                               "rank keeps the saver rank's state", len(per_rank), self._size)
            return
        restore_rng_state(per_rank[self._rank])

    def _autoload(self, manager: Any) -> str | None:
        """Autoload with every rank agreeing (the module docstring's steps:
        :meth:`snapkeep.session.Session.resume_agreed`); collective.

        Returns:
            The loaded snapshot's name (the same on every rank), or None when no rank has one.

        Raises:
            NoCommonSnapshotError: snapshot files exist but the saver rank can verify none.
            RankFailedError: loading or applying failed on some rank (named, on every rank).
            CollectiveTimeoutError: a rank did not take part within ``timeout_s``.
        """
        session = self._session_of(manager)
        if session is None:
            self._store_of(manager)  # says why there is no autoload
            return None
        groups = background_groups(self.timeout_s)
        target = manager if self._target is None else self._target
        entry = session.resume_agreed(
            lambda e, state: self._apply(target, state, e), control=groups.control,
            rank=groups.rank, saver_rank=self._saver_rank, timeout_s=groups.timeout_s,
            map_location=self._map_location, weights_only=self._weights_only)
        if entry is None:
            return None
        self.loaded_entry = entry
        return entry.name

    def _choose(self, store: SnapshotStore) -> list[Entry] | None:
        entries = store.entries() if self._is_saver() else []
        box: list[Any] = [entries]
        if self._size > 1:
            torch.distributed.broadcast_object_list(box, src=self._saver_rank)
        chosen: list[Entry] = box[0]
        return [Entry(name=e.name, path=store.storage.join(store.directory, e.name),
                      key=e.key, step=e.step) for e in chosen]


#: The public name of :class:`_DistributedSnapshot`. The class keeps ppe's name
#: ``_DistributedSnapshot``: it is the extension's default name, under which its state is saved
#: in a manager's state dict.
DistributedSnapshotExtension = _DistributedSnapshot
