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

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed
import torch.distributed as dist

from snapkeep.distributed import (
    agree_on_resume,
    all_gather,
    background_groups,
    exchange_outcomes,
)
from snapkeep.errors import SnapshotCorruptError, SnapshotStorageError
from snapkeep.store import (
    Entry,
    ResumeNotice,
    Skipped,
    SnapshotStore,
    announce,
    load_file,
    skipped_on_ranks,
)
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
        """Autoload with every rank agreeing (see the module docstring); collective.

        Returns:
            The loaded snapshot's name (the same on every rank), or None when no rank has one.

        Raises:
            NoCommonSnapshotError: snapshot files exist but the saver rank can verify none.
            RankFailedError: loading or applying failed on some rank (named, on every rank).
            CollectiveTimeoutError: a rank did not take part within ``timeout_s``.
        """
        store = self._store_of(manager)
        if store is None:
            return None
        groups = background_groups(self.timeout_s)
        group, timeout_s, rank = groups.control, groups.timeout_s, groups.rank
        saver = self._saver_rank
        entries = store.entries()
        by_name = {e.name: e for e in entries}
        # the same on every rank (node-local directories differ): the error messages must be equal
        what = f"resuming {store.template.template!r} (saver rank {saver})"

        def entry_of(name: str) -> Entry:
            found = by_name.get(name)
            if found is not None:
                return found
            key = store.template.parse(name) or ()
            return Entry(name=name, path=store.storage.join(store.directory, name), key=key,
                         step=int(key[0]) if key else None)

        verified: dict[str, bytes | None] = {}

        def loader(entry: Entry, data: bytes | None) -> Any:
            return load_file(store.storage, entry.path, map_location=self._map_location,
                             weights_only=self._weights_only, data=data)

        def check(name: str) -> str | None:
            if rank != saver:
                return None  # uses its own verified copy or receives the saver rank's bytes
            entry = by_name.get(name)
            if entry is None:
                return "not found on the saver rank"
            data = None if store.storage.is_local else store.storage.read_bytes(entry.path)
            try:  # the store's one validity check (checksum, decode, misnamed), as autoload's
                store.validate(entry, loader, data)
            except SnapshotCorruptError as e:
                return str(e)
            verified[name] = data
            return None

        skipped: list[Skipped] = []

        def on_skip(name: str, reasons: dict[int, str]) -> None:
            skipped.append(skipped_on_ranks(name, entry_of(name).step, reasons))

        chosen = agree_on_resume(group, [(e.key, e.name) for e in entries], check, what=what,
                                 timeout_s=timeout_s, required=rank == saver, on_skip=on_skip)
        notice = ResumeNotice(directory=store.storage.url(store.directory),
                              template=str(store.template.template), skipped=tuple(skipped))
        if chosen is None:
            announce(notice, quiet=self._quiet, rank=rank)
            return None
        entry = entry_of(chosen)
        # 3. a copy of its own, or the saver rank's bytes
        own_ok = rank == saver
        if rank != saver and chosen in by_name:
            try:
                store.verify(entry)
                own_ok = store.manifest(entry) is not None
            except (SnapshotCorruptError, SnapshotStorageError) as e:
                logger.warning("rank %d: own copy of %s unusable (%s); receiving the saver rank's",
                               rank, entry.path, e)
        needs = all_gather(group, not own_ok, what=f"{what}: locating {chosen}",
                           timeout_s=timeout_s)
        data: bytes | None = verified.get(chosen) if rank == saver else None
        if any(needs):
            error: BaseException | None = None
            payload: bytes | None = None
            if rank == saver:
                try:
                    payload = data if data is not None else store.storage.read_bytes(entry.path)
                except OSError as e:
                    error = e
            exchange_outcomes(group, error, what=f"{what}: reading {chosen} on the saver rank",
                              timeout_s=timeout_s)
            box: list[Any] = [payload]
            dist.broadcast_object_list(box, src=saver, group=group)
            if not own_ok:
                data = box[0]
                logger.info("rank %d: received %s (%d bytes) from saver rank %d", rank, chosen,
                            len(data or b""), saver)
        # 4. load and apply on every rank; fail together
        error = None
        target = manager if self._target is None else self._target
        try:
            state = load_file(store.storage, entry.path, map_location=self._map_location,
                              weights_only=self._weights_only, data=data)
            self._apply(target, state, entry)
        except Exception as e:  # exchanged: every rank raises the same error naming this rank
            error = e
        exchange_outcomes(group, error, what=f"{what}: loading {chosen}", timeout_s=timeout_s)
        self.loaded_entry = entry
        self._shared.adopt(store, entries or [entry], entry)
        announce(dataclasses.replace(notice, loaded=entry.name, step=entry.step),
                 quiet=self._quiet, rank=rank)
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
