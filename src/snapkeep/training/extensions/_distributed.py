"""The snapshot extension under ``torch.distributed`` (``snapshot(saver_rank=...)``, ppe's
``_DistributedSnapshot``): only the saver rank writes, deletes and locks; every rank loads the
snapshot the saver rank chose, and every rank's RNG state travels in the saver's snapshot."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed

from snapkeep.store import Entry, SnapshotStore
from snapkeep.training._rng_state import capture_rng_state, restore_rng_state
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
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(
                timeout_s, (int, float)) or timeout_s <= 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = 600.0 if timeout_s is None else float(timeout_s)
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
        # Every rank's RNG state goes into the saver's snapshot, so a resumed rank continues its
        # own random stream (restoring the saver's state everywhere would make ranks identical);
        # on snapkeep's control group, bounded by timeout_s; a failure on any rank raises on all
        from snapkeep.training.extensions._agreed_load import distributed_save

        def save(m: Any) -> None:
            super(_DistributedSnapshot, self)._make_snapshot(m, on_error=on_error)

        distributed_save(self, manager, save, capture_rng_state)

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
        # every rank agrees on one snapshot (node-local directories too); see _agreed_load
        from snapkeep.training.extensions._agreed_load import agreed_autoload

        return agreed_autoload(self, manager)

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
