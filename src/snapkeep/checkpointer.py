"""The front door for plain PyTorch loops: :class:`Checkpointer`.

A loop without a manager saves and resumes with one object, shaped after Orbax's
``CheckpointManager`` (``save(step, ...)``, ``should_save``, ``latest_step``, ``wait``,
``close``, ``max_to_keep``) and DCP's ``Stateful`` protocol (objects with
``state_dict``/``load_state_dict`` loaded in place)::

    with snapkeep.Checkpointer("runs/exp1", keep=3, every=100) as ckpt:
        state = {"model": model, "optim": optim, "sched": sched, "data": loader}
        start = ckpt.load(into=state) or 0
        for step in range(start + 1, total + 1):
            ...
            ckpt.save(step, state)      # returns at once; written in the background

It goes through the same store as the manager's snapshot extension: the directory lock, retention
after commit, checksum manifests, the newest valid snapshot with fallback, safe loading, and the
exit drain (a pending snapshot is committed at interpreter exit).

The snapshot is one plain ``torch.save`` file (``torch.load(path, weights_only=True)`` opens
it)::

    {'format': 'snapkeep.checkpoint/1',
     'step': int,
     'state': {key: obj.state_dict() | generator state (uint8 tensor) | plain value},
     'rng': {...}}   # Python, NumPy, torch CPU/CUDA generators (absent with rng=False)
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
import types
import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from snapkeep._version import __version__
from snapkeep.distributed import (
    is_distributed,
    job_rank,
)
from snapkeep.errors import (
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotError,
    StateMismatchError,
    StoreLockedError,
)
from snapkeep.layout import (
    LoaderPosition,
    RngState,
    StatefulLoaderState,
    is_stateful_loader,
    loader_position,
)
from snapkeep.retention import RetentionPolicy, keep_policy
from snapkeep.session import (
    AutoInterval,
    Cadence,
    Plan,
    RunControl,
    RunHistory,
    RunLineage,
    Session,
    check_every,
    check_grace_s,
    preemption_signals,
    warn_user,
)
from snapkeep.staging import into_existing_state
from snapkeep.store import (
    ON_ERROR_SUFFIX,
    Entry,
    SnapshotStore,
    Storage,
    check_timeout_s,
    describe,
    find_mismatches,
    lookalike_message,
    resolve_storage,
    step_template,
    unloadable_value,
)
from snapkeep.tiers import IncrementalTracker, MemoryTier, TieredSession, check_memory, state_bytes
from snapkeep.writing import ThreadWriter, Writer

if TYPE_CHECKING:  # importing it imports torch.distributed.checkpoint (seconds): when sharded
    from snapkeep.sharded_checkpoint import ShardedCheckpoint

__all__ = ["DEFAULT_TIMEOUT_S", "FORMAT", "RUN_ID", "Checkpointer"]

logger = logging.getLogger(__name__)

#: Default bound of every collective of sharded snapshots (seconds), as the manager's.
DEFAULT_TIMEOUT_S = 600.0
#: The ``format`` entry of a Checkpointer snapshot.
FORMAT = "snapkeep.checkpoint/1"
#: The run id in every Checkpointer snapshot's manifest: retention counts and deletes only
#: snapshots recording it (and ones without a run id that a resume went through), never a
#: manager's, another tool's, or a file without a manifest (junk named like a snapshot).
RUN_ID = "checkpointer"


#: (directory, template lock key) -> the open Checkpointer of this process holding it. The store
#: lock (flock) refuses other processes; within one process it lets a newer trainer take over
#: from a forgotten one (a notebook cell run again), so open Checkpointers are checked here.
_OPEN: weakref.WeakValueDictionary[tuple[str, str], Checkpointer] = weakref.WeakValueDictionary()


def stateful(key: str, obj: Any) -> Any:
    """The one place that decides how a value of ``state`` is saved and loaded.

    Returns an object with ``state_dict()``/``load_state_dict(state)`` to save and load
    ``obj`` through: ``obj`` itself when it has them (modules, optimizers, LR schedulers,
    ``GradScaler``, your own objects); for torchdata's ``StatefulDataLoader``, its state plus
    the loader's geometry and sampler epoch (``snapkeep.layout.StatefulLoaderState``); for a
    plain ``torch.utils.data.DataLoader``, its position (epoch order and batches received, kept
    by hooking the loader in place, as ``extensions.snapshot(loaders=...)`` does: see
    ``snapkeep._core.state.data_position``). The data loaders' wrappers also have
    ``problems(saved)``: why a saved state does not fit, checked before anything is loaded.
    ``None`` for a value saved as is (``torch.Generator`` and plain values are handled by the
    caller).

    Raises:
        TypeError: ``obj`` is a plain ``DataLoader`` over an ``IterableDataset`` (its position
            cannot be skipped to without reading it).
    """
    if is_stateful_loader(obj):
        return StatefulLoaderState(key, obj)
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict",
                                                                       None)):
        return obj
    if isinstance(obj, torch.utils.data.DataLoader):
        return _LoaderState(key, loader_position(key, obj))
    return None


class _LoaderState:
    """``state_dict``/``load_state_dict(state)`` of a plain DataLoader, through its position."""

    def __init__(self, key: str, position: LoaderPosition) -> None:
        self._key = key
        self._position = position

    def state_dict(self) -> dict[str, Any]:
        return self._position.state_dict()

    def problems(self, state: Any) -> list[str]:
        return self._position.problems(state, self._key)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._position.load_state_dict(state, self._key)


def _refuse_plain_loaders(objects: Mapping[str, Any]) -> None:
    """Sharded snapshots keep no plain DataLoader position (yet)."""
    for key, value in objects.items():
        if isinstance(value, torch.utils.data.DataLoader) and not callable(
                getattr(value, "state_dict", None)):
            raise TypeError(
                f"state[{key!r}] is a plain torch DataLoader: sharded snapshots keep the "
                "position of torchdata's StatefulDataLoader only (from "
                "torchdata.stateful_dataloader import StatefulDataLoader; same arguments)")


def _start_iterators(objects: Mapping[str, Any]) -> None:
    """After the data loaders among ``objects`` loaded their position, build their iterators
    now.

    A new ``DataLoader`` iterator draws its seeds (sampler order, worker base seed) from the
    global generator or the loader's ``generator``. The uninterrupted run drew them at the start
    of the epoch, before the snapshot; a resumed run that builds its iterator mid-epoch, after
    the generators were restored, would draw them again and shift every later random number
    (dropout, augmentation). torchdata's ``StatefulDataLoader.state_dict()`` builds the iterator
    from the loaded position and keeps it for the loop's next ``iter(loader)``; calling it here,
    before the generators are restored, keeps the random streams exactly as uninterrupted.
    A plain ``DataLoader`` needs nothing here: its hooked ``iter`` sets the epoch's saved
    generator states itself and puts the global generator back afterwards.
    """
    for obj in objects.values():
        state_dict = getattr(obj, "state_dict", None)
        if isinstance(obj, torch.utils.data.DataLoader) and stateful("", obj) is not None \
                and callable(state_dict):
            state_dict()


class Checkpointer:
    """Saves and resumes a plain training loop's state in ``directory`` (see the module
    docstring).

    Args:
        directory: where the snapshots go: a local path or an fsspec URL (``s3://bucket/run``).
            Created if missing. One Checkpointer (or other trainer) per directory at a time,
            whatever its template: the directory lock (a second one, in this or another
            process, raises
            :class:`~snapkeep.errors.StoreLockedError`; object stores are not locked).
        keep: how many snapshots to keep: an int N keeps the newest N by step (Orbax's
            ``max_to_keep``, ppe's ``n_retains``); a policy from :mod:`snapkeep.retention`
            (``KeepEvery``, ``KeepBest``, ``AnyOf``); ``None`` keeps all. Retention runs after
            each commit and never deletes the newest valid snapshot.
        every: :meth:`should_save` is True every ``every`` steps (step % every == 0), and
            :meth:`save` without ``force`` skips the others (Orbax's ``save_interval_steps``);
            ``None`` saves whenever :meth:`save` is called. ``"auto"`` (or
            ``snapkeep.AutoInterval(mtbf_s=...)`` to set the prior mean time between
            failures, default one day): the interval is chosen from this run's measurements
            (call :meth:`save` at every step): the seconds per step, what a save costs the
            loop, its time to durable, and the failures and restart times recorded in
            ``directory/.snapkeep/goodput.json``; Young's rule with Daly's correction
            (``T = sqrt(2 C M)``, see :mod:`snapkeep._core.session.cadence`), never shorter
            than a save takes to become durable, re-chosen as the measurements change. The
            first snapshot is taken after ``warmup_steps`` timed steps; :attr:`choice` shows
            the current choice; ``snapkeep status DIR`` the job's goodput. Not with sharded
            snapshots yet (every rank would have to agree on each step's choice).
        template: the file name of a snapshot, with one ``{step}`` field and an optional format
            spec (``'ckpt_{step}'``, ``'{step}.pt'``, ``'ckpt_{step:08d}'``). "Latest" is the
            highest step parsed back from the names, never the mtime.
        writer: the snapkeep writer that writes (from :mod:`snapkeep.writing`, with no
            ``out_dir`` of its own); default a ``ThreadWriter`` (a staged CPU copy, written on a
            background thread, one snapshot in flight). ``SimpleWriter()`` writes synchronously.
            The Checkpointer finalizes it in :meth:`close`.
        rng: also save and restore Python's, NumPy's and torch's global generators (CPU, and
            CUDA once initialized) for bit-identical continuation; default True.
        weights_only: load with ``torch.load(weights_only=True)`` (default): tensors,
            containers and primitive values only; False allows arbitrary unpickling (trusted
            files only).
        map_location: as ``torch.load``'s (default ``'cpu'``; ``load_state_dict`` moves values
            to the live objects' devices).
        storage_options: fsspec options for a URL (endpoint, credentials).
        sharded: write each snapshot as a directory through ``torch.distributed.checkpoint``
            (DCP), every rank its own shards of DTensor / FSDP2 state, committed by a marker
            written last (the manager's ``SnapshotMode.SHARDED`` engine; see
            :mod:`snapkeep.sharded_checkpoint`); ``None`` (default): when torch.distributed is
            initialized. Then every method is collective (every rank calls it, in the same
            order), ``writer`` cannot be given, and rank 0 locks and runs retention.
        timeout_s: bound of every collective of sharded snapshots, seconds (default 600): a
            dead rank makes the others raise ``CollectiveTimeoutError`` within it.
        memory: keep the state in node RAM too (:class:`~snapkeep.tiers.MemoryTier`, also
            ``snapkeep.MemoryTier``): every ``memory.every`` steps :meth:`save` stages this
            rank's state (sharded: its local shards; or borrows the copy the writer staged at
            the same step) and a background thread commits it to ``memory.root`` (a tmpfs,
            default ``/dev/shm``) and copies it to ``memory.replicas`` peer ranks; :meth:`load`
            resumes from RAM first when every rank can (own copy, else a peer's; verified) and
            its step is at least storage's, reading no storage snapshot. See
            :mod:`snapkeep._core.tiers.memory_tier` (what it holds, its size check, cleanup).
        preemption: catch SIGTERM and SIGUSR1 (``True``) or the given signals (a sequence of
            ``signal.Signals``), as ``extensions.preemption`` does for a manager: the handler
            only records the signal; at the next :meth:`save` call (call it at every step; under
            torch.distributed the ranks agree there, one all-reduce of one int per call) every
            rank snapshots that step (``force``), waits until it is committed, the run status
            becomes ``preempted`` and the process exits with ``SystemExit(143)``. Default
            False: signals keep their default action. With a deadline (``grace_s``), the step
            goes to storage only when this run's measured durable write fits the time left;
            else to the memory tier only (``memory``), the durable write skipped, or nowhere,
            and the process exits with ``SystemExit(79)`` (see ``docs/cluster.md``).
        grace_s: seconds between the first preemption signal and SIGKILL (the launcher's
            grace period: Kubernetes' ``terminationGracePeriodSeconds``, a Spot notice);
            None (default): ``$SNAPKEEP_GRACE_S``, else SLURM's ``$SLURM_JOB_END_TIME``, else
            no deadline (the preemption snapshot always goes to storage). See
            :mod:`snapkeep._core.session.deadline` for the estimate and the decision.
        incremental: write incremental snapshots (single files only): each tensor storage of
            at least 1 MiB is stored once, as a content-addressed blob in
            ``directory/.snapkeep/blobs/``, and a snapshot refers to the blobs of the storages
            whose bytes did not change since the last one (a frozen backbone is written once);
            the snapshot file holds the rest. Every snapshot still loads alone (:meth:`load`,
            ``snapkeep.load_latest``, ``snapkeep verify`` check every blob it uses); retention
            deletes a blob when no snapshot refers to it any more. A bare ``torch.load`` of such
            a file fails, pointing to ``snapkeep convert`` (see
            :mod:`snapkeep._core.tiers.incremental`). Default False. With ``memory``, the RAM tier
            keeps full copies (it borrows no staged copy of an incremental snapshot).
        staging_budget: most bytes of host memory a snapshot's staging may hold (an int of at
            least 1 MiB), or None (default: a full copy of the state). A larger state is copied
            and written in pieces through that much memory; :meth:`save` returns once every
            tensor the optimizers do not own is copied, and an optimizer's next ``step()``
            waits for the rest (see :class:`~snapkeep.writing.Writer`). Not with ``writer``
            (give it to that writer), ``sharded`` or ``memory`` (``ValueError``).

    The run's status is recorded in ``directory/.snapkeep/status.json`` (rank 0), as with the
    manager's preemption extension: ``running`` from the first :meth:`load` or :meth:`save`
    at its step, then ``preempted``, ``failed`` (the ``with`` block raised) or ``finished``
    (:meth:`close`); ``snapkeep status DIR`` reads it.

    Raises:
        StoreLockedError: another live Checkpointer or trainer holds ``directory`` and this
            template (its pid, host and start time named).
        SnapshotStorageError: ``directory`` cannot be created or written.
        TypeError, ValueError: a bad argument (named, with the accepted values).
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int | RetentionPolicy | None = None,
        every: int | str | AutoInterval | None = None, template: str = "ckpt_{step}",
        writer: Writer | None = None,
        rng: bool = True, weights_only: bool = True, map_location: Any = "cpu",
        storage_options: Mapping[str, Any] | None = None, sharded: bool | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S, memory: MemoryTier | None = None,
        preemption: bool | Sequence[signal.Signals | int] = False, incremental: bool = False,
        grace_s: float | None = None, staging_budget: int | None = None,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path or URL string, got "
                            f"{type(directory).__name__}")
        self._policy = keep_policy(keep)
        checked_every = check_every(every)
        for name, value in (("rng", rng), ("weights_only", weights_only),
                            ("incremental", incremental)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        timeout_s = check_timeout_s(timeout_s)  # type: ignore[assignment]
        grace_s = check_grace_s(grace_s)  # before anything is created
        if sharded is None:
            sharded = is_distributed()
        if not isinstance(sharded, bool):
            raise TypeError(f"sharded must be True, False or None (auto), got {sharded!r}")
        memory = check_memory(memory)
        if writer is not None and not isinstance(writer, Writer):
            raise TypeError(f"writer must be a snapkeep.writing writer (ThreadWriter(), "
                            f"SimpleWriter(), ProcessWriter(), ...), got {writer!r}")
        if writer is not None and sharded:
            raise ValueError("sharded snapshots are written by every rank through "
                             "torch.distributed.checkpoint; writer cannot be given")
        if isinstance(checked_every, AutoInterval) and sharded:
            raise ValueError("every='auto' is for single-file snapshots (sharded=False); with "
                             "sharded snapshots pass every=N (steps)")
        if staging_budget is not None and (writer is not None or sharded or memory is not None):
            raise ValueError(
                "staging_budget is given to the Checkpointer's own ThreadWriter: with writer= "
                "pass it to that writer (ThreadWriter(staging_budget=...)); sharded snapshots "
                "(DCP) and the memory tier (memory=, a full copy of the state in node RAM, "
                "which no budget below the state's size can hold) do not take it. Pass "
                f"staging_budget=None, got {staging_budget!r}")
        if incremental and sharded:
            raise ValueError("incremental=True is for single-file snapshots; sharded "
                             "(torch.distributed.checkpoint) snapshots cannot be incremental "
                             "yet: pass sharded=False or incremental=False")
        self._location = os.fspath(directory)
        if writer is not None and writer.out_dir and writer.out_dir != self._location:
            raise ValueError(f"writer has out_dir {writer.out_dir!r}; the Checkpointer writes "
                             f"into {self._location!r}: pass a writer without out_dir")
        self.template = template
        self._template = step_template(template)
        self.every: int | AutoInterval | None = checked_every
        self._cadence: Cadence | None = None  # every="auto": the interval's chooser
        self._history: RunHistory | None = None  # and this run's goodput record
        self.rng = rng
        self._weights_only = weights_only
        self._map_location = map_location
        self._closed = False
        self._failed = False  # closed while the loop raised: the memory tier is kept
        self._tier: TieredSession | None = None  # the session, when the tier is its layer
        self._session: Session | TieredSession | None = None
        self._run: RunControl | None = None  # the run status and preemption hook
        self._key = ("", "")
        self._sharded: ShardedCheckpoint | None = None
        self._writer: Writer | None = None
        self._incremental: IncrementalTracker | None = None
        if not sharded:
            self._writer = writer if writer is not None else ThreadWriter(
                storage_options=storage_options, staging_budget=staging_budget)
        try:
            if self._writer is not None:
                self._writer.initialize(self._location)  # creates it; removes stale temps
                storage, path = self._writer.storage_for(self._location)
            else:
                storage, path = resolve_storage(self._location,
                                                storage_options=dict(storage_options or {}))
            self._store = SnapshotStore(storage, path, self._template)
            # the engine session: lock, one listing, kind check, sweep; lineage, the retention
            # input check and the resume notice (the snapshot extension's, see snapkeep.store)
            self._session = Session(self._store, policy=self._policy,
                                    lineage=RunLineage.named(RUN_ID), door=RUN_ID)

            if self._writer is not None:
                self._claim(storage, path)
                self._session.open()
                if incremental:
                    self._incremental = IncrementalTracker.for_store(self._store)
            else:
                from snapkeep.sharded_checkpoint import ShardedCheckpoint

                self._sharded = ShardedCheckpoint(
                    storage, path, self._template, policy=self._policy, rng=rng,
                    weights_only=weights_only, timeout_s=timeout_s,
                    storage_options=storage_options,
                    claim=lambda: self._claim(storage, path),
                    lineage=RunLineage.named(RUN_ID))
                self._session = self._sharded.session
            if memory is not None:  # the training's identity: this directory and template
                self._tier = TieredSession(
                    self._session, memory, template=self._template,
                    directory=self._location if "://" in self._location
                    else os.path.abspath(path))
                self._session = self._tier
            groups = self._sharded.groups if self._sharded is not None else None
            self._run = self._session.run_control(
                rank=groups.rank if groups is not None else job_rank(),
                world_size=groups.world_size if groups is not None else 1,
                signals=preemption_signals(preemption),
                control=groups.control if groups else None, timeout_s=timeout_s,
                grace_s=grace_s)
            if isinstance(checked_every, AutoInterval):
                self._history = RunHistory(storage, path, rank=self._run.rank)
                self._cadence = Cadence(checked_every, history=self._history)
        except BaseException:
            self.close()
            raise

    def _claim(self, storage: Storage, path: str) -> None:
        """Refuse a second open Checkpointer of this process on the directory its snapshots
        live in, however spelled or split between directory and template (the store lock
        refuses other processes), and register this one."""
        owned = self._store.snapshot_directory
        self._key = (os.path.realpath(owned) if storage.is_local else storage.url(owned), "")
        other = _OPEN.get(self._key)
        if other is not None and not other._closed:
            raise StoreLockedError(
                f"{storage.url(owned)!r} is in use by another open Checkpointer of this "
                f"process ({other!r}); two on one snapshot directory would delete and "
                "overwrite each other's snapshots, whatever their templates. close() the other "
                "one first, or use another directory")
        _OPEN[self._key] = self


    def __repr__(self) -> str:
        return f"Checkpointer({self._location!r}, template={self.template!r})"

    # -- saving ----------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` writes without ``force``: ``step % every == 0``
        (always True with ``every=None``); with ``every="auto"``, whether the chosen interval
        has passed since the newest snapshot (this call times the step)."""
        step = _check_step(step)
        if self._cadence is not None:
            return self._cadence.due(step)
        return self.every is None or step % self.every == 0  # type: ignore[operator]

    @property
    def choice(self) -> Any:
        """With ``every="auto"``: the current choice (``interval_steps``, ``interval_s``,
        ``step_s``, ``cost_s``, ``durable_s``, ``restart_s``, ``mtbf_s`` in seconds,
        ``failures``, ``clamped``: raised to the time to durable; see
        :class:`snapkeep.session.Choice`); None before the first snapshot was timed, or with a
        fixed ``every``."""
        return self._cadence.choice if self._cadence is not None else None

    def save(
        self, step: int, state: Mapping[str, Any], *, force: bool = False,
        on_error: bool = False, metrics: Mapping[str, Any] | None = None,
    ) -> Any:
        """Snapshot ``state`` at ``step``; returns once it is staged (a consistent copy), while
        the writer commits it in the background.

        Each value of ``state`` is saved by what it is: an object with ``state_dict()`` by its
        state dict (modules, optimizers, LR schedulers, ``GradScaler``, ``StatefulDataLoader``),
        a plain ``torch.utils.data.DataLoader`` by its position (see :func:`stateful`; hooked
        in place at the first ``save`` or ``load``), a ``torch.Generator`` by ``get_state()``,
        anything else (tensors, numbers, strings, containers of them) as is. With
        ``rng=True`` the global generators are saved too.

        Args:
            step: the training step (int >= 0); it names the file and orders snapshots.
            state: str keys to the objects and values to save.
            force: save even when :meth:`should_save` is False.
            on_error: save the state of a loop that raised, under ``<name>.on-error``: never
                loaded by :meth:`load` nor deleted by retention (it holds mid-step state; kept
                for inspection), and waited for before returning. Use it in an ``except``
                block: ``ckpt.save(step, state, on_error=True); raise``.
            metrics: str keys to finite numbers (int, float, or one-element tensors, read as
                float) recorded in the snapshot's manifest, as the snapshot extension records
                ``manager.observation``; ``keep=KeepBest("val_loss", ...)`` ranks snapshots by
                them (``snapkeep ls`` shows them). ``None``: none recorded.

        Returns:
            The save handle (:class:`snapkeep.session.SaveHandle`: ``handle.staged``,
            ``handle.committed`` futures and ``handle.wait(timeout_s)``, which returns the commit
            record or raises the save's error; sharded: a ``ShardedHandle`` with the same two
            futures, ``committed`` giving the marker's manifest on rank 0), or ``None`` when the
            step was skipped (``every``, or the writer's
            ``on_full='skip'``). Training may mutate every object in ``state`` as soon as this
            returns.

        Raises:
            SnapshotSaveError: an earlier background save failed (raised once, its cause
                chained); this snapshot was not taken.
            TypeError: ``state`` is not a mapping with str keys, or holds a plain DataLoader
                over an ``IterableDataset`` (or any plain DataLoader with ``sharded=True``);
                ``metrics`` is not a mapping of str keys to numbers.
            ValueError: a value of ``metrics`` is not finite.
            RuntimeError: the Checkpointer is closed.
        """
        session = self._require_open()
        step = _check_step(step)
        recorded = _check_metrics(metrics)
        run = self._run_of()
        run.at(step)
        agreed = run.agree() if not on_error else 0
        tier = self._tier
        plan = run.plan(tier=tier is not None) if agreed else None
        if plan is not None and plan.where != "storage":  # the durable write would not fit
            if plan.where == "ram":
                self._open_tier(state)
                self._save_to_ram(step, state, None)
            self._preempt(step, agreed, plan)
        to_ram = tier is not None and not on_error and tier.due(step)
        if to_ram:
            self._open_tier(state)
        due = self.should_save(step)  # (with every="auto": times this step)
        if not (force or on_error or agreed or due):
            if to_ram:
                self._save_to_ram(step, state, None)
            self._note(step, None, 0.0)
            return None
        self._note_staging(run)  # the previous budgeted snapshot's figures, for the status
        started = time.monotonic()
        handle = self._save_to_storage(session, step, state, recorded, on_error=on_error)
        if handle is not None and not on_error:
            self._note(step, handle, time.monotonic() - started)
        if to_ram:
            self._save_to_ram(step, state, handle)
        if agreed:
            self._preempt(step, agreed, plan)
        return handle

    def _note(self, step: int, handle: Any, stall_s: float) -> None:
        """With ``every="auto"``: tell the cadence and the goodput record of this step (a save
        of ``stall_s`` seconds when ``handle``)."""
        cadence, history = self._cadence, self._history
        if cadence is None or history is None:
            return
        if handle is not None:
            cadence.saved(step, stall_s=stall_s, committed=handle.committed)
        choice = cadence.choice
        history.step(step, step_s=cadence.step_s(), save_s=stall_s, saved=handle is not None,
                     interval_steps=choice.interval_steps if choice is not None else None)

    def _save_to_storage(self, session: Session | TieredSession, step: int,
                         state: Mapping[str, Any], recorded: dict[str, float], *,
                         on_error: bool) -> Any:
        if isinstance(session, TieredSession):  # RAM: _save_to_ram, on the tier's schedule
            session = session.inner
        name = self._template.name_at(step) + (ON_ERROR_SUFFIX if on_error else "")
        if self._sharded is not None:
            _refuse_plain_loaders(_check_state(state))
            self._refuse_unloadable(self._payload(step, state))
            for key, value in _check_state(state).items():
                stateful(key, value)
            run = self._run_of()
            started = run.times.start()
            sharded_handle = self._sharded.save(name, step, state, __version__,
                                                metrics=recorded)
            if not on_error:  # the deadline's estimate (single files: Session.save times it)
                run.times.staged(started, sharded_handle.committed)
            if on_error:
                sharded_handle.committed.result()
            return sharded_handle
        tree = self._payload(step, state)
        self._refuse_unloadable(tree)
        handle = session.save(self._writer, name, self._location, tree, step=step,
                              metrics=recorded, on_error=on_error,
                              incremental=self._incremental)
        if on_error and handle is not None:
            handle.wait()
        return handle

    def _note_staging(self, run: RunControl) -> None:
        """The last budgeted snapshot's figures into the run status (``staging_budget``)."""
        stats = self._writer.last_budget_stats if self._writer is not None else None
        if stats is not None and run.status is not None:
            run.status.note_staging(stats.as_status())

    def _run_of(self) -> RunControl:
        run = self._run
        if run is None:
            raise RuntimeError("the Checkpointer is closed")
        return run

    def _preempt(self, step: int, agreed: int, plan: Plan | None) -> None:
        """A preemption was agreed at ``step`` (``agreed``: a signal and a rank that received
        it; the snapshot taken where ``plan`` says): wait until it is committed on every rank,
        record ``preempted`` and exit with 143 (in storage, as ``extensions.preemption``) or
        79 (in RAM only, or nowhere: the durable write did not fit the deadline)."""
        run = self._run_of()
        where = "storage" if plan is None else plan.where
        name = self._template.name_at(step) if where == "storage" else ""
        run.requested(step, plan)
        if where == "storage":
            self.wait()  # committed on every rank (sharded: collective)
        else:
            error: BaseException | None = None
            try:
                if self._tier is not None:
                    self._tier.wait()
            except Exception as e:  # exchanged: every rank raises, naming the failing one
                error = e
            run.together(error, f"preemption RAM snapshot of step {step}")
        run.preempted(step, name, agreed, plan)
        self.close()
        run.exit_preempted(step, plan)

    # -- the memory tier -------------------------------------------------------------------------
    def _ram_tree(self, step: int, state: Mapping[str, Any]) -> Any:
        """What the memory tier keeps of ``state``: the snapshot's payload (single file), or
        this rank's local shards of it (sharded)."""
        if self._sharded is not None:
            return self._sharded.memory_state(state)
        return self._payload(step, state)

    def _open_tier(self, state: Mapping[str, Any]) -> None:
        """Open the memory tier (collective when sharded), sized for ``state``; once."""
        tier = self._tier
        if tier is not None and not tier.engine.opened:
            tier.open_tier(state_bytes(self._ram_tree(0, _check_state(state))))

    def _save_to_ram(self, step: int, state: Mapping[str, Any], handle: Any) -> None:
        """Keep ``state`` at ``step`` in RAM, borrowing the writer's staged copy of the same
        step (``handle``'s) when it has one."""
        tier, writer = self._tier, self._writer
        if tier is None:
            return
        borrow = None
        if writer is not None and handle is not None:
            def borrow() -> Any:
                return writer.lend_staged(handle)
        tier.keep(step, lambda: self._ram_tree(step, state), borrow=borrow)

    def _load_from_ram(self, into: MutableMapping[str, Any], objects: Mapping[str, Any],
                       entries: list[Entry]) -> int | None:
        """Resume from the memory tier when every rank can (see :meth:`load`); the step, or
        None (the reason said on stderr; storage is used)."""
        tier = self._tier
        if tier is None:
            return None
        self._open_tier(into)
        steps = [e.step for e in entries if e.step is not None]
        sharded = self._sharded
        if sharded is not None:
            def apply(tree: Any, step: int, path: str) -> None:
                sharded.memory_apply(into, objects, tree, step, path,
                                     before_rng=_start_iterators)
            restored = tier.recover(max(steps, default=None), apply,
                                    prepare=lambda tree: sharded.memory_prepare(objects, tree))
        else:
            def apply(tree: Any, step: int, path: str) -> None:
                entry = Entry(name=path.rsplit("/", 1)[-1], path=path, key=(float(step),),
                              step=step)
                self._apply(objects, into, self._check_format(entry, tree), entry)
            restored = tier.recover(max(steps, default=None), apply)
        if restored is None:
            return None
        if restored.newer_than_storage:  # persisted first, as the snapshot extension does
            session = self._require_open()
            handle = self._save_to_storage(session, restored.step, into, {}, on_error=False)
            if handle is not None and self._sharded is None:
                handle.wait()
            self.wait()
        return restored.step

    def _refuse_unloadable(self, tree: dict[str, Any]) -> None:
        """TypeError before anything is written when ``load`` (``weights_only=True``) could
        not load a value of the snapshot: a run must never save snapshots it cannot resume."""
        if not self._weights_only:
            return
        where = unloadable_value(tree.get("state"))
        if where is None:
            return
        key = where.split("/")[0]
        value = tree["state"].get(key) if where != "<root>" else None
        raise TypeError(
            f"state[{key!r}] ({type(value).__name__}; at {where!r}) holds an object that "
            "load(), which loads with torch.load(weights_only=True), would refuse, so no "
            "snapshot of it could be resumed; nothing was saved. Save tensors, numbers, "
            "strings and containers of them (an object's state_dict() or "
            "dataclasses.asdict()), or pass weights_only=False to the Checkpointer to save and "
            "load arbitrary objects (trusted files only)")

    def _payload(self, step: int, state: Mapping[str, Any]) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        for key, value in _check_state(state).items():
            if isinstance(value, torch.Generator):
                saved[key] = value.get_state()
            elif (saver := stateful(key, value)) is not None:
                saved[key] = saver.state_dict()
            else:
                saved[key] = value
        payload: dict[str, Any] = {"format": FORMAT, "step": step, "state": saved}
        if self.rng:
            payload["rng"] = RngState().state_dict()
        return payload

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every snapshot saved so far is committed (durable), then raise a
        background save's error, once (Orbax's ``wait_until_finished``).

        Raises:
            SnapshotTimeoutError: still pending after ``timeout_s`` seconds.
            SnapshotSaveError: a background save failed (its cause chained).
        """
        if self._closed:
            return
        if self._sharded is not None:
            self._sharded.wait()
        elif self._writer is not None:
            self._writer.wait(timeout_s)
        if self._tier is not None:
            self._tier.wait()

    # -- listing and loading -------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Steps of the committed snapshots in the directory, oldest first (listed by name, not
        verified; on-error snapshots excluded)."""
        entries = self._sharded.entries() if self._sharded is not None else self._store.entries()
        return [e.step for e in entries if e.step is not None]

    def latest_step(self) -> int | None:
        """The highest step among committed snapshots (parsed from the names; ``None`` when
        there is none). :meth:`load` verifies it and falls back to an older one if it does not
        verify."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def verify(self, step: int) -> str:
        """Verify the committed snapshot of ``step`` against the checksums recorded when it was
        committed, reading it back from storage (``snapkeep verify`` does the same for a whole
        directory). Call it after :meth:`wait` (a snapshot still in flight is not committed).

        Sharded (under torch.distributed), this is collective: every rank calls it with the
        same ``step``; each rank reads its share of the snapshot's files (file ``i`` by rank
        ``i % world_size``), and every rank raises if any rank's share fails. A single-file
        snapshot is read whole, on this process.

        Returns:
            The snapshot's path (a file, or the sharded snapshot's directory), as the storage
            names it.

        Raises:
            NoValidSnapshotError: there is no committed snapshot of ``step``.
            SnapshotCorruptError: a file is missing, truncated or differs from its checksum.
            SnapshotStorageError: the storage could not be reached.
            ValueError: ``step`` is not an int >= 0, or (sharded) the ranks name different
                steps.
            RankFailedError: (sharded) the check failed on another rank (named).
            RuntimeError: the Checkpointer is closed.
        """
        self._require_open()
        step = _check_step(step)
        if self._sharded is not None:
            return self._sharded.verify(step).path
        found = [e for e in self._store.entries() if e.step == step]
        if not found:
            raise NoValidSnapshotError(
                f"no committed snapshot of step {step} in {self._location!r} (template "
                f"{self.template!r}); steps there: {self.all_steps()[-20:]}")
        if self._store.verify(found[-1]) is None:
            raise SnapshotCorruptError(f"{found[-1].path} has no manifest: there is no checksum "
                                       "to verify it against")
        return found[-1].path

    def load(self, into: MutableMapping[str, Any], step: int | None = None) -> int | None:
        """Load the newest valid snapshot (or the one of ``step``) into the live objects of
        ``into``, and return its step; ``None`` when there is nothing to resume (first run).

        The newest snapshot by step whose checksum verifies and that loads is chosen; one that
        fails is skipped with a ``RuntimeWarning`` naming it, and the next older one is tried.
        All or nothing: every key of ``into`` must be in the snapshot and every module and
        optimizer must fit (keys, shapes, param groups) before anything is loaded. Then objects
        with ``load_state_dict`` load their state (optimizer state in place where it exists),
        generators get ``set_state``, plain values are replaced in ``into`` (as ``dcp.load``
        does), and with ``rng=True`` the global generators are restored.

        Then, as the snapshot extension after its autoload, a writer that stages (the default
        ``ThreadWriter``, a process or queue writer; not ``SimpleWriter``) prepares its staging
        buffers for ``save(step, into)`` in a background thread: allocated and zero-filled
        (faulted in), as many bytes as the state's tensor storages, into the one set of buffers
        every save reuses. After a resume that starts right after the first ``step()`` of every
        optimizer in ``into`` (training runs meanwhile); on a first run once each optimizer
        without state (Adam before its first step) has stepped, else at once (with a torchdata
        ``StatefulDataLoader`` in ``into``: only after an optimizer step, never from ``load``).
        The first save then only copies instead of also faulting fresh pages in (on the
        benchmarks' 2-vCPU VM, 1 GiB: 1.34 s into fresh pages, 0.16 s into warm ones); a save
        arriving while the buffers are still being prepared waits for them. Storage is not
        read again for this.

        With ``memory``, RAM is tried first (unless ``step`` is given): the newest step every
        rank holds in RAM (or a peer holds for it), at least storage's newest, is verified and
        loaded without opening a storage snapshot, and said on stderr (rank 0:
        ``snapkeep: resuming from RAM step N (own copy; storage's newest: M) in <tier>``); a
        step newer than storage's is saved to storage before this returns. When RAM lacks it,
        one stderr line says why and storage is used as above.

        Args:
            into: the same mapping as given to :meth:`save` (its keys select what is loaded).
            step: load exactly this step from storage (no fallback, RAM not tried); default the
                newest valid one.

        Returns:
            The step loaded, or ``None`` (one log line says so; files that look like snapshots
            of another template are named in a warning with the template that would match).

        Raises:
            StateMismatchError: the snapshot lacks a key of ``into`` or does not fit; nothing
                was loaded.
            NoValidSnapshotError: snapshots exist but none verifies and loads (each reason
                listed), or ``step`` names none / an invalid one.
            UnsafeSnapshotError: the snapshot needs ``weights_only=False``; nothing loaded.
            SnapshotStorageError: the storage could not be reached.
        """
        session = self._require_open()
        if isinstance(session, TieredSession):  # RAM is tried below, once, when step is None
            session = session.inner
        objects = _check_state(into)
        if self._sharded is not None:
            _refuse_plain_loaders(objects)
        for key, value in objects.items():
            stateful(key, value)  # hooks a plain DataLoader before its first iter
        self.wait()  # a snapshot still in flight is a candidate too
        entries = self._sharded.entries() if self._sharded is not None else self._store.entries()
        if step is None and self._tier is not None:
            from_ram = self._load_from_ram(into, objects, entries)
            if from_ram is not None:
                self._prepare_first_save(into, objects, resumed=True)
                self._resumed(from_ram)
                return from_ram
        if step is not None:
            step = _check_step(step)
            chosen = [e for e in entries if e.step == step]
            if not chosen:
                raise NoValidSnapshotError(
                    f"no snapshot of step {step} in {self._location!r} (template "
                    f"{self.template!r}); steps there: {[e.step for e in entries][-20:]}")
            entries = chosen
        if self._sharded is not None:  # every rank agrees (an empty listing here is not all)
            loaded = self._sharded.load(into, objects, entries, before_rng=_start_iterators)
            self._run_of().at(int(loaded.step or 0) if loaded is not None else 0)
            if loaded is None:
                self._nothing_to_resume()
                return None
            return loaded.step
        if not entries:
            self._nothing_to_resume()
            session.resume(self._no_apply, candidates=[])  # the notice
            self._run_of().at(0)
            self._prepare_first_save(into, objects, resumed=False)
            return None
        entry = session.resume(
            lambda e, payload: self._apply(objects, into, payload, e),
            check=self._check_format, candidates=entries, weights_only=self._weights_only,
            map_location=self._map_location)
        if entry is None:  # unreachable: entries is not empty
            return None
        self._run_of().at(int(entry.step or 0))
        self._prepare_first_save(into, objects, resumed=True)
        self._resumed(entry.step)
        return entry.step

    def _resumed(self, step: int | None) -> None:
        """With ``every="auto"``: the run resumed from ``step`` (the interval counts from
        there; the goodput record's replay is measured against it)."""
        if self._history is not None and self._cadence is not None and step is not None:
            self._history.resumed(step)
            self._cadence.resumed(step)

    @staticmethod
    def _no_apply(entry: Entry, payload: Any) -> None:
        raise AssertionError(f"nothing to apply on a first run, got {entry!r}")

    def _prepare_first_save(self, into: Mapping[str, Any], objects: Mapping[str, Any], *,
                            resumed: bool) -> None:
        """Have the writer prepare its staging buffers for ``save(step, into)`` in a background
        thread, as the snapshot extension does after its autoload (see
        :meth:`snapkeep.writing.Writer.prefault`): after a resume, once every optimizer of
        ``into`` stepped; otherwise at once, or once each optimizer without state stepped. A no-op
        for writers that do not stage (``SimpleWriter``). Reads no storage.

        A torchdata ``StatefulDataLoader`` builds its iterator (drawing its seeds) when its
        ``state_dict()`` is called before the first ``iter(loader)``, so with one in ``into``
        the buffers are only prepared after an optimizer step, never from here.
        """
        if self._writer is None:
            return
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        after_first_step = resumed
        if any(isinstance(v, torch.utils.data.DataLoader) and callable(
                getattr(v, "state_dict", None)) for v in objects.values()):
            if not optimizers:
                return
            after_first_step = True
        me = weakref.ref(self)  # an optimizer's step hook must not keep a forgotten one alive

        def state() -> dict[str, Any]:
            checkpointer = me()
            if checkpointer is None or checkpointer._closed:
                raise RuntimeError("the Checkpointer is closed")
            return checkpointer._payload(0, into)  # the tree save() stages (layout only)

        self._writer.prefault(state, optimizers, after_first_step=after_first_step)

    def _nothing_to_resume(self) -> None:
        storage, directory = self._store.storage, self._store.directory
        message = lookalike_message(storage.list_names(directory), self.template, "{step}",
                                    self._location)
        if message is not None:
            _warn(message)
        logger.debug("no snapshot of %r in %s: nothing to resume (said on stderr)",
                     self.template, self._location)

    @staticmethod
    def _check_format(entry: Entry, payload: Any) -> Any:
        """``payload`` when it is a Checkpointer snapshot, else SnapshotCorruptError."""
        if not isinstance(payload, Mapping) or payload.get("format") != FORMAT \
                or not isinstance(payload.get("state"), Mapping):
            raise SnapshotCorruptError(
                f"{entry.path} is not a Checkpointer snapshot (no format {FORMAT!r}); written "
                "by another tool under this template?")
        return payload

    def _apply(self, objects: Mapping[str, Any], into: MutableMapping[str, Any],
               payload: Mapping[str, Any], entry: Entry) -> None:
        saved = payload["state"]
        missing = [k for k in objects if k not in saved]
        if missing:
            raise StateMismatchError(
                f"snapshot {entry.path} (step {entry.step}) has no {missing} (it has "
                f"{sorted(saved)[:20]}); nothing was loaded. Next: leave {missing} out of "
                "`into` for this load and set them up yourself (the next save adds them), or "
                "start fresh with Checkpointer(<another directory>)")
        problems: list[str] = []
        for key, obj in objects.items():
            problems += [f"[{key!r}] {p}" for p in _fit_problems(obj, saved[key], key)]
        if problems:
            raise StateMismatchError(
                f"snapshot {entry.path} (step {entry.step}) does not fit: {describe(problems)}. "
                "Nothing was loaded. Next: build these objects as they were when that step was "
                f"saved ('snapkeep inspect {entry.path}' shows what it holds), or start fresh "
                "with Checkpointer(<another directory>)")
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        with into_existing_state(optimizers):
            for key, obj in objects.items():
                if isinstance(obj, torch.Generator):
                    obj.set_state(saved[key])
                elif (loader := stateful(key, obj)) is not None:
                    loader.load_state_dict(saved[key])
                else:
                    into[key] = saved[key]
        _start_iterators(objects)  # before the generators are restored: see its docstring
        if self.rng:
            if "rng" in payload:
                RngState().load_state_dict(payload["rng"])
            else:
                logger.warning("snapshot %s holds no RNG state (saved with rng=False); the "
                               "global generators were not restored", entry.path)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending snapshots, finalize the writer and release the directory lock;
        idempotent.

        Raises:
            SnapshotSaveError: a background save failed and was not reported yet.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._sharded is not None:
                self._sharded.close()
            if self._writer is not None:
                self._writer.finalize()
            if self._run is not None:
                self._note_staging(self._run)
                self._run.finished()
        except BaseException as e:
            if self._run is not None:
                self._run.failed(e)
            raise
        finally:
            try:
                self._close_tier()
            finally:
                if self._history is not None and self._run is not None:
                    status = self._run.status
                    self._history.ended(status.final if status is not None and status.final
                                        else "running")
                self._release()  # the lock, and the preemption hook's signal handlers

    def _close_tier(self) -> None:
        """Close the memory tier: its tier is removed when the loop did not raise and storage
        holds the newest step this session kept in (or resumed from) RAM; else kept for the
        next run."""
        if self._tier is not None:
            self._tier.close_tier(failed=self._failed)

    def _release(self) -> None:
        """Release the directory lock and this process's registration."""
        if self._session is not None:
            self._session.close()
        if _OPEN.get(self._key) is self:
            del _OPEN[self._key]

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        """Close (pending snapshots are committed). While an exception propagates, a save
        error raised by the close is logged instead, so the loop's own error is what surfaces."""
        if exc_type is None:
            self.close()
            return
        self._failed = True
        if self._run is not None and exc_type is not SystemExit:
            self._run.failed(f"{exc_type.__name__}: {exc}")
        try:
            self.close()
        except (SnapshotError, OSError) as e:
            logger.error("a snapshot failed while the loop raised %s: %s", exc_type.__name__, e)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            logger.warning("%r was garbage-collected without close(); pending snapshots are "
                           "committed at exit", self)

    def _require_open(self) -> Session | TieredSession:
        """The engine session of an open Checkpointer (RuntimeError once closed)."""
        if self._closed or self._session is None:
            raise RuntimeError(f"{self!r} is closed; create a new Checkpointer")
        return self._session

    @property
    def directory(self) -> str:
        """The directory or URL the snapshots go to, as given (read-only)."""
        return self._location

    @property
    def sharded(self) -> bool:
        """Whether snapshots are sharded directories written by every rank (read-only)."""
        return self._sharded is not None

    @property
    def writer(self) -> Writer | None:
        """The writer (read-only); None for sharded snapshots."""
        return self._writer


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return int(step)


def _check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """``Checkpointer.save``'s ``metrics`` as str -> float (see there); raises TypeError or
    ValueError naming the argument."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of str keys to numbers, got "
                        f"{type(metrics).__name__}")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metrics keys must be str, got {key!r}")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"metrics[{key!r}] must be an int, float or one-element tensor, "
                            f"got {type(value).__name__}")
        if not math.isfinite(float(value)):
            raise ValueError(f"metrics[{key!r}] must be finite, got {value!r}")
        out[key] = float(value)
    return out


def _check_state(state: Any) -> Mapping[str, Any]:
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise TypeError("state must be a dict of str keys to objects with state_dict() "
                        "(model, optimizer, scheduler, ...) or plain values, got "
                        f"{type(state).__name__}")
    return state


def _fit_problems(obj: Any, saved: Any, key: str = "") -> list[str]:
    """What keeps ``saved`` from loading into ``obj`` (modules: keys and shapes; optimizers:
    param groups and their sizes; data loaders: their position's kind and geometry, see
    ``snapkeep.layout``); changes nothing."""
    if isinstance(obj, torch.utils.data.DataLoader):
        wrapper = stateful(key, obj)
        check = getattr(wrapper, "problems", None)
        return list(check(saved)) if callable(check) else []
    if isinstance(obj, torch.nn.Module):
        return find_mismatches(obj.state_dict(), saved)
    if isinstance(obj, torch.optim.Optimizer):
        groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
        if not isinstance(groups, list):
            return ["not an optimizer state_dict (no 'param_groups')"]
        sizes = [len(g.get("params", [])) for g in groups if isinstance(g, Mapping)]
        live = [len(g["params"]) for g in obj.param_groups]
        if sizes != live:
            return [f"parameters per group {sizes} in the snapshot, {live} in the optimizer"]
    return []


def _warn(message: str) -> None:
    warn_user(message, RuntimeWarning)

