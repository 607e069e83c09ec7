"""``snapshot(snapshot_mode=SnapshotMode.SHARDED)``: sharded snapshots through
``torch.distributed.checkpoint`` (DCP), committed as one snapshot per directory.

Every rank calls the extension (it is collective); each writes its own shards of DTensor state
(FSDP2 ``fully_shard``) into the directory named by the template, and one marker written last
by rank 0 after every rank's files are durable makes it a snapshot (see
:mod:`snapkeep._core.distributed.sharded`). Models and optimizers go through
``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` (so Adam's lazily
created state loads into a fresh optimizer); everything else of the manager (iteration,
extensions, triggers, state objects) and each rank's RNG state are saved by every rank under its
rank and restored on the same rank. Loading reshards to the current world size (saved on 2
ranks, resumed on 1 or 3); a rank added since takes rank 0's non-tensor state (its random
streams start from their current state), with one warning.

Layout of the DCP state (its flattened keys are what DCP's tools show)::

    models.<name>.<fqn>                     model state (DTensor shards or tensors)
    optimizers.<name>.state.<fqn>.<key>     optimizer state, keyed by parameter FQN
    optimizers.<name>.param_groups          ...
    rank_objects.rank<r>.<name>             bytes: torch.save of rank r's other state (the
                                            manager's iteration, extensions, triggers, state
                                            objects...)
    rank_state.rank<r>                      bytes: torch.save of rank r's RNG states

Snapshots written before non-tensor state was per rank hold ``objects.<name>`` instead (one copy
for all ranks); they still load, that copy on every rank.

Building that state and applying a loaded one is :class:`._sharded_state.ShardedStateLayout`,
which the extension holds.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import snapkeep.training.extensions._lineage as _lineage
from snapkeep.distributed import (
    Groups,
    ShardedJob,
    ShardedManifest,
    ShardedSaver,
    ShardedStore,
    background_groups,
    is_distributed,
    together,
)
from snapkeep.errors import RankFailedError, SnapshotError, StagingRaceError
from snapkeep.retention import RetentionPolicy, best_metrics
from snapkeep.session import Session
from snapkeep.staging import optimizers_in, owned_storages
from snapkeep.store import ON_ERROR_SUFFIX, Entry, check_timeout_s, ppe_name
from snapkeep.tiers import local_shards
from snapkeep.training.extensions._sharded_state import ShardedStateLayout
from snapkeep.training.extensions._snapshot_extension import SnapshotExtension, observed_metrics
from snapkeep.writing import Writer as _SnapkeepWriter

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
"""Default bound of every snapkeep collective (seconds)."""


def sharded_snapshot(
    filename: str = "snapshot_iter_{.iteration}",
    *,
    target: Any = None,
    condition: Callable[[], bool] | None = None,
    writer: Any = None,
    snapshot_on_error: bool = False,
    n_retains: int = -1,
    autoload: bool = False,
    retention: RetentionPolicy | None = None,
    weights_only: bool = True,
    on_save_error: str = "raise",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    quiet: bool = False,
    overlap: bool | str = True,
) -> _ShardedSnapshot:
    """Returns a sharded snapshot extension; ``snapshot(snapshot_mode=SnapshotMode.SHARDED)``
    returns one with the default ``timeout_s``.

    Every rank must add it (it is collective). Runs once per epoch by default, as
    :func:`snapshot`. Works single-process too (no process group: plain DCP files).

    Args:
        filename: template of the snapshot directory (string; its directory part literal).
        target: a module, or a dict of modules, optimizers and other ``state_dict`` objects;
            default: the manager (its models, optimizers and the rest of its state).
        condition: callable with no arguments; the snapshot is skipped when it returns False
            (it must return the same on every rank).
        writer: a snapkeep writer whose ``out_dir``/``fs`` say where to write (default: the
            manager's); its own save machinery is not used.
        snapshot_on_error: also snapshot when the loop raises, and wait for the commit. Only
            useful when every rank raises (else it fails after ``timeout_s``).
        n_retains: keep the newest ``n_retains`` snapshots by step (rank 0 deletes whole
            directories after a commit); <= 0 keeps all.
        autoload: in ``initialize``, all ranks agree on the newest snapshot every rank can read
            and verify (its share of the files' checksums), load it resharded to the current
            world size and return its name.
        retention: a policy from :mod:`snapkeep.retention` (any-of with ``n_retains``).
        weights_only: unpickle the non-tensor state with ``torch.load(weights_only=True)``.
        on_save_error: ``'raise'`` (default) or ``'log'``.
        timeout_s: bound in seconds of every snapkeep collective (commit agreement, resume
            agreement); a rank that died or hangs makes the others raise
            :class:`~snapkeep.errors.CollectiveTimeoutError` within it.
        quiet: with ``autoload``, do not print the resume notice (rank 0 writes on stderr the
            snapshot resumed from or "starting fresh", and each snapshot skipped with its
            reason, incomplete directories included).
        overlap: ``True`` (default), ``False`` or ``'strict'``, as :func:`snapshot`'s: the
            call copies at once everything but the local shards (of at least 1 MiB) of the
            target's optimizers' parameters and state, which are copied while the next
            forward/backward runs; those optimizers' ``step()`` waits for the copy and checks on
            the training thread that no DTensor of them was modified in place since the call
            (its version counter), and the commit waits for that check. A modified one drops
            that snapshot on every rank (nothing written; its
            :class:`~snapkeep.errors.StagingRaceError` comes at the next snapshot on every
            rank): one ``RuntimeWarning`` names it and this extension copies in the call from
            then on; ``'strict'`` raises it instead. ``False`` copies all of it in the call.

    Raises:
        ValueError: a callable ``filename``, a template with fields in its directory part, or a
            non-positive ``timeout_s``.
    """
    return _ShardedSnapshot(
        target=target, condition=condition, writer=writer, filename=filename,
        snapshot_on_error=snapshot_on_error, n_retains=n_retains, autoload=autoload,
        retention=retention, weights_only=weights_only, on_save_error=on_save_error,
        timeout_s=timeout_s, quiet=quiet, overlap=overlap)


class _ShardedSnapshot(SnapshotExtension):
    """See :func:`sharded_snapshot`."""

    sharded_directories = True

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, saver_rank: int | None = None,
                 savefun: Any = None, map_location: Any = "cpu", **kwargs: Any) -> None:
        if savefun is not None:
            raise TypeError("snapshot_mode=SHARDED writes through torch.distributed.checkpoint; "
                            "savefun cannot be given")
        check_timeout_s(timeout_s)
        super().__init__(**kwargs)
        if not self._template.parsable:
            raise ValueError(
                "snapshot_mode=SHARDED needs a string filename template such as "
                f"'snapshot_iter_{{.iteration}}', got {self.filename!r}")
        del saver_rank, map_location  # every rank writes its shards; tensors load where they live
        self.timeout_s = float(timeout_s)
        self._groups: Groups | None = None
        self._sharded_store: ShardedStore | None = None
        self._saver: ShardedSaver | None = None
        self._incomplete: list[Entry] = []
        self._layout = ShardedStateLayout(target=self._target, weights_only=self._weights_only)

    # -- setup ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._groups.rank if self._groups else 0

    def _sharded_store_of(self, manager: Any) -> ShardedStore:
        if self._sharded_store is None:
            writer = manager.writer if self.writer is None else self.writer
            self.writer = writer
            if not isinstance(writer, _SnapkeepWriter):
                raise TypeError(
                    "snapshot_mode=SHARDED needs a snapkeep writer (for out_dir and fs), got "
                    f"{type(writer).__name__}")
            storage, directory = writer.storage_for(manager.out)
            self._sharded_store = ShardedStore(
                storage, directory, self._template,
                storage_options=getattr(writer, "_storage_options", None))
        return self._sharded_store

    def session(self, manager: Any) -> Session | None:
        """The engine session on the sharded store (``extensions.preemption`` gets the run
        control from it)."""
        return self._sharded_session_of(manager)

    def _sharded_session_of(self, manager: Any) -> Session:
        """The engine session on the sharded store (its start-up, lock and retention input
        check; the store's lineage is this manager's)."""
        store = self._sharded_store_of(manager)
        if self._session is None or self._session.store is not store:
            self._session = Session(store, policy=self._retention, lineage=self._shared,
                                    quiet=self._quiet)
        return self._session

    def _engine(self, manager: Any) -> ShardedSaver:
        if self._saver is None:
            retain = self._retain if self.rank == 0 and self._retention is not None else None
            self._saver = ShardedSaver(self._sharded_store_of(manager), self._groups, retain=retain)
        return self._saver

    def initialize(self, manager: Any) -> str | None:  # type: ignore[override]
        """Create snapkeep's process groups (collective); on rank 0 the store's start-up (kind
        check, lock, sweep of snapkeep's own unfinished saves), its outcome exchanged; then
        autoload (returns the loaded name or None).

        Raises:
            StoreLockedError: (rank 0; RankFailedError on the others) another trainer holds this
                out_dir.
            ValueError: (rank 0, as above) the template already names single-file snapshots.
            NoCommonSnapshotError: snapshots exist but none is readable on every rank.
            RankFailedError: loading failed on some rank (named); no rank continues.
            CollectiveTimeoutError: a rank did not take part within ``timeout_s``.
        """
        self._bind_continuation(manager)  # stop triggers: first, as the single-file extension
        restored = _lineage.recover_before_autoload(manager)  # a memory tier resumes from RAM
        if is_distributed():
            self._groups = background_groups(self.timeout_s)
        session = self._sharded_session_of(manager)
        control = self._groups.control if self._groups else None
        timeout_s = self._groups.timeout_s if self._groups else None

        def note_incomplete(store: Any) -> None:  # named in the resume notice
            self._incomplete = store.uncommitted()

        if not session.opened:  # rank 0 runs the store's start-up; every rank hears
            session.open(opener=self.rank == 0, control=control, timeout_s=timeout_s,
                         before_sweep=note_incomplete)
        try:
            loaded = self._autoload(manager) if self.autoload and restored is None else None
            if self.autoload and restored is not None:
                self._continue_stored_lineage(manager, restored.step)
        except BaseException:
            self._release_lock()
            raise
        self._engine(manager)
        if restored is not None and self.autoload and restored.newer_than_storage:
            self._make_snapshot(manager)  # persist the RAM step first (memory tier)
            self.wait()  # committed on every rank before training goes on
        return loaded

    def _continue_stored_lineage(self, manager: Any, step: int) -> None:
        """After the memory tier resumed the run at ``step``: continue the lineage of storage's
        newest committed sharded snapshot at or before it (the one a storage resume would have
        loaded; its commit marker read, no shard data), so that retention goes on deleting that
        run's snapshots as after an autoload."""
        self._sharded_session_of(manager).continue_lineage(step)

    # -- the memory tier (training/extensions/_memory_tier.py) --------------------------------
    def memory_state(self, manager: Any, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s part of what a snapshot saves, for the memory tier's RAM snapshot:
        the DCP state of the layout (module docstring) with every DTensor replaced by its local
        shard (``to_local()``: a view of the live shard, no copy); plain tensors and the bytes
        of non-tensor state as they are. Collective-free."""
        return local_shards(self._layout.state(manager, rank))

    def memory_template(self, manager: Any, keys: set[str], rank: int) -> dict[str, Any]:
        """What a RAM snapshot holding the flattened ``keys`` loads into on ``rank``: the live
        state (models' and optimizers' DTensors and tensors, which share memory with the live
        ones), as a storage resume builds it.

        Raises:
            KeyError: the RAM snapshot lacks an object of the target.
        """
        return self._layout.load_template(manager, keys, rank)

    def apply_memory_state(self, manager: Any, template: dict[str, Any], path: str,
                           step: int, rank: int) -> None:
        """Set the target from a filled :meth:`memory_template` (the RAM snapshot at ``path``
        of ``step``), as a storage resume applies a loaded snapshot."""
        name = path.rsplit("/", 1)[-1]
        self._layout.apply_loaded(manager, template,
                                  Entry(name=name, path=path, key=(float(step),), step=step),
                                  rank)

    # -- saving --------------------------------------------------------------------------------
    def _make_snapshot(self, manager: Any, *, on_error: bool = False) -> None:
        saver = self._engine(manager)
        name = ppe_name(self._template, manager)
        if on_error:  # mid-iteration state: never under a clean snapshot's name
            name += ON_ERROR_SUFFIX
        job = ShardedJob(name=name, step=int(manager.iteration), run_id=self._run_id,
                         metrics=observed_metrics(manager), version=_version())
        if not on_error:
            self._check_metrics(job)
        if self._on_save_error == "log":
            try:  # an earlier failure (the same on every rank) is logged; this one is taken
                saver.wait()
            except StagingRaceError as e:  # 'strict' raises
                self._on_staging_race(e)
            except (SnapshotError, OSError) as e:
                logger.error("rank %d: an earlier sharded snapshot failed and "
                             "on_save_error='log': %s", self.rank, e)
        state = self._layout.state(manager, self.rank)
        try:
            try:
                saver.save(state, job, overlap=None if on_error else self._overlap_plan(manager))
            except StagingRaceError as e:  # the previous snapshot was dropped on every rank
                self._on_staging_race(e)  # 'strict' raises; else warned once, overlap off
                saver.save(state, job)
        except (SnapshotError, OSError) as e:
            if self._on_save_error == "raise" or isinstance(e, StagingRaceError):
                raise
            logger.error("rank %d: sharded snapshot %s at iteration %s failed and "
                         "on_save_error='log': %s", self.rank, name, manager.iteration, e)

    def _overlap_plan(self, manager: Any) -> frozenset[Any] | None:
        """The storages the next save may copy in the background (the target's optimizers'
        local shards), its optimizers' ``step()`` guarded; None while overlap is off or
        there is no optimizer."""
        if not self._overlap_on or self._saver is None:
            return None
        optimizers = optimizers_in(manager if self._target is None else self._target)
        if not optimizers:
            return None
        self._staging_guard.guard(optimizers)
        self._staging_guard.track(self._saver)
        return frozenset(owned_storages(optimizers))

    def _check_metrics(self, job: ShardedJob) -> None:
        """The retention input check of single-file snapshots (:class:`MetricCheck`), before
        anything is written: rank 0 (which runs retention) checks, every rank hears the outcome.

        Collective while the policy has ``KeepBest`` metrics (the same on every rank).

        Raises:
            ValueError: (rank 0; :class:`~snapkeep.errors.RankFailedError` naming it on the
                others) a ``KeepBest`` metric no manifest of this run records, once retention
                would delete a snapshot.
        """
        if self._retention is None or not best_metrics(self._retention):
            return
        session = self._session
        error: ValueError | None = None
        if self.rank == 0 and session is not None:
            try:
                session.check_retention_input(job.name, job.step, job.metrics)
            except ValueError as e:  # exchanged: no rank starts the save
                error = e
        control = self._groups.control if self._groups else None
        timeout_s = self._groups.timeout_s if self._groups else None
        try:
            together(control, error, what=f"checking the retention policy before {job.name}",
                      timeout_s=timeout_s)
        except RankFailedError as e:
            if error is not None:
                raise error from e  # rank 0 keeps the ValueError
            raise

    def wait(self) -> None:
        """Wait until the snapshot in flight is committed on every rank (raising its error; a
        snapshot dropped by a staging race is warned instead, unless ``overlap='strict'``)."""
        if self._saver is not None:
            try:
                self._saver.wait()
            except StagingRaceError as e:
                self._on_staging_race(e)

    def on_error(self, manager: Any, exc: Exception, tb: types.TracebackType) -> None:
        if self._snapshot_on_error:  # mid-iteration state: under <name>.on-error, never resumed
            self._make_snapshot(manager, on_error=True)
            self.wait()

    def finalize(self, manager: Any) -> None:
        """Wait for the snapshot in flight (its error raised, or logged with
        ``on_save_error='log'``) and stop the commit thread. Idempotent."""
        saver = self._saver
        try:
            if saver is not None:
                try:
                    saver.close()
                except StagingRaceError as e:  # 'strict' raises
                    self._on_staging_race(e)
        except (SnapshotError, OSError) as e:
            if isinstance(e, StagingRaceError):
                raise
            if self._on_save_error == "raise":
                raise
            logger.error("rank %d: a sharded snapshot failed before finalize and "
                         "on_save_error='log': %s", self.rank, e)
        finally:
            self._release_lock()

    def _retain(self, manifest: ShardedManifest) -> None:
        """Retention on rank 0 after a commit: the store's (whole directories of this run)."""
        store = self._sharded_store
        if store is None or self._retention is None:
            return
        store.retain(self._retention, self._lineage, protect=[store.path_of(manifest.name)])

    def _register_retention(self, manager: Any) -> None:
        """Retention runs inside the sharded commit (rank 0); nothing to register."""

    # -- autoload ------------------------------------------------------------------------------
    def _rng_enabled(self) -> bool:
        """The global generators travel in the continuation state whatever the manager's
        ``save_rng_state`` (as before this extension bound its manager; each rank's own
        streams go in ``rank_state`` besides)."""
        return True

    def _autoload(self, manager: Any) -> str | None:
        session = self._sharded_session_of(manager)

        def build(entry: Entry, keys: set[str]) -> dict[str, Any]:
            return self._layout.load_template(manager, keys, self.rank)

        def apply(entry: Entry, loaded: dict[str, Any]) -> None:
            self._layout.apply_loaded(manager, loaded, entry, self.rank)

        def problems(entry: Entry, values: dict[str, Any]) -> list[str]:
            return self._layout.problems(manager, values, self.rank) if values else []

        entry = session.resume_sharded(groups=self._groups, rank=self.rank, build=build,
                                       apply=apply, weights_only=self._weights_only,
                                       incomplete=self._incomplete,
                                       values=self._layout.objects_template, problems=problems)
        if entry is None:
            return None
        self.loaded_entry = entry
        return entry.name


#: The public name of :class:`_ShardedSnapshot`. The class keeps ppe's name ``_ShardedSnapshot``:
#: it is the extension's default name, under which its state is saved in a manager's state
#: dict.
ShardedSnapshotExtension = _ShardedSnapshot


def _version() -> str:
    import snapkeep

    return str(snapkeep.__version__)


__all__ = ["sharded_snapshot"]
