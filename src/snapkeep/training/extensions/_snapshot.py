"""The snapshot extension: ``snapshot`` / ``snapshot_object`` with ppe's arguments.

Differences from ppe that users rely on:

- ``autoload`` picks the snapshot with the highest step parsed from the filename template (not
  the newest mtime), verifies its checksum, falls back to the next older valid one with a warning
  naming each skipped file, and raises :class:`~snapkeep.NoValidSnapshotError` when snapshot
  files exist but none is valid (ppe silently started over). It is all-or-nothing: a snapshot
  that does not fit the target raises :class:`~snapkeep.StateMismatchError` before anything is
  loaded (see :mod:`._restore`).
- Loading is safe by default (``torch.load(weights_only=True)``); ``weights_only=False`` opts in to
  arbitrary unpickling.
- ``n_retains`` (and ``retention=``) are the last stage of each save, run by the core's saver
  after the commit (on the saver rank only), and never delete the newest snapshot.
- One trainer per ``out_dir`` and template: ``initialize`` takes the store's lock (before
  autoload) and ``finalize`` releases it; a second trainer gets
  :class:`~snapkeep.errors.StoreLockedError` naming the holder. Local filesystems only; see
  :mod:`snapkeep._core.lock` for what is not locked.
- On-error snapshots (``snapshot_on_error=True``) get their own name (``<name>.on-error``), so
  they never replace or outrank a clean snapshot; autoload never resumes from one.

Run lineage (which snapshots retention may delete) is in :mod:`._lineage`.
"""

from __future__ import annotations

import enum
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
)
from snapkeep.training import extension
from snapkeep.training._continuation import ContinuationMixin, check_generators
from snapkeep.training.extensions import _lineage, _restore
from snapkeep.training.extensions._find import (  # noqa: F401  (ppe's helpers, importable here)
    _find_latest_snapshot,
    _find_snapshot_files,
    _find_stale_snapshots,
)
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


class SnapshotMode(enum.Enum):
    """As ppe's ``SnapshotMode``; ``SHARDED`` saves through torch.distributed.checkpoint (see
    ``extensions.sharded_snapshot``)."""

    DEFAULT = enum.auto()
    DISTRIBUTED = enum.auto()
    SHARDED = enum.auto()


def _always_true() -> bool:
    return True


def snapshot_object(target: Any, filename: str, savefun: Any = None, **kwargs: Any) -> _Snapshot:
    """Returns an extension that snapshots ``target`` (as ppe's ``snapshot_object``).

    Args:
        target: an object with ``state_dict()``/``load_state_dict()``, or a dict of them.
        filename: format string formatted with the manager (``'snapshot_{.iteration}'`` becomes
            ``'snapshot_10000'`` at iteration 10,000) or a callable ``manager -> str``.
        savefun: ``savefun(obj, file)`` (torch.save's order); cannot be combined with ``writer``.
        kwargs: the keyword arguments of :func:`snapshot`.
    """
    return snapshot(target=target, filename=filename, savefun=savefun, **kwargs)


def snapshot(
    savefun: Any = None,
    filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}",
    *,
    target: Any = None,
    condition: Callable[[], bool] | None = None,
    writer: Any = None,
    snapshot_on_error: bool = False,
    n_retains: int = -1,
    autoload: bool = False,
    saver_rank: int | None = None,
    snapshot_mode: SnapshotMode = SnapshotMode.DEFAULT,
    retention: RetentionPolicy | None = None,
    weights_only: bool = True,
    map_location: Any = "cpu",
    on_save_error: str = "raise",
    generators: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    overlap: bool = True,
) -> _Snapshot:
    """Returns an extension that snapshots the manager (or ``target``), as ppe's ``snapshot``.

    Runs once per epoch by default (trigger ``(1, 'epoch')``) at priority ``PRIORITY_SNAPSHOT``,
    after the other extensions of the same iteration.

    Args:
        savefun: ``savefun(obj, file)``, default ``torch.save``. Cannot be given with ``writer``.
            :func:`snapkeep.codecs.save_safetensors` writes tensor-only states as safetensors
            (autoload recognises the format from the file's first bytes).
        filename: template formatted with the manager, or a callable ``manager -> str``.
            Autoload and retention need a string template.
        target: object with ``state_dict``/``load_state_dict`` (or a dict of them); default: the
            manager (its state_dict holds models, optimizers, extensions, triggers, RNG state).
        condition: callable with no arguments; the snapshot is skipped when it returns False.
        writer: a writer from :mod:`snapkeep.writing` (default: the manager's writer).
        snapshot_on_error: also take a snapshot when the training loop raises, and wait for it
            (as ppe). It holds mid-iteration state, so it is written as ``<name>.on-error``
            (``snapkeep.store.ON_ERROR_SUFFIX``): it never replaces a clean snapshot of the
            same iteration, autoload never resumes from it and retention never deletes it.
        n_retains: keep the newest ``n_retains`` snapshots by step; <= 0 keeps all (as ppe).
            Only snapshots of this run's lineage are ever deleted (see the module docstring).
        autoload: load the newest valid snapshot in ``initialize`` (returns its name, as ppe)
            and continue its run lineage. All or nothing: the snapshot is checked to fit the
            target first (see ``_restore``). With ``autoload=False``, existing snapshots of the
            template are left alone and a warning says so.
        saver_rank: under ``torch.distributed``, only this rank writes; every rank loads the
            snapshot the saver rank chose.
        snapshot_mode: as ppe; ``DISTRIBUTED`` requires ``saver_rank``.
        retention: a policy from :mod:`snapkeep.retention` (combined with ``n_retains`` by
            any-of).
        weights_only: safe loading (default). ``False`` allows arbitrary unpickling.
        map_location: ``torch.load``'s ``map_location`` for autoload (default ``'cpu'``).
        on_save_error: ``'raise'`` (default) stops training on a failed save; ``'log'`` logs it
            and continues.
        generators: RNGs the training loop owns, by name (``torch.Generator`` of a
            ``DataLoader``, ``random.Random``, NumPy generators, or objects with
            ``state_dict``/``load_state_dict``), saved and restored with the global RNG states
            in this extension's part of the manager's state (snapkeep addition; manager
            snapshots only).
        timeout_s: with ``saver_rank`` or ``SHARDED``: bound in seconds (default 600) of every
            collective snapkeep makes; a rank that fails raises the same error on every rank,
            naming it, and a rank that died makes the others raise within ``timeout_s``.
        overlap: with a background writer, the call copies at once everything but the
            manager's optimizers' parameters and state, which are copied while the next
            forward/backward runs; those optimizers' ``step()`` waits for the copy, and a tensor
            modified in place before it was copied fails the snapshot
            (:class:`snapkeep.StagingRaceError`, never a torn file). See
            :mod:`snapkeep._core.overlap` for what the check cannot see. ``False`` copies all of
            the state in the call.

    Raises:
        TypeError: ``savefun`` and ``writer`` both given (as ppe); a wrong argument type.
        ValueError: a bad value (the message names the argument and what is accepted).
        RuntimeError: ``saver_rank``/``DISTRIBUTED`` without an initialised process group.
    """
    if savefun is not None and writer is not None:
        raise TypeError("savefun and writer arguments cannot be specified together.")
    kwargs: dict[str, Any] = dict(
        target=target, condition=condition, writer=writer, filename=filename,
        snapshot_on_error=snapshot_on_error, n_retains=n_retains, autoload=autoload,
        savefun=savefun, retention=retention, weights_only=weights_only,
        map_location=map_location, on_save_error=on_save_error, generators=generators,
        overlap=overlap,
    )
    if snapshot_mode == SnapshotMode.DEFAULT and saver_rank is None:
        return _Snapshot(**kwargs)
    if snapshot_mode in (SnapshotMode.DEFAULT, SnapshotMode.DISTRIBUTED):
        if saver_rank is None:
            raise ValueError("snapshot_mode=DISTRIBUTED requires saver_rank (an int rank)")
        from snapkeep.training.extensions._distributed import _DistributedSnapshot

        return _DistributedSnapshot(saver_rank=saver_rank, timeout_s=timeout_s, **kwargs)
    if snapshot_mode == SnapshotMode.SHARDED:
        from snapkeep.training.extensions._sharded import _ShardedSnapshot  # imports this module

        return _ShardedSnapshot(saver_rank=saver_rank, timeout_s=timeout_s or 600.0, **kwargs)
    raise ValueError(f"snapshot_mode must be a SnapshotMode, got {snapshot_mode!r}")


class _Snapshot(ContinuationMixin, extension.Extension):
    """Takes snapshots of the manager or a target; see :func:`snapshot`."""

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
                                           optimizers_in(target))
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

        def loader(entry: Entry, data: bytes | None) -> Any:
            state = load_file(store.storage, entry.path, map_location=self._map_location,
                              weights_only=self._weights_only, data=data)
            reason = misnamed_reason(entry.name, entry.step, self._template.template, state)
            if reason is not None:  # skipped with a warning, as a corrupt file is
                raise SnapshotCorruptError(reason)
            return state

        found = store.load_newest(loader, candidates=candidates)
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


def __getattr__(name: str) -> Any:
    """``_DistributedSnapshot`` and ``RANK_RNG_KEY`` moved to ``_distributed``."""
    if name in ("_DistributedSnapshot", "RANK_RNG_KEY"):
        from snapkeep.training.extensions import _distributed

        return getattr(_distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["snapshot", "snapshot_object", "SnapshotMode"]
