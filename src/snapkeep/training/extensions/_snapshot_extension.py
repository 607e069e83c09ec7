"""The snapshot extension itself (:class:`_Snapshot`): what :func:`._snapshot.snapshot` and
:func:`._snapshot.snapshot_object` return.

It locks the store, sweeps it and autoloads in ``initialize``, saves through the writer at its
trigger (and on error, under ``<name>.on-error``), and releases the lock in ``finalize``; see the
module docstring of :mod:`._snapshot` for how it differs from ppe's. The distributed and sharded
snapshots (:mod:`._distributed`, :mod:`._sharded`) build on it.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from snapkeep.errors import SnapshotCorruptError, SnapshotError
from snapkeep.retention import AnyOf, KeepLatest, RetentionPolicy
from snapkeep.staging import (
    StagingGuard,
    arm,
    into_existing_state,
    optimizers_in,
    prefault_before_first_snapshot,
)
from snapkeep.store import (
    ON_ERROR_SUFFIX,
    Entry,
    FilenameTemplate,
    Retain,
    SnapshotStore,
    StoreLock,
    check_writable,
    load_file,
    misnamed_reason,
    one_pass_loader,
)
from snapkeep.training import extension
from snapkeep.training._continuation import ContinuationMixin, check_generators
from snapkeep.training.extensions import _lineage, _restore
from snapkeep.writing import Writer as _SnapkeepWriter

logger = logging.getLogger(__name__)

ON_SAVE_ERROR = ("raise", "log")


def _snapkeep_writer_for(manager: Any) -> Any:
    """The manager's writer; when that is one of ppe's writers (ppe's manager makes one by
    default) a snapkeep ``SimpleWriter`` on the same ``out`` instead, so that autoload verifies
    and retention runs."""
    writer = manager.writer
    if not type(writer).__module__.startswith("pytorch_pfn_extras."):
        return writer
    from snapkeep.writing import SimpleWriter

    logger.info("the manager's writer is a %s, not a snapkeep writer; snapshots are written by "
                "a snapkeep SimpleWriter into %r", type(writer).__name__, manager.out)
    return SimpleWriter(out_dir=manager.out)


def _always_true() -> bool:
    return True


class _Snapshot(ContinuationMixin, extension.Extension):
    """Takes snapshots of the manager or a target; see :func:`._snapshot.snapshot`."""

    trigger = 1, "epoch"
    priority = extension.PRIORITY_SNAPSHOT
    needs_model_state = True
    _snapkeep_snapshot_extension = True  # _lineage.SNAPSHOT_MARKER

    def __init__(
        self, target: Any = None, condition: Any = None, writer: Any = None,
        filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}",
        snapshot_on_error: bool = False, n_retains: int = -1, autoload: bool = False,
        savefun: Any = None, *, retention: RetentionPolicy | None = None,
        weights_only: bool = True, map_location: Any = "cpu", on_save_error: str = "raise",
        generators: Mapping[str, Any] | None = None,
        overlap: bool = True,
    ) -> None:
        _restore.check_target(target)
        self._generators = check_generators(generators)
        if condition is None:
            condition = _always_true
        elif not callable(condition):
            raise TypeError(f"condition must be a callable returning bool, got {condition!r}")
        if isinstance(n_retains, bool) or not isinstance(n_retains, int):
            raise TypeError(
                f"n_retains must be an int (> 0 keeps that many snapshots, <= 0 keeps all), "
                f"got {type(n_retains).__name__} {n_retains!r}")
        if retention is not None and not callable(getattr(retention, "select", None)):
            raise TypeError(
                f"retention must be a policy from snapkeep.retention, got {retention!r}")
        if on_save_error not in ON_SAVE_ERROR:
            raise ValueError(
                f"on_save_error must be one of {ON_SAVE_ERROR}, got {on_save_error!r}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        if writer is not None and not callable(writer):
            raise TypeError(f"writer must be a callable writer object, got {writer!r}")
        if savefun is not None and not callable(savefun):
            raise TypeError(f"savefun must be callable like torch.save(obj, f), got {savefun!r}")
        self._template = FilenameTemplate(filename)
        self._target = target
        self.filename = filename
        self.condition = condition
        self.writer = writer
        self._snapshot_on_error = snapshot_on_error
        self.n_retains = n_retains
        self.autoload = autoload
        self._savefun = savefun
        self._weights_only = weights_only
        self._map_location = map_location
        self._on_save_error = on_save_error
        self._overlap = overlap
        self._staging_guard = StagingGuard()
        self._overlap_before_copy: Callable[[], None] | None = None  # a test seam (a gate)
        policies = [p for p in (KeepLatest(n_retains) if n_retains > 0 else None, retention) if p]
        self._retention: RetentionPolicy | None = None
        if len(policies) == 1:
            self._retention = policies[0]
        elif policies:
            self._retention = AnyOf(*policies)
        self.loaded_entry: Entry | None = None
        self._shared = _lineage.RunLineage.fresh()
        self._store: SnapshotStore | None = None
        self._lock: StoreLock | None = None

    @property
    def run_id(self) -> str:
        """Run lineage id written into each snapshot's manifest (adopted on autoload; shared by
        every snapshot extension of one manager)."""
        return self._shared.run_id

    @property
    def _run_id(self) -> str:
        return self._shared.run_id

    @property
    def _lineage(self) -> frozenset[str | None]:
        return self._shared.members

    # -- lifecycle -----------------------------------------------------------------------------
    def initialize(self, manager: Any) -> str | None:  # type: ignore[override]
        """Resolve the writer, lock the store, sweep it and autoload (returns the loaded file
        name or None, as ppe).

        Raises:
            StoreLockedError: another trainer holds this out_dir and template.
            NoValidSnapshotError: snapshot files exist but none verifies.
            StateMismatchError: the chosen snapshot does not fit the target (first 10 listed);
                nothing was loaded.
            UnsafeSnapshotError: the snapshot needs ``weights_only=False``.
            ValueError: the filename template names an attribute the manager does not have.
            SnapshotStorageError: the writer's output directory cannot be created.
        """
        self._bind_continuation(manager)
        if self.writer is None:
            self.writer = _snapkeep_writer_for(manager)
        # one lineage per manager: a snapshot_object beside an autoloading snapshot continues
        # the run that snapshot resumed (and its retention keeps deleting that run's files)
        self._shared = _lineage.shared_lineage(manager, self._shared)
        self._check_template(manager)
        try:
            if self._is_saver():
                writer = self.writer
                if isinstance(writer, _SnapkeepWriter) and not writer.initialized:
                    writer.initialize(manager.out)  # an unusable out_dir fails now, naming it
                if isinstance(writer, _SnapkeepWriter):
                    check_writable(*writer.storage_for(manager.out))  # not at the first snapshot
                store = self._store_of(manager, quiet=True)
                if store is not None:
                    if self._lock is None:
                        self._lock = store.lock()
                    store.sweep(self._lineage)
            loaded = None
            if self.autoload:
                loaded = self._autoload(manager)
            elif self._is_saver() and not _lineage.has_autoloading_snapshot(manager):
                store = self._store_of(manager, quiet=True)
                if store is not None:
                    _lineage.warn_about_existing(store, self._run_id)
        except BaseException:
            self._release_lock()
            raise
        if self._is_saver() and isinstance(self.writer, _SnapkeepWriter):  # no first-call penalty
            target = manager if self._target is None else self._target
            prefault_before_first_snapshot(self.writer._saver, lambda: self._state(manager),
                                           optimizers_in(target),
                                           after_first_step=loaded is not None)
        return loaded

    def _check_template(self, manager: Any) -> None:
        """Fail before training when a string template names an attribute the manager lacks
        (instead of at the first snapshot). Fields that cannot be evaluated yet (observation
        keys, ``elapsed_time`` before the first iteration) are checked at each snapshot."""
        if not self._template.parsable:
            return
        try:
            self._template.format(manager)
        except ValueError as e:
            if isinstance(e.__cause__, (AttributeError, IndexError)):
                raise
        except Exception as e:  # not evaluable yet; format() checks again at each snapshot
            logger.debug("filename template %r not checked before training: %s",
                         self.filename, e)

    def on_error(self, manager: Any, exc: Exception, tb: types.TracebackType) -> None:
        """With ``snapshot_on_error``, snapshot the (mid-iteration) state as ``<name>.on-error``
        and wait for it (as ppe, but never under a clean snapshot's name)."""
        super().on_error(manager, exc, tb)
        if self._snapshot_on_error:
            self._make_snapshot(manager, on_error=True)
            wait = getattr(self.writer, "wait", None)
            if callable(wait):
                wait()

    def __call__(self, manager: Any) -> None:
        if self.condition():
            self._make_snapshot(manager)

    def finalize(self, manager: Any) -> None:
        """Finalize the writer (waits for pending snapshots) and release the store's lock. A
        background save failure raised there is logged instead when ``on_save_error='log'``."""
        writer = self.writer
        try:
            if writer is not None:
                writer.finalize()
        except (SnapshotError, OSError) as e:
            if self._on_save_error == "raise":
                raise
            logger.error("a snapshot failed before finalize and on_save_error='log': %s", e)
        finally:
            self._release_lock()

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    # -- saving --------------------------------------------------------------------------------
    def _is_saver(self) -> bool:
        return True

    def _state(self, manager: Any) -> Any:
        target = manager if self._target is None else self._target
        if type(target) is dict:
            return {k: v.state_dict() for k, v in target.items()}
        return target.state_dict()

    def _make_snapshot(self, manager: Any, *, on_error: bool = False) -> None:
        writer = manager.writer if self.writer is None else self.writer
        self.writer = writer
        if not self._is_saver():
            return
        state = self._state(manager)
        filename = self._template.format(manager)
        extra: dict[str, Any] = {}
        if on_error:
            filename += ON_ERROR_SUFFIX
        if isinstance(writer, _SnapkeepWriter):
            extra = {"step": int(manager.iteration), "metrics": _metrics(manager),
                     "run_id": self._run_id}
            store = self._store_of(manager, quiet=True)
            if store is not None:
                extra["retain"] = Retain(store=store, lineage=self._lineage,
                                         policy=None if on_error else self._retention)
        if self._on_save_error == "log" and isinstance(writer, _SnapkeepWriter):
            try:  # an earlier background failure is logged here, so this snapshot is still taken
                writer._saver.raise_pending_error()
            except (SnapshotError, OSError) as e:
                logger.error("an earlier snapshot failed and on_save_error='log': %s", e)
        if self._overlap and isinstance(writer, _SnapkeepWriter):
            target = manager if self._target is None else self._target
            arm(writer._saver, optimizers_in(target), self._staging_guard,
                before_copy=self._overlap_before_copy)
        try:
            writer(filename, manager.out, state, savefun=self._savefun, **extra)
            handle = getattr(writer, "last_handle", None)
            if handle is not None and not handle.staged.done():
                self._staging_guard.track(handle.staged)  # the next step() waits for it
        except (SnapshotError, OSError) as e:
            if self._on_save_error == "raise":
                raise
            logger.error("snapshot %s at iteration %s failed and on_save_error='log': %s",
                         filename, manager.iteration, e)
        finally:
            if isinstance(writer, _SnapkeepWriter):
                writer._saver.overlap_next(None)  # never left armed for a direct writer call

    # -- the store and autoload -----------------------------------------------------------------
    def _store_of(self, manager: Any, *, quiet: bool = False) -> SnapshotStore | None:
        """The store of this template in the writer's directory (None: a non-snapkeep writer or
        a callable template, where autoload, retention and the lock are not available)."""
        writer = self.writer
        if not isinstance(writer, _SnapkeepWriter):
            if not quiet:
                logger.warning("autoload/retention need a snapkeep writer; got %s",
                               type(writer).__name__)
            return None
        if not self._template.parsable:
            if not quiet:
                logger.warning("autoload/retention need a string filename template; %r is "
                               "callable", self.filename)
            return None
        storage, directory = writer.storage_for(manager.out)
        store = self._store
        if store is None or store.storage is not storage or store.directory != directory:
            store = self._store = SnapshotStore(storage, directory, self._template)
        return store

    def _choose(self, store: SnapshotStore) -> list[Entry] | None:
        """Candidates for autoload (all ranks use the saver rank's list in distributed mode)."""
        return store.entries()

    def _autoload(self, manager: Any) -> str | None:
        store = self._store_of(manager)
        if store is None:
            return None
        candidates = self._choose(store)
        if not candidates:
            return None
        target = manager if self._target is None else self._target

        def check(entry: Entry, state: Any) -> Any:
            reason = misnamed_reason(entry.name, entry.step, self._template.template, state)
            if reason is not None:  # skipped with a warning, as a corrupt file is
                raise SnapshotCorruptError(reason)
            return state

        def loader(entry: Entry, data: bytes | None) -> Any:
            return check(entry, load_file(store.storage, entry.path, data=data,
                                          map_location=self._map_location,
                                          weights_only=self._weights_only))

        one_pass = one_pass_loader(store, loader, check, weights_only=self._weights_only,
                                   map_location=self._map_location)  # verified while loaded
        found = store.load_newest(loader, candidates=candidates, one_pass=one_pass)
        if found is None:
            return None
        entry, state = found
        self._apply(target, state, entry)
        self.loaded_entry = entry
        self._shared.adopt(store, candidates, entry)
        logger.info("resumed from snapshot %s (step %s, run id %s)", entry.path, entry.step,
                    self._run_id)
        return entry.name

    def _apply(self, target: Any, state: Any, entry: Entry) -> None:
        """Check that ``state`` fits ``target`` entirely, then load it (all or nothing)."""
        pairs = _restore.pairs_to_load(target, self._strip_rank_state(state), entry)
        _restore.require_fit(pairs, entry)
        with into_existing_state(optimizers_in(target)):  # in place where shapes match
            for obj, sub, _ in pairs:
                obj.load_state_dict(sub)
        self._restore_rank_state(state)

    def _strip_rank_state(self, state: Any) -> Any:
        """Hook for the distributed snapshot (per-rank RNG); the plain one keeps ``state``."""
        return state

    def _restore_rank_state(self, state: Any) -> None:
        """Hook for the distributed snapshot (per-rank RNG)."""


def _metrics(manager: Any) -> dict[str, float]:
    observation = getattr(manager, "observation", None) or {}
    out: dict[str, float] = {}
    for key, value in observation.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out
