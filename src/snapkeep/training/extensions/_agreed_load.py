"""Autoload of ``snapshot(saver_rank=...)`` (DISTRIBUTED mode) with every rank agreeing.

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
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from snapkeep.distributed import (
    agree_on_resume,
    all_gather,
    background_groups,
    exchange_outcomes,
)
from snapkeep.errors import SnapshotCorruptError, SnapshotStorageError
from snapkeep.store import Entry, load_file
from snapkeep.training.extensions._resume_notice import (
    ResumeNotice,
    Skipped,
    announce,
    skipped_on_ranks,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


def agreed_autoload(snapshot: Any, manager: Any) -> str | None:
    """Autoload for a ``_DistributedSnapshot`` (see the module docstring); collective.

    Returns:
        The loaded snapshot's name (the same on every rank), or None when no rank has one.

    Raises:
        NoCommonSnapshotError: snapshot files exist but the saver rank can verify none of them.
        RankFailedError: loading or applying failed on some rank (named, on every rank).
        CollectiveTimeoutError: a rank did not take part within ``timeout_s``.
    """
    store = snapshot._store_of(manager)
    if store is None:
        return None
    groups = background_groups(getattr(snapshot, "timeout_s", DEFAULT_TIMEOUT_S))
    group, timeout_s, rank = groups.control, groups.timeout_s, groups.rank
    saver = snapshot._saver_rank
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
        return load_file(store.storage, entry.path, map_location=snapshot._map_location,
                         weights_only=snapshot._weights_only, data=data)

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
    notice = ResumeNotice(directory=store.directory, template=store.template.template,
                          skipped=tuple(skipped))
    if chosen is None:
        announce(notice, quiet=snapshot._quiet, rank=rank)
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
    target = manager if snapshot._target is None else snapshot._target
    try:
        state = load_file(store.storage, entry.path, map_location=snapshot._map_location,
                          weights_only=snapshot._weights_only, data=data)
        snapshot._apply(target, state, entry)
    except Exception as e:  # exchanged: every rank raises the same error naming this rank
        error = e
    exchange_outcomes(group, error, what=f"{what}: loading {chosen}", timeout_s=timeout_s)
    snapshot.loaded_entry = entry
    snapshot._shared.adopt(store, entries or [entry], entry)
    announce(dataclasses.replace(notice, loaded=entry.name, step=entry.step),
             quiet=snapshot._quiet, rank=rank)
    return entry.name


def distributed_save(snapshot: Any, manager: Any, save: Callable[[Any], None],
                     capture_rng: Callable[[], Any]) -> None:
    """One ``snapshot(saver_rank=...)`` snapshot on every rank (collective, bounded): gather
    every rank's RNG state to the saver rank, let the saver rank write, then exchange the
    outcome so that a failure on the saver rank (or any other) raises the same
    :class:`~snapkeep.errors.RankFailedError` on every rank, within ``timeout_s``."""
    size = snapshot._size
    if size == 1:
        save(manager)
        return
    groups = background_groups(snapshot.timeout_s)
    what = f"snapshot at iteration {manager.iteration} (saver rank {snapshot._saver_rank})"
    snapshot._rank_rng = None
    if snapshot._target is None and getattr(manager, "_save_rng_state", False):
        snapshot._rank_rng = all_gather(groups.control, capture_rng(),
                                        what=f"{what}: gathering RNG states",
                                        timeout_s=groups.timeout_s)
    error: BaseException | None = None
    try:
        save(manager)
    except Exception as e:  # exchanged below: every rank raises, naming this one
        error = e
    finally:
        snapshot._rank_rng = None
    exchange_outcomes(groups.control, error, what=what, timeout_s=groups.timeout_s)
