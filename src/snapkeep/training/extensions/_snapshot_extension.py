"""The snapshot extension itself (:class:`_Snapshot`): what :func:`._snapshot.snapshot` and
:func:`._snapshot.snapshot_object` return.

It locks the store, sweeps it and autoloads in ``initialize``, saves through the writer at its
trigger (and on error, under ``<name>.on-error``), and releases the lock in ``finalize``; see the
module docstring of :mod:`._snapshot` for how it differs from ppe's. The distributed and sharded
snapshots (:mod:`._distributed`, :mod:`._sharded`) build on it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

import snapkeep.training.extension as extension
import snapkeep.training.extensions._lineage as _lineage
import snapkeep.training.extensions._restore as _restore
from snapkeep.errors import SnapshotError
from snapkeep.layout import check_loaders
from snapkeep.retention import AnyOf, KeepLatest, RetentionPolicy
from snapkeep.session import RunLineage, Session, check_quiet, warn_about_existing, warn_user
from snapkeep.staging import (
    StagedLoan,
    StagingGuard,
    StagingRaceError,
    into_existing_state,
    optimizers_in,
)
from snapkeep.store import (
    ON_ERROR_SUFFIX,
    Entry,
    FilenameTemplate,
    SnapshotStore,
    check_writable,
    ppe_name,
    ppe_template,
    resolve_storage,
    unloadable_value,
)
from snapkeep.tiers import IncrementalTracker, newest_listed_step
from snapkeep.training._continuation import ContinuationMixin, check_generators
from snapkeep.training.triggers.auto_trigger import note_end, note_snapshot
from snapkeep.wrapping import canonical_tree, dtensor_models, live_tree
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
    #: whether the snapshots are DCP directories (``SnapshotMode.SHARDED``), not single files
    sharded_directories = False

    def __init__(
        self, target: Any = None, condition: Any = None, writer: Any = None,
        filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}",
        snapshot_on_error: bool = False, n_retains: int = -1, autoload: bool = False,
        savefun: Any = None, *, retention: RetentionPolicy | None = None,
        weights_only: bool = True, map_location: Any = "cpu", on_save_error: str = "raise",
        generators: Mapping[str, Any] | None = None,
        overlap: bool | str = True, quiet: bool = False,
        loaders: Mapping[str, Any] | None = None, incremental: bool = False,
    ) -> None:
        _restore.check_target(target)
        self._quiet = check_quiet(quiet)
        self._generators = check_generators(generators)
        self._loaders = check_loaders(loaders)
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
        if not (isinstance(overlap, bool) or overlap == "strict"):
            raise ValueError(f"overlap must be one of True, False or 'strict', got {overlap!r}")
        if writer is not None and not callable(writer):
            raise TypeError(f"writer must be a callable writer object, got {writer!r}")
        if savefun is not None and not callable(savefun):
            raise TypeError(f"savefun must be callable like torch.save(obj, f), got {savefun!r}")
        self._template = ppe_template(filename)
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
        self._overlap = overlap  # the user's choice: True, False or 'strict'
        self._overlap_on = bool(overlap)  # False after a dropped snapshot (non-strict)
        self._staging_guard = StagingGuard()
        self._overlap_before_copy: Callable[[], None] | None = None  # a test seam (a gate)
        self._race_warned = False
        self._unloadable_warned = False  # the autoload=False warning, once
        self._staged_at: tuple[int, Any] | None = None  # (iteration, handle) of the last save
        policies = [p for p in (KeepLatest(n_retains) if n_retains > 0 else None, retention) if p]
        self._retention: RetentionPolicy | None = None
        if len(policies) == 1:
            self._retention = policies[0]
        elif policies:
            self._retention = AnyOf(*policies)
        self.loaded_entry: Entry | None = None
        self._shared = RunLineage.fresh()
        self._store: SnapshotStore | None = None
        self._session: Session | None = None  # the engine session on the store (saver rank)
        self._incremental = bool(incremental)
        self._tracker: IncrementalTracker | None = None  # per store (_tracker_of)

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

    @property
    def of_manager(self) -> bool:
        """Whether this extension snapshots the whole manager (``snapshot``), not a target
        (``snapshot_object``)."""
        return self._target is None

    @property
    def store_template(self) -> FilenameTemplate:
        """``filename`` in the store's language (:func:`snapkeep.store.ppe_template`): what
        lists, retains and names this extension's snapshots."""
        return self._template

    def snapshot_name(self, manager: Any) -> str | None:
        """The name of this iteration's snapshot (None for a callable ``filename``)."""
        return ppe_name(self._template, manager) if self._template.parsable else None

    def listed_storage_step(self, manager: Any) -> int | None:
        """The newest step among this extension's committed snapshots listed in storage (names
        only: nothing is opened); callable before ``initialize`` picked the writer (the memory
        tier compares it with its RAM step). None when there is none, the writer is not a
        snapkeep one, the template is callable, or the storage cannot be listed (logged)."""
        writer = self.writer if self.writer is not None else manager.writer
        storage_for: Callable[[str], tuple[Any, str]]
        if isinstance(writer, _SnapkeepWriter):
            storage_for = writer.storage_for
        elif type(writer).__module__.startswith("pytorch_pfn_extras."):
            storage_for = resolve_storage  # initialize writes with a snapkeep one into out
        else:
            return None
        if not self._template.parsable:
            return None
        try:
            storage, directory = storage_for(manager.out)
            return newest_listed_step(storage, directory, self._template,
                                      sharded=self.sharded_directories)
        except Exception as e:  # an unreachable store: the memory tier can still be used
            logger.warning("could not list %s in %s: %s", self.filename, manager.out, e)
            return None

    # -- lifecycle -----------------------------------------------------------------------------
    def initialize(self, manager: Any) -> str | None:  # type: ignore[override]
        """Resolve the writer, lock the store, sweep it and autoload (returns the loaded file
        name or None, as ppe).

        Raises:
            StoreLockedError: another trainer holds the directory the snapshots live in.
            NoValidSnapshotError: snapshot files exist but none verifies.
            StateMismatchError: the chosen snapshot does not fit the target (first 10 listed);
                nothing was loaded.
            UnsafeSnapshotError: the snapshot needs ``weights_only=False``.
            ValueError: the filename template names an attribute the manager does not have, or
                already names sharded snapshot directories in out_dir.
            SnapshotStorageError: the writer's output directory cannot be created.
            TypeError: a model holds DTensor (FSDP2) parameters: use ``SnapshotMode.SHARDED``.
        """
        self._bind_continuation(manager)  # first: a RAM resume restores the continuation too
        restored = _lineage.recover_before_autoload(manager)  # a memory tier resumes from RAM
        refuse_dtensor_models(manager if self._target is None else self._target)
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
                session = self._session_of(manager)
                if session is not None and not session.opened:
                    session.open()  # lock, list once, kind check, sweep (the one start-up)
            loaded = None
            if self.autoload and restored is None:
                loaded = self._autoload(manager)
            elif self.autoload and restored is not None:
                self._continue_stored_lineage(manager, restored.step)
            elif self._is_saver() and not _lineage.has_autoloading_snapshot(manager):
                store = self._store_of(manager, quiet=True)
                if store is not None:
                    warn_about_existing(store, self._run_id)
        except BaseException:
            self._release_lock()
            raise
        if self._is_saver() and isinstance(self.writer, _SnapkeepWriter):  # no first-call penalty
            target = manager if self._target is None else self._target
            self.writer.prefault(lambda: self._state(manager), optimizers_in(target),
                                 after_first_step=loaded is not None)
        if restored is not None and self.autoload and restored.newer_than_storage:
            self._make_snapshot(manager)  # persist the RAM step first (memory tier)
        return loaded

    def _check_template(self, manager: Any) -> None:
        """Fail before training when a string template names an attribute the manager lacks
        (instead of at the first snapshot). Fields that cannot be evaluated yet (observation
        keys, ``elapsed_time`` before the first iteration) are checked at each snapshot."""
        if not self._template.parsable:
            return
        try:
            ppe_name(self._template, manager)
        except ValueError as e:
            if isinstance(e.__cause__, (AttributeError, KeyError, IndexError)):
                raise
        except Exception as e:  # not evaluable yet; format() checks again at each snapshot
            logger.debug("filename template %r not checked before training: %s",
                         self.filename, e)

    def on_error(self, manager: Any, exc: Exception, tb: types.TracebackType) -> None:
        """With ``snapshot_on_error``, snapshot the (mid-iteration) state as ``<name>.on-error``
        and wait for it (as ppe, but never under a clean snapshot's name)."""
        super().on_error(manager, exc, tb)
        note_end(manager, "failed")
        if self._snapshot_on_error:
            self._make_snapshot(manager, on_error=True)
            wait = getattr(self.writer, "wait", None)
            if callable(wait):
                wait()

    def __call__(self, manager: Any) -> None:
        if self.condition():
            started = time.monotonic()
            self._make_snapshot(manager)
            self._note(manager, time.monotonic() - started)

    def _note(self, manager: Any, stall_s: float) -> None:
        """Tell the manager's ``AutoTrigger`` (if any) of this snapshot: its stall, its commit
        future and where the run is recorded (see
        :mod:`snapkeep.training.triggers.auto_trigger`)."""
        writer = self.writer
        handle = getattr(writer, "last_handle", None) if isinstance(writer, _SnapkeepWriter) \
            else None
        store = self._store_of(manager, quiet=True) if self._is_saver() else None
        note_snapshot(manager, step=int(manager.iteration), stall_s=stall_s,
                      committed=getattr(handle, "committed", None),
                      storage=store.storage if store is not None else None,
                      directory=store.directory if store is not None else "")

    def finalize(self, manager: Any) -> None:
        """Validate a pending overlapped snapshot, finalize the writer (waits for pending
        snapshots) and release the store's lock. A background save failure raised there is
        logged instead when ``on_save_error='log'``; a ``StagingRaceError`` of
        ``overlap='strict'`` is raised (after the writer is finalized)."""
        writer = self.writer
        try:
            try:
                self._staging_guard.settle()  # a safe point: the last snapshot's verdict
            finally:
                if writer is not None:
                    writer.finalize()
        except (SnapshotError, OSError) as e:
            if self._on_save_error == "raise" or isinstance(e, StagingRaceError):
                raise
            logger.error("a snapshot failed before finalize and on_save_error='log': %s", e)
        finally:
            note_end(manager, "finished")  # (after a failure: 'failed' was told first)
            self._release_lock()

    def _release_lock(self) -> None:
        if self._session is not None:
            self._session.close()

    def settle_staging(self) -> None:
        """A safe point for overlapped staging (snapkeep's manager calls it at the end of each
        ``run_iteration``, on the training thread): validate this extension's background copy if
        it is done, so its snapshot is published without waiting for the next step.

        Raises:
            StagingRaceError: with ``overlap='strict'``, a tensor was modified in place after
                the call (see :mod:`snapkeep._core.save.overlap`).
        """
        self._staging_guard.settle(block=False)

    def _on_staging_race(self, error: StagingRaceError) -> None:
        """A snapshot was dropped because a tensor moved under its background copy: raise
        (``overlap='strict'``) or warn once and copy everything in the call from now on."""
        if self._overlap == "strict":
            raise error
        self._overlap_on = False
        if not self._race_warned:
            self._race_warned = True
            warn_user(f"{error}. Overlapped staging is now off for this snapshot extension: "
                      "its next snapshot copies all of the state in the call", RuntimeWarning)

    # -- saving --------------------------------------------------------------------------------
    def _is_saver(self) -> bool:
        return True

    def _state(self, manager: Any) -> Any:
        target = manager if self._target is None else self._target
        if type(target) is dict:
            return canonical_tree(target, {k: v.state_dict() for k, v in target.items()})
        return canonical_tree(target, target.state_dict())  # no wrapper prefixes

    def _make_snapshot(self, manager: Any, *, on_error: bool = False) -> None:
        writer = manager.writer if self.writer is None else self.writer
        self.writer = writer
        if not self._is_saver():
            return
        state = self._state(manager)
        filename = ppe_name(self._template, manager)
        self._refuse_unloadable(state, filename, writer)
        if on_error:
            filename += ON_ERROR_SUFFIX
        ours = isinstance(writer, _SnapkeepWriter)
        session = self._session_of(manager) if ours else None

        def before_write() -> None:  # after the retention input check, right before the writer
            if self._on_save_error == "log" and ours:
                try:  # an earlier background failure is logged here, so this one is still taken
                    writer.raise_pending_error()
                except (SnapshotError, OSError) as e:
                    logger.error("an earlier snapshot failed and on_save_error='log': %s", e)
            self._staging_guard.settle()  # a safe point: the previous snapshot's verdict first
            if self._overlap_on and ours:
                target = manager if self._target is None else self._target
                writer.arm_overlap(optimizers_in(target), self._staging_guard,
                                   before_copy=self._overlap_before_copy,
                                   on_race=self._on_staging_race)
            self._staged_at = None

        tracker = self._tracker_of(manager) if ours and self._incremental else None
        try:
            if session is not None:  # the one save path: check, before_write, writer, Retain
                session.save(writer, filename, manager.out, state, step=int(manager.iteration),
                             metrics=observed_metrics(manager), on_error=on_error,
                             incremental=tracker, before_write=before_write,
                             savefun=self._savefun)
            else:  # ppe's own writers (their own format, no store), or no store to retain in
                extra: dict[str, Any] = {}
                if ours:
                    extra = {"step": int(manager.iteration), "metrics": observed_metrics(manager),
                             "run_id": self._run_id}
                    if tracker is not None:
                        extra["incremental"] = tracker
                before_write()
                writer(filename, manager.out, state, savefun=self._savefun, **extra)
            if ours and self._target is None and not on_error:
                self._staged_at = (int(manager.iteration), writer.last_handle)
        except (SnapshotError, OSError) as e:
            if self._on_save_error == "raise":
                raise
            logger.error("snapshot %s at iteration %s failed and on_save_error='log': %s",
                         filename, manager.iteration, e)
        finally:
            if isinstance(writer, _SnapkeepWriter):
                writer.disarm_overlap()  # never left armed for a direct writer call

    def _refuse_unloadable(self, state: Any, filename: str, writer: Any) -> None:
        """Protect autoload where snapkeep chooses the format: with a snapkeep writer, no
        ``savefun`` and ``weights_only=True``, a value ``torch.load(weights_only=True)`` could not
        load raises TypeError before anything is written when this extension autoloads (a run
        must never save snapshots it cannot resume from), and warns once otherwise (a later
        autoload of these files would refuse them). A writer or ``savefun`` of the user's
        chooses its own format and is never checked (as ppe, which checks nothing)."""
        if (not self._weights_only or self._savefun is not None
                or not isinstance(writer, _SnapkeepWriter)):
            return
        if not self.autoload and self._unloadable_warned:
            return
        where = unloadable_value(state)
        if where is None:
            return
        advice = ("Keep tensors, numbers, strings and containers of them in state_dict()s, or "
                  "pass extensions.snapshot(weights_only=False) to save and load arbitrary "
                  "objects (trusted files only)")
        if self.autoload:
            raise TypeError(
                f"snapshot {filename}: {where!r} holds an object that autoload, which loads with "
                "torch.load(weights_only=True), would refuse, so this snapshot could never be "
                f"resumed; nothing was saved. {advice}")
        self._unloadable_warned = True
        warn_user(f"snapshot {filename}: {where!r} holds an object that autoload, which loads "
                  "with torch.load(weights_only=True), would refuse: this extension does not "
                  "autoload, but a run that autoloads these snapshots could not resume from "
                  f"them. {advice}", RuntimeWarning)

    def lend_staged(self, manager: Any) -> StagedLoan | None:
        """The copy of the manager's state this extension's writer staged at this iteration,
        lent to the memory tier so that a step both take is staged once
        (:meth:`snapkeep.writing.Writer.lend_staged`); the distributed snapshot's per-rank
        additions are left out of the lent tree. None when this extension took no snapshot of
        the whole manager at this iteration or its writer stages nothing (``SimpleWriter``)."""
        staged_at, self._staged_at = self._staged_at, None
        if staged_at is None or staged_at[0] != int(manager.iteration) or staged_at[1] is None:
            return None
        loan = self.writer.lend_staged(staged_at[1])
        if loan is None:
            return None
        tree = self._strip_rank_state(loan.tree)
        return loan if tree is loan.tree else dataclasses.replace(loan, tree=tree)

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

    def _tracker_of(self, manager: Any) -> IncrementalTracker:
        """The incremental tracker of :meth:`_store_of`'s store (one per store).

        Raises:
            ValueError: no store (a callable template).
        """
        store = self._store_of(manager, quiet=True)
        if store is None:
            raise ValueError("incremental=True needs a string filename template")
        tracker = self._tracker
        if tracker is None or tracker.area != store.blob_area():
            tracker = self._tracker = IncrementalTracker.for_store(store)
        return tracker

    def session(self, manager: Any) -> Session | None:
        """The engine session on this extension's store (None where there is none: a callable
        template, ppe's own writer); ``extensions.preemption`` gets the run control from it."""
        return self._session_of(manager)

    def _session_of(self, manager: Any) -> Session | None:
        """The engine session on :meth:`_store_of`'s store (None where there is no store)."""
        store = self._store_of(manager, quiet=True)
        if store is None:
            return None
        session = self._session
        if session is None or session.store is not store:
            if session is not None:
                session.close()
            session = self._session = Session(store, policy=self._retention,
                                              lineage=self._shared, quiet=self._quiet,
                                              door="ppe")
        return session

    def _choose(self, store: SnapshotStore) -> list[Entry] | None:
        """Candidates for autoload (all ranks use the saver rank's list in distributed mode)."""
        return store.entries()

    def _autoload(self, manager: Any) -> str | None:
        session = self._session_of(manager)
        if session is None:
            self._store_of(manager)  # says why there is no autoload
            return None
        target = manager if self._target is None else self._target
        store = self._store_of(manager, quiet=True)
        if store is None:
            return None
        entry = session.resume(lambda e, state: self._apply(target, state, e),
                               candidates=self._choose(store), map_location=self._map_location,
                               weights_only=self._weights_only)
        if entry is None:
            return None
        self.loaded_entry = entry
        return entry.name

    def _continue_stored_lineage(self, manager: Any, step: int) -> None:
        """After the memory tier resumed the run at ``step``: continue the lineage of storage's
        newest snapshot at or before it (the one a storage resume would have loaded; one
        manifest read from the start-up listing, no snapshot data), so that retention goes on
        deleting that run's snapshots as after an autoload."""
        session = self._session_of(manager)
        if session is not None:
            session.continue_lineage(step)

    def _apply(self, target: Any, state: Any, entry: Entry) -> None:
        """Check that ``state`` fits ``target`` entirely, then load it (all or nothing)."""
        state = live_tree(target, state)  # canonical (or old prefixed) keys -> this wrapping
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


#: The public name of :class:`_Snapshot`. The class keeps ppe's name ``_Snapshot``: it is the
#: extension's default name, under which its state is saved in a manager's state dict.
SnapshotExtension = _Snapshot


def refuse_dtensor_models(target: Any) -> None:
    """A single-file snapshot of FSDP2 models would hold one rank's shards; refuse it."""
    where = dtensor_models(target)
    if where:
        raise TypeError(
            f"{', '.join(where)} holds DTensor parameters (FSDP2 fully_shard); a single-file "
            "snapshot cannot hold them. Use snapshot(snapshot_mode=SnapshotMode.SHARDED), which "
            "saves through torch.distributed.checkpoint and resumes into any wrapping")


def observed_metrics(manager: Any) -> dict[str, float]:
    """The finite scalar values of ``manager.observation`` by key (one-element tensors as
    floats): what a snapshot's manifest records as its metrics."""
    observation = getattr(manager, "observation", None) or {}
    out: dict[str, float] = {}
    for key, value in observation.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out
