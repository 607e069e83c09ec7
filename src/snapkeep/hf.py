"""The Hugging Face ``Trainer`` door: verified ``checkpoint-N`` directories and a resume that
trusts content, not numbers.

The Trainer writes each checkpoint into ``<output_dir>/checkpoint-N/`` in place (weights,
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json`` last), then rotates
old ones away; ``transformers.trainer_utils.get_last_checkpoint`` resumes the highest-numbered
directory without looking inside (a half-written one breaks the resume: transformers #35782).

:class:`SnapkeepCallback` (``Trainer(callbacks=[SnapkeepCallback()])``) adds to every
``checkpoint-N`` it saves a commit marker, :data:`MARKER_NAME`, written last and atomically
after every file of the directory is durable: each file's size and xxh3-128 checksum (the
checksums of snapkeep's manifests). :func:`latest_verified` (``trainer.train(
resume_from_checkpoint=latest_verified(output_dir))``) returns the newest ``checkpoint-N`` *by
N* whose marker verifies. The callback also takes over ``save_total_limit`` rotation (see
:class:`SnapkeepCallback`), so the best and the newest committed checkpoints are never deleted.

Nothing is renamed or moved: the directories stay what the Trainer and ``from_pretrained``
read. A directory without a valid marker is never quarantined, counted or deleted
(``trainer_state.json`` of other checkpoints may name it: ``best_model_checkpoint``): one that
snapkeep's save claimed (an interrupted save) is skipped, named on stderr; a complete one the
stock Trainer wrote before the callback was added is resumed unverified, said on stderr
(:meth:`CheckpointDirs.adoptable`). The callback claims each ``checkpoint-N`` before the Trainer
writes it, refusing a directory there that neither snapkeep nor a Trainer wrote.

Requires ``transformers`` (``pip install snapkeep[hf]``); ``import snapkeep`` does not import it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from snapkeep.distributed import (
    background_groups,
    is_distributed,
)
from snapkeep.errors import SnapshotCorruptError, SnapshotSaveError
from snapkeep.retention import KeepLatest, RetentionPolicy, keep_policy
from snapkeep.session import (
    Plan,
    RunControl,
    SaveEngine,
    Session,
    check_grace_s,
    preemption_signals,
    say,
    warn_user,
)
from snapkeep.staging import check_staging_budget, tensor_bytes
from snapkeep.store import (
    CHECKPOINT_PATTERN,
    MARKER_FORMAT,
    MARKER_NAME,
    TEMPLATE,
    CheckpointDirs,
    CheckpointMarker,
    Entry,
    FileRecord,
    Storage,
    checkpoint_step,
    commit_checkpoint,
    read_marker,
    resolve_storage,
    verify_checkpoint,
)
from snapkeep.tiers import MemoryTier, TieredSession, check_memory

__all__ = [
    "CHECKPOINT_PATTERN", "MARKER_FORMAT", "MARKER_NAME", "CheckpointDirs", "CheckpointMarker",
    "FileRecord", "SnapkeepCallback", "SnapkeepSaveMixin", "SnapkeepTrainer", "checkpoint_step",
    "commit_checkpoint", "latest_verified", "read_marker", "rotate", "step_metrics",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

def _storage(directory: str | os.PathLike[str]) -> tuple[Storage, str]:
    return resolve_storage(os.fspath(directory))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _session(output_dir: str | os.PathLike[str], *, policy: RetentionPolicy | None = None,
             quiet: bool = False) -> Session:
    storage, path = _storage(output_dir)
    return Session(CheckpointDirs(storage, path), policy=policy, quiet=quiet)


def latest_verified(output_dir: str | os.PathLike[str], *, quiet: bool = False) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` (highest N, never mtime) whose marker
    verifies; pass it as ``trainer.train(resume_from_checkpoint=...)``.

    The engine session's resume choice (as every door's): the newest one that verifies, said
    on stderr (rank 0: ``snapkeep: resuming from checkpoint-N (step N) in DIR``), each one
    skipped named with why (no marker: a save killed midway; a truncated or changed file; a
    marker of another step: a copy), or that the run starts fresh. A complete checkpoint the
    stock Trainer wrote before snapkeep was added (no marker, never claimed by snapkeep's save,
    ``trainer_state.json`` of step N) counts too, unverified (no checksums), said on stderr.
    Skipped directories are left as they are (not deleted or moved; see the module
    docstring).

    Args:
        output_dir: the Trainer's ``args.output_dir`` (a local path).
        quiet: no notice on stderr (still logged at INFO).

    Returns:
        The directory's path, or ``None`` when none verifies or there is none (the Trainer
        then starts from scratch; the notice names what was skipped).

    Raises:
        SnapshotStorageError: the storage could not be reached.
    """
    session = _session(output_dir, quiet=quiet)
    store: Any = session.store
    if not store.storage.isdir(store.directory):
        session.choose(store.verify, candidates=[])
        return None
    adopted: list[Entry] = []

    def check(entry: Entry) -> Any:
        try:
            return store.verify(entry)
        except SnapshotCorruptError as e:
            why = store.adoptable(entry)
            if why:
                raise SnapshotCorruptError(f"{e} ({why})") from e
            adopted.append(entry)  # the stock Trainer's, from before snapkeep: unverified
            return None

    entry = session.choose(check)
    if entry is not None and entry in adopted:
        say(f"{entry.name} has no commit marker (written by the Trainer before snapkeep was "
            "added): resumed unverified, as the Trainer wrote it; the next checkpoints are "
            "committed", quiet=quiet)
    return None if entry is None else str(entry.path)


# -- the callback --------------------------------------------------------------------------------
class SnapkeepCallback(TrainerCallback):  # type: ignore[misc]
    """Commits every ``checkpoint-N`` the Trainer saves, and rotates them safely, through the
    engine session (:class:`snapkeep.session.Session`, as every door: lock, lineage, the
    retention input check, retention after the commit).

    ``Trainer(..., callbacks=[SnapkeepCallback()])``. On the process that saves
    (``args.should_save``):

    - ``on_train_begin``: the output directory is opened: created, and locked (``.snapkeep/``,
      one trainer per output directory: a second one gets
      :class:`~snapkeep.errors.StoreLockedError` naming the first); the run status
      (``.snapkeep/status.json``, ``snapkeep status DIR``) becomes ``running``, and
      ``finished`` at ``on_train_end``.
    - ``on_save`` (the Trainer calls it after the whole directory, ``trainer_state.json``
      included, is written): :func:`commit_checkpoint`, its marker recording the numbers
      logged at that step (``state.log_history``) and the best metric.
    - ``on_step_end`` when a save follows at a step whose directory already exists (a resumed
      run saving N again): its old marker is removed first, so a directory being overwritten
      never carries a marker that describes other bytes.
    - retention: ``keep`` (snapkeep's policy), else ``save_total_limit``: at ``on_train_begin``
      the callback takes the limit over (it sets ``args.save_total_limit`` to ``None`` so the
      Trainer's own rotation, which runs *before* ``on_save`` and orders by mtime or number,
      deletes nothing) and after each commit keeps what the policy keeps among this run's
      committed checkpoints plus, always, the newest committed one and
      ``state.best_model_checkpoint``. It never deletes a directory without a marker (a
      foreign or half-written one) or one committed by another run (a stale
      ``checkpoint-700`` in a reused ``output_dir``). A failed delete is logged, not raised.
      A ``KeepBest`` metric no checkpoint records raises ``ValueError`` before the commit,
      before anything is deleted. At the end of training with ``save_total_limit=1`` the
      Trainer would delete all but the best; here the newest committed one stays too (so the
      run can be resumed).
    - ``on_evaluate`` (``save_best=True``): an evaluation that finds a new best
      ``metric_for_best_model`` at a step that is not a save step (``save_steps`` not a
      multiple of ``eval_steps``: transformers #39476) makes the Trainer save that step too,
      so the best checkpoint exists and ``state.best_model_checkpoint`` names it; rotation
      then keeps it.

    The run id (recorded in each marker, see :class:`CheckpointMarker`) is inherited from the
    checkpoint a run resumes from, so rotation after a resume still sees its own checkpoints.

    Args:
        output_dir: where the checkpoints are; default ``args.output_dir`` (hyperparameter
            search runs, which save into ``output_dir/run-<id>``, are not handled).
        save_best: save a new best at a step that is not a save step (see above).
        keep: snapkeep's retention policy (an int N keeps the newest N; a policy from
            :mod:`snapkeep.retention`, ``KeepBest`` ranking by the markers' metrics); default
            ``save_total_limit``'s newest N.
        preemption: catch SIGTERM and SIGUSR1 (``True``) or the given signals (a sequence of
            ``signal.Signals``) while training, as the Checkpointer's ``preemption`` (the run
            control of every door, :class:`snapkeep.session.RunControl`): the handler only
            records the signal; at the next step end every rank agrees (one all-reduce of one
            int on snapkeep's own gloo group), the Trainer saves that step and stops, and once
            its checkpoint is committed the run status becomes ``preempted`` and the process
            exits with ``SystemExit(143)``. With a deadline (``grace_s``) that this run's
            measured checkpoint write does not fit, the Trainer does not save that step (no
            durable write is started), the run status records ``committed_to: none`` and the
            process exits with ``SystemExit(79)``; the newest committed checkpoint is the
            resume point. Default False: signals keep their default action.
        timeout_s: bound of that agreement between ranks, seconds (default 600).
        staging_budget: for :class:`SnapkeepSaveMixin` (the asynchronous save): most bytes of
            host memory a checkpoint's staging copy may hold (an int of at least 1 MiB), or
            None (default: a full copy of the model's and optimizer's tensors). The Trainer's
            own ``_save`` writes ``model.safetensors`` from a whole state dict, so a checkpoint
            whose tensors exceed the budget is not staged at all: it is written in the training
            thread from the live tensors (synchronously, no copy), then committed as usual.
            The plain callback (the stock synchronous save) stages nothing either way.
        grace_s: seconds between the first preemption signal and SIGKILL (the launcher's
            grace period); None: from ``$SNAPKEEP_GRACE_S``, else SLURM's
            ``$SLURM_JOB_END_TIME``, else no deadline (the step is always saved). See
            docs/cluster.md.

    Raises:
        TypeError: ``save_best`` is not a bool, ``keep`` not an int or a policy, or
            ``preemption`` not a bool or a sequence of signals.
        ValueError: ``keep`` < 1; a signal that cannot be caught (SIGKILL, SIGSTOP);
            ``grace_s`` not a number of seconds > 0.
    """

    def __init__(self, *, output_dir: str | os.PathLike[str] | None = None,
                 save_best: bool = True, keep: int | RetentionPolicy | None = None,
                 preemption: bool | Sequence[signal.Signals | int] = False,
                 timeout_s: float = 600.0, staging_budget: int | None = None,
                 grace_s: float | None = None) -> None:
        if not isinstance(save_best, bool):
            raise TypeError(f"save_best must be True or False, got {save_best!r}")
        self.staging_budget = check_staging_budget(staging_budget)
        self.keep = keep_policy(keep)
        self.save_best = save_best
        self._output_dir = None if output_dir is None else os.fspath(output_dir)
        self.save_total_limit: int | None = None
        self.session: Session | None = None
        self.signals: tuple[signal.Signals | int, ...] = preemption_signals(preemption)
        self.timeout_s = float(timeout_s)
        self.grace_s = check_grace_s(grace_s)
        self.run: RunControl | None = None  # the run control (status, signals, deadline, exit)
        self.preempted = 0  # the agreed signal (signalled(...)) once preempted
        self.plan: Plan | None = None  # where the preemption step goes (the deadline's decision)
        self._save_started: float | None = None  # a save decided: the deadline's estimate

    @property
    def output_dir(self) -> str | None:
        """The ``output_dir`` given (None: ``args.output_dir``)."""
        return self._output_dir

    @property
    def run_id(self) -> str | None:
        """The run id recorded in this run's markers (None before training begins)."""
        return None if self.session is None else self.session.lineage.run_id

    def _dir(self, args: TrainingArguments) -> str:
        return self._output_dir if self._output_dir is not None else str(args.output_dir)

    def open(self, output_dir: str | os.PathLike[str] | None = None) -> Session:
        """Open the output directory (``on_train_begin`` does, on the process that saves):
        create it and take its lock.

        Raises:
            StoreLockedError: another live trainer holds it (its pid named).
            SnapshotStorageError: it cannot be created or written.
        """
        directory = os.fspath(output_dir) if output_dir is not None else self._output_dir
        if directory is None:
            raise ValueError("open() needs the output_dir (none was given to the callback)")
        self.close()
        policy = self.keep if self.keep is not None else (
            KeepLatest(self.save_total_limit) if self.save_total_limit else None)
        session = _session(directory, policy=policy)
        session.open()
        self.session = session
        return session

    def close(self) -> None:
        """Release the output directory's lock and the preemption handlers (idempotent)."""
        session, self.session = self.session, None
        if session is not None:
            session.close()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        if args.save_total_limit is not None:
            self.save_total_limit = args.save_total_limit if args.save_total_limit > 0 else None
            args.save_total_limit = None
            logger.info("snapkeep: rotation of %s (save_total_limit=%s) runs after each commit",
                        self._dir(args), self.save_total_limit)
        directory = self._dir(args)
        if args.should_save:
            session = self.open(directory)
        else:  # the other ranks: the lineage only
            session = self.session = _session(directory)
        if state.global_step > 0:
            _warn_if_not_exact(args, state, kwargs.get("train_dataloader"))
        if state.global_step > 0:  # resumed: inherit the lineage of the checkpoint resumed
            store: Any = session.store
            marker = store.manifest(Entry(
                name=f"checkpoint-{state.global_step}", step=state.global_step,
                path=store.storage.join(store.directory, f"checkpoint-{state.global_step}"),
                key=(float(state.global_step),)))
            session.lineage.continue_run(marker.run_id if marker is not None else None)
        groups = background_groups(self.timeout_s) if self.signals and is_distributed() \
            else None
        self.run = session.run_control(
            rank=args.process_index, world_size=args.world_size, signals=self.signals,
            control=groups.control if groups else None, timeout_s=self.timeout_s,
            grace_s=self.grace_s)
        self.run.at(state.global_step)  # running
        self.preempted, self.plan = 0, None

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self.end(state.global_step)

    def end(self, step: int) -> None:
        """The run's end, once its last checkpoint is committed: the status ``finished`` (or,
        after an agreed preemption, ``preempted`` and ``SystemExit(143)``, or ``SystemExit(79)``
        when the deadline left no time for the checkpoint's write); the lock released."""
        run, plan = self.run, self.plan
        try:
            if run is not None:
                run.at(step)
                if self.preempted:
                    names = (f"checkpoint-{step}",) if plan is None or plan.where == "storage" \
                        else ()
                    run.preempted(step, names, self.preempted, plan)
                else:
                    run.finished()
        finally:
            self.close()
        if self.preempted and run is not None:
            run.exit_preempted(step, plan)

    def failed(self, step: int, error: BaseException) -> None:
        """Record the run as ``failed`` at ``step`` with ``error`` (its type and first line)."""
        if self.run is not None:
            self.run.at(step)
            self.run.failed(error)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, metrics: Mapping[str, float] | None = None,
                    **kwargs: Any) -> None:
        if not self.save_best or metrics is None or args.metric_for_best_model is None:
            return
        if args.save_strategy not in ("steps", "epoch") or control.should_save:
            return
        name = args.metric_for_best_model
        value = metrics.get(name if name.startswith("eval_") else f"eval_{name}")
        if value is None:
            return
        best = state.best_metric
        better = best is None or (value > best if args.greater_is_better else value < best)
        if better:  # the Trainer records this step as best next; make its checkpoint exist
            logger.info("snapkeep: new best %s=%s at step %d, not a save step: saving it",
                        name, value, state.global_step)
            control.should_save = True
            self.claim(args, state, control)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        run = self.run
        if run is not None and run.watch is not None and not self.preempted:
            run.at(state.global_step)
            agreed = run.agree()  # every rank, every step: one int
            if agreed:  # every rank saves this step (if it fits), then training stops
                keep = self._ram_keeper()
                self.plan = run.plan(tier=keep is not None)  # the deadline (every rank)
                run.requested(state.global_step, self.plan)
                self.preempted = agreed
                if self.plan.where == "ram" and keep is not None:  # never a durable write
                    keep()
                control.should_save = self.plan.where == "storage"  # else: no durable write
                control.should_training_stop = True
        self.claim(args, state, control)
        self.uncommit(args, state, control)

    def _ram_keeper(self) -> Callable[[], None] | None:
        """What keeps this step in the memory tier and waits until it is committed there, for
        a preemption whose deadline leaves no time for the durable write; None without a tier
        (the plain callback has none: ``SnapkeepTrainer(memory=...)`` has)."""
        return None

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self.claim(args, state, control)
        self.uncommit(args, state, control)

    def claim(self, args: TrainingArguments, state: TrainerState,
              control: TrainerControl) -> None:
        """Before the Trainer writes ``checkpoint-N`` (a save is decided at this step): the
        directory is claimed as the owned save claims it (:meth:`CheckpointDirs.claim`): a
        directory there that snapkeep did not commit and no Trainer wrote (a user's
        ``checkpoint-4/my_eval_notes.txt``) stops the run with ``SnapshotStorageError`` naming
        it, its files untouched, never committed or rotated.

        Raises:
            SnapshotStorageError: such a directory is at the name; nothing was written.
        """
        if not (control.should_save and args.should_save):
            return
        self.save_started()
        storage, path = _storage(self._dir(args))
        CheckpointDirs(storage, path).claim(
            storage.join(path, f"checkpoint-{state.global_step}"), state.global_step)

    def uncommit(self, args: TrainingArguments, state: TrainerState,
                 control: TrainerControl) -> None:
        """Before the Trainer saves a step whose directory exists: its old marker removed."""
        if not (control.should_save and args.should_save):
            return
        storage, path = _storage(self._dir(args))
        marker_path = storage.join(path, f"checkpoint-{state.global_step}", MARKER_NAME)
        try:
            storage.remove(marker_path)
        except FileNotFoundError:
            return
        logger.info("snapkeep: removed the marker of %s before the Trainer overwrites it",
                    marker_path)

    def on_save(self, args: TrainingArguments, state: TrainerState,
                control: TrainerControl, **kwargs: Any) -> None:
        if not args.should_save:
            return
        storage, path = _storage(self._dir(args))
        checkpoint = storage.join(path, f"checkpoint-{state.global_step}")
        if not storage.isdir(checkpoint):
            logger.warning("snapkeep: %s does not exist; not committed (a hyperparameter "
                           "search run saves elsewhere: pass SnapkeepCallback(output_dir=...))",
                           checkpoint)
            return
        metrics = self.check_retention(state)
        commit_checkpoint(checkpoint, step=state.global_step, run_id=self.run_id,
                          metrics=metrics)
        CheckpointDirs(storage, path).release(f"checkpoint-{state.global_step}")
        self.retain(state)
        self.save_staged()  # written and committed: a synchronous save

    def save_started(self) -> None:
        """A checkpoint save begins (timed for the deadline's estimate, see
        :attr:`snapkeep.session.RunControl.times`)."""
        if self.run is not None and self._save_started is None:
            self._save_started = self.run.times.start()

    def save_staged(self, committed: Any = None) -> None:
        """The save begun at :meth:`save_started` returned; ``committed``: its commit future
        (None: committed already, a synchronous save)."""
        import concurrent.futures

        started, self._save_started = self._save_started, None
        if self.run is None or started is None:
            return
        if committed is None:
            committed = concurrent.futures.Future()
            committed.set_result(None)
        self.run.times.staged(started, committed)

    def check_retention(self, state: TrainerState) -> dict[str, float]:
        """The metrics of the checkpoint of ``state.global_step`` (:func:`step_metrics`),
        after the session's retention input check (before it is committed).

        Raises:
            ValueError: a ``KeepBest`` metric no checkpoint of this run records; nothing
                committed or deleted.
        """
        metrics = step_metrics(state)
        if self.session is not None:
            self.session.check_retention_input(f"checkpoint-{state.global_step}",
                                               state.global_step, metrics)
        return metrics

    def retain(self, state: TrainerState) -> list[str]:
        """Retention after a commit (see the class docstring); the paths deleted."""
        session = self.session
        if session is None or session.policy is None:
            return []
        store: Any = session.store
        deleted = store.retain(session.policy, session.lineage.members,
                               protect=[f"checkpoint-{state.global_step}",
                                        state.best_model_checkpoint])
        return [e.path for e in deleted]


def _warn_if_not_exact(args: TrainingArguments, state: TrainerState, loader: Any) -> None:
    """A resume mid-epoch with ``ignore_data_skip=True`` is not exact (the Trainer starts the
    epoch's data over): said once, at the start."""
    if not args.ignore_data_skip:
        return
    try:
        per_epoch = max(1, len(loader) // max(1, args.gradient_accumulation_steps))
    except TypeError:  # no loader, or one without a length
        return
    done = state.global_step % per_epoch
    if done:
        warn_user(f"snapkeep: resuming {done} steps into an epoch of {per_epoch} with "
                  "ignore_data_skip=True: the Trainer starts the epoch's data over, so the "
                  "batches (and what follows) differ from the uninterrupted run's. Leave "
                  "ignore_data_skip=False for an exact resume", RuntimeWarning)


def step_metrics(state: TrainerState) -> dict[str, float]:
    """What a checkpoint's marker records: the finite numbers logged at its step
    (``state.log_history`` entries of ``state.global_step``: ``loss``, ``eval_loss``, what
    ``trainer.log`` was given) and the Trainer's ``best_metric``."""
    metrics: dict[str, float] = {}
    for record in state.log_history:
        if isinstance(record, Mapping) and record.get("step") == state.global_step:
            metrics.update({str(k): float(v) for k, v in record.items()
                            if k != "step" and _is_number(v)})
    if state.best_metric is not None and _is_number(state.best_metric):
        metrics["best_metric"] = float(state.best_metric)
    return metrics


def rotate(storage: Storage, output_dir: str, *, limit: int, run_id: str,
           protect: list[str | None]) -> list[str]:
    """Delete committed checkpoints of lineage ``run_id`` beyond the newest ``limit`` (by N),
    never the newest committed one (of any lineage), nor the directories named in
    ``protect`` (names or paths), nor a directory without a valid marker or of another lineage
    (:meth:`CheckpointDirs.retain` with ``KeepLatest(limit)``). A failed delete is logged.

    Returns:
        The paths deleted.
    """
    deleted = CheckpointDirs(storage, output_dir).retain(KeepLatest(limit), {run_id},
                                                         protect=protect)
    return [e.path for e in deleted]


# -- the owned, asynchronous save ----------------------------------------------------------------
class SnapkeepSaveMixin:
    """Makes the Trainer's checkpoint save asynchronous: ``class MyTrainer(SnapkeepSaveMixin,
    Trainer)`` (or use :class:`SnapkeepTrainer`).

    ``_save_checkpoint`` (the Trainer's one save path) returns once the state is *staged*: the
    model's and optimizer's tensors copied into reused CPU buffers (snapkeep's
    :class:`~snapkeep.staging.BufferSet`, a consistent copy: training may update them at once),
    the scheduler, scaler, RNG states (the Trainer's ``rng_state.pth`` content) and
    ``TrainerState`` captured. A background thread then writes ``checkpoint-N/`` in the
    Trainer's own layout through the Trainer's own ``_save`` (``model.safetensors``,
    ``config.json``, ``training_args.bin``) plus ``optimizer.pt``, ``scheduler.pt``,
    ``rng_state.pth``, ``trainer_state.json``; then commits it (:func:`commit_checkpoint`, the
    marker last) and rotates (``save_total_limit``, as :class:`SnapkeepCallback`). So
    ``from_pretrained``, ``resume_from_checkpoint`` and every HF tool read it unchanged, and
    :func:`latest_verified` resumes it exactly (the Trainer's own resume: RNG states, and the
    data position from ``trainer_state.json``'s ``global_step``).

    One save in flight: the next save (and the end of ``train()``, and
    ``load_best_model_at_end``) waits for the previous one to commit. A background failure is
    raised once, at the next save or at the end of ``train()``, as
    :class:`~snapkeep.errors.SnapshotSaveError` with the original error chained.

    Runs the owned path for one process (``world_size == 1``), a ``PreTrainedModel``, without
    DeepSpeed, FSDP, XLA, SageMaker, ``save_only_model`` or ``push_to_hub``; otherwise it saves
    as the stock Trainer does and commits the directory synchronously (logged once).
    :class:`SnapkeepCallback` is not needed with it (removed when present: its ``on_save``
    would run before the files exist).

    ``memory=`` (a keyword argument besides the Trainer's: a ``snapkeep.MemoryTier``, as the
    Checkpointer's ``memory``) keeps the state in node RAM too: at each step end that is a
    multiple of ``memory.every``, the model's and optimizer's state dicts, the scheduler's and
    scaler's, the RNG states and the ``TrainerState`` (what ``checkpoint-N`` would hold) are
    staged into reused CPU buffers and committed to the tmpfs in the background
    (:mod:`snapkeep._core.tiers.memory_tier`: verified by checksum, peers, cleanup). With
    ``train(resume_from_checkpoint=True)`` the resume takes the newer of RAM and
    :func:`latest_verified` (said on stderr: ``snapkeep: resuming from RAM step N (own copy;
    storage's newest: M) in <tier>``, or why RAM was not used); a RAM step newer than storage
    is first written as ``checkpoint-N`` (committed, its marker last) and the Trainer resumes
    from that directory, as from any. With a path, RAM is taken when its step is at least the
    path's; ``None`` starts fresh. The tier is removed at the end of ``train()`` once storage
    holds its newest step. One process only (``world_size == 1``: the owned path).

    Incremental checkpoints (``incremental=`` of the Checkpointer and Lightning doors) are not
    offered here: ``checkpoint-N`` holds the Trainer's own files (``model.safetensors``,
    ``optimizer.pt``), which ``from_pretrained`` and ``resume_from_checkpoint`` read as they
    are; a file referring to shared blobs would break both.
    """

    def __init__(self, *args: Any, memory: MemoryTier | None = None, **kwargs: Any) -> None:
        from snapkeep.staging import BufferSet

        self._snapkeep_memory = check_memory(memory)
        self._snapkeep_tier: TieredSession | None = None
        self._snapkeep_kept: int | None = None  # the last step kept in RAM
        self._snapkeep_told_tier = False
        self._snapkeep_told = False
        super().__init__(*args, **kwargs)
        trainer: Any = self
        given = [c for c in trainer.callback_handler.callbacks
                 if isinstance(c, SnapkeepCallback)]
        while any(isinstance(c, SnapkeepCallback) for c in trainer.callback_handler.callbacks):
            trainer.callback_handler.remove_callback(SnapkeepCallback)
        # the session (lock, lineage, retention, status) as the callback's, with its settings
        self._snapkeep_callback = _OwnedCallback.like(given[0] if given else None)
        if self._snapkeep_memory is not None \
                and self._snapkeep_callback.staging_budget is not None:
            raise ValueError(
                "SnapkeepCallback(staging_budget=...) and SnapkeepTrainer(memory=...) do not go "
                "together: the memory tier keeps a full copy of the state in node RAM, which no "
                "budget below its size can hold (as the Checkpointer). Pass one of them")
        self._snapkeep_callback.mixin = weakref.ref(self)
        trainer.add_callback(self._snapkeep_callback)
        self._snapkeep_buffers = BufferSet()
        # one checkpoint in flight, its failure raised once, drained at interpreter exit
        self._snapkeep_engine = SaveEngine("hf checkpoint", wrap=_hf_save_error)
        if self._snapkeep_memory is not None:
            trainer.add_callback(_KeepInRam(self))

    def _snapkeep_owned(self) -> bool:
        from transformers import PreTrainedModel

        trainer: Any = self
        args = trainer.args
        plain = (args.world_size <= 1 and not trainer.is_deepspeed_enabled
                 and not trainer.is_fsdp_enabled and not args.save_only_model
                 and not args.push_to_hub and isinstance(trainer.model, PreTrainedModel))
        if not plain and not self._snapkeep_told:
            logger.info("snapkeep: this Trainer setup saves synchronously (stock save, then the "
                        "commit marker)")
            self._snapkeep_told = True
        return plain

    def wait_for_checkpoint(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error once.

        Raises:
            SnapshotSaveError: the background save failed (its error chained).
        """
        self._snapkeep_engine.wait()

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer: Any = self
        self.wait_for_checkpoint()
        self._snapkeep_callback.save_started()  # timed: the preemption deadline's estimate
        if not self._snapkeep_owned() or trial is not None:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            SnapkeepCallback.on_save(self._snapkeep_callback, trainer.args, trainer.state,
                                     trainer.control)
            return
        step = trainer.state.global_step  # a user's directory at the name: refused first
        storage, run_dir = _storage(trainer._get_output_dir(trial=None))
        CheckpointDirs(storage, run_dir).claim(storage.join(run_dir, f"checkpoint-{step}"), step)
        metrics = self._snapkeep_callback.check_retention(trainer.state)  # before staging
        job = (*self._snapkeep_stage(trainer), metrics)
        if job[2] is None:  # over the staging budget: written now, from the live tensors
            live = {"model": trainer.model.state_dict(),
                    "optimizer": trainer.optimizer.state_dict()}
            self._snapkeep_write(job[0], job[1], live, *job[3:])
            return
        committed = self._snapkeep_engine.submit(self._snapkeep_write, *job, label=job[0])
        self._snapkeep_callback.save_staged(committed)

    def _snapkeep_stage(self, trainer: Any) -> tuple[Any, ...]:
        output_dir, step, tree, scheduler, scaler_state, rng, state = \
            self._snapkeep_capture(trainer)
        budget = self._snapkeep_callback.staging_budget
        if budget is not None and tensor_bytes(tree) > budget:
            staged = None  # the caller writes the live tensors (see SnapkeepCallback)
        else:
            staged, _ = self._snapkeep_buffers.stage(tree)
        return (output_dir, step, staged, scheduler, scaler_state, rng, state)

    def _snapkeep_capture(self, trainer: Any) -> tuple[Any, ...]:
        """What ``checkpoint-N`` of this step holds: its path, the step, the model's and
        optimizer's state dicts (live tensors: stage them), copies of the scheduler's and
        scaler's states, the RNG states (the Trainer's ``rng_state.pth``) and of the
        ``TrainerState`` (updated as the Trainer's save updates it)."""
        import copy
        import random

        import numpy as np
        import torch
        from transformers.trainer_callback import ExportableState

        state = trainer.state
        step = state.global_step
        run_dir = trainer._get_output_dir(trial=None)
        output_dir = os.path.join(run_dir, f"checkpoint-{step}")
        if trainer.hp_search_backend is None:
            trainer.store_flos()
        # as the Trainer: best_model_checkpoint once the best one exists (or is this one)
        if trainer.args.save_strategy in ("steps", "epoch", "best") and state.best_global_step:
            best_dir = os.path.join(run_dir, f"checkpoint-{state.best_global_step}")
            if state.best_global_step == step or os.path.isdir(best_dir):
                state.best_model_checkpoint = best_dir
        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                   if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks.get(name), list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        tree = {"model": trainer.model.state_dict(),
                "optimizer": trainer.optimizer.state_dict()}
        scheduler = copy.deepcopy(trainer.lr_scheduler.state_dict())
        scaler = getattr(trainer.accelerator, "scaler", None)
        scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        rng: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                               "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.random.get_rng_state()
        return (output_dir, step, tree, scheduler, scaler_state, rng, copy.deepcopy(state))

    # -- the memory tier (memory=) -------------------------------------------------------------
    def _snapkeep_tiered(self) -> TieredSession:
        """The memory tier, a layer on the callback's session (opened: locked)."""
        trainer: Any = self
        callback = self._snapkeep_callback
        run_dir = trainer._get_output_dir(trial=None)
        session = callback.session if callback.session is not None \
            and callback.session.opened else callback.open(run_dir)
        tier = self._snapkeep_tier
        if tier is None or tier.inner is not session:
            memory = self._snapkeep_memory
            if memory is None:
                raise RuntimeError("no memory tier (memory=None)")
            storage, path = _storage(run_dir)
            tier = TieredSession(session, memory, template=TEMPLATE,
                                 directory=os.path.abspath(path) if storage.is_local
                                 else storage.url(path))
            if self._snapkeep_tier is not None:  # the RAM steps kept so far: still this run's
                tier.engine = self._snapkeep_tier.engine
            self._snapkeep_tier = tier
        return tier

    def _snapkeep_ram_keeper(self) -> Callable[[], None] | None:
        """For a preemption whose deadline leaves no time for the durable write: what keeps
        this step in RAM (whatever ``memory.every`` says) and waits until the tier committed it;
        None without a tier this setup uses."""
        if self._snapkeep_memory is None or not self._snapkeep_owned():
            return None

        def keep() -> None:
            self._snapkeep_keep_in_ram(force=True)
            self._snapkeep_tiered().wait()

        return keep

    def _snapkeep_keep_in_ram(self, *, force: bool = False) -> None:
        """Keep this step's state in RAM (at a step end, every ``memory.every`` steps; any step
        with ``force``), once per step."""
        trainer: Any = self
        memory = self._snapkeep_memory
        step = trainer.state.global_step
        if memory is None or (step % memory.every and not force) \
                or self._snapkeep_kept == step:
            return
        if not self._snapkeep_owned():
            if not self._snapkeep_told_tier:
                logger.warning("snapkeep: memory= is for the owned save (one process, a "
                               "PreTrainedModel, no DeepSpeed/FSDP): this Trainer setup keeps "
                               "nothing in RAM")
                self._snapkeep_told_tier = True
            return
        tier = self._snapkeep_tiered()

        def build() -> dict[str, Any]:
            _, _, tree, scheduler, scaler, rng, state = self._snapkeep_capture(trainer)
            return {**tree, "scheduler": scheduler, "scaler": scaler,
                    "rng": _rng_to_tree(rng),
                    "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True)}

        tier.keep(step, build)
        self._snapkeep_kept = step

    def _snapkeep_resume(self, resume_from_checkpoint: Any) -> Any:
        """``resume_from_checkpoint`` with the memory tier: the newer of RAM and storage (see
        the class docstring); RAM newer than storage is written as ``checkpoint-N`` first."""
        from transformers import TrainerState

        trainer: Any = self
        tier = self._snapkeep_tiered()
        run_dir = trainer._get_output_dir(trial=None)
        storage_step: int | None
        if resume_from_checkpoint is True:
            listed = tier.newest_stored()
            storage_step = listed
        else:
            storage_step = checkpoint_step(os.path.basename(
                os.fspath(resume_from_checkpoint).rstrip("/")))
        restored_dir: list[str] = []

        def apply(tree: Any, step: int, path: str) -> None:
            tier.inner.continue_lineage(step)  # its marker: the run of the step before it
            state = TrainerState(**json.loads(tree["trainer_state"]))
            output_dir = os.path.join(run_dir, f"checkpoint-{step}")
            storage, run_path = _storage(run_dir)
            CheckpointDirs(storage, run_path).claim(storage.join(run_path,
                                                                 f"checkpoint-{step}"), step)
            self._snapkeep_write(output_dir, step, {"model": tree["model"],
                                                    "optimizer": tree["optimizer"]},
                                 tree["scheduler"], tree["scaler"], _rng_from_tree(tree["rng"]),
                                 state, step_metrics(state))
            restored_dir.append(output_dir)

        if tier.recover(storage_step, apply) is not None:
            return restored_dir[0]
        if resume_from_checkpoint is True:
            return latest_verified(run_dir)
        return resume_from_checkpoint

    def _snapkeep_write(self, output_dir: str, step: int, staged: dict[str, Any],
                        scheduler: Any, scaler: Any, rng: Any, state: Any,
                        metrics: Mapping[str, float] | None = None) -> None:
        import torch
        from transformers.trainer import (
            OPTIMIZER_NAME,
            SCALER_NAME,
            SCHEDULER_NAME,
            TRAINER_STATE_NAME,
        )

        trainer: Any = self
        storage, path = _storage(output_dir)
        storage.makedirs(path)
        try:
            storage.remove(storage.join(path, MARKER_NAME))  # a re-save uncommits first
        except FileNotFoundError:
            pass
        trainer._save(output_dir, state_dict=staged["model"])
        torch.save(staged["optimizer"], os.path.join(output_dir, OPTIMIZER_NAME))
        torch.save(scheduler, os.path.join(output_dir, SCHEDULER_NAME))
        if scaler is not None:
            torch.save(scaler, os.path.join(output_dir, SCALER_NAME))
        torch.save(rng, os.path.join(output_dir, "rng_state.pth"))
        state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
        callback = self._snapkeep_callback
        commit_checkpoint(path, step=step, run_id=callback.run_id, metrics=metrics)
        CheckpointDirs(*_storage(trainer._get_output_dir(trial=None))).release(
            f"checkpoint-{step}")
        callback.retain(state)

    def _load_best_model(self) -> None:
        self.wait_for_checkpoint()
        super()._load_best_model()  # type: ignore[misc]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, then a wait for the last checkpoint to commit (its error
        raised; see :meth:`wait_for_checkpoint`); then the run status becomes ``finished``
        (``failed`` when either raised) and the output directory's lock is released."""
        callback = self._snapkeep_callback
        trainer: Any = self
        failed = True
        try:
            if self._snapkeep_memory is not None and self._snapkeep_owned():
                resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
                if resume is not None and resume is not False:
                    resume = self._snapkeep_resume(resume)
                    if args:
                        args = (resume, *args[1:])
                    else:
                        kwargs["resume_from_checkpoint"] = resume
            try:
                result = super().train(*args, **kwargs)  # type: ignore[misc]
            except BaseException as e:
                try:
                    self.wait_for_checkpoint()
                except Exception as save_error:  # the training error wins; the save's logged
                    logger.error("snapkeep: a background checkpoint save also failed: %s",
                                 save_error)
                if not isinstance(e, KeyboardInterrupt):
                    callback.failed(trainer.state.global_step, e)
                raise
            try:
                self.wait_for_checkpoint()
            except Exception as e:
                callback.failed(trainer.state.global_step, e)
                raise
            failed = False
            callback.end(trainer.state.global_step)  # finished; or preempted: exit 143 / 79
            return result
        finally:
            try:
                if self._snapkeep_tier is not None:  # removed once storage holds its newest
                    self._snapkeep_tier.close_tier(failed=failed)
                    self._snapkeep_tier = None
            finally:
                callback.close()


def _hf_save_error(label: str, cause: BaseException) -> BaseException:
    """What :meth:`SnapkeepSaveMixin.wait_for_checkpoint` raises for a failed background save
    (an ``Exception``; a ``BaseException`` such as ``KeyboardInterrupt`` is raised as it is)."""
    if not isinstance(cause, Exception):
        return cause
    return SnapshotSaveError(f"snapkeep: the background save of a checkpoint failed: {cause}")


class _KeepInRam(TrainerCallback):  # type: ignore[misc]
    """The owned save's memory tier at each step end (``SnapkeepSaveMixin(memory=...)``)."""

    def __init__(self, mixin: SnapkeepSaveMixin) -> None:
        self._mixin = weakref.ref(mixin)  # the Trainer holds its callbacks

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        mixin = self._mixin()
        if mixin is not None:
            mixin._snapkeep_keep_in_ram()


def _rng_to_tree(rng: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer's RNG states (``rng_state.pth``: Python's, NumPy's, torch's) as values
    ``torch.load(weights_only=True)`` reads (ints, bytes, tuples: no NumPy array)."""
    version, internal, gauss = rng["python"]
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    tree: dict[str, Any] = {
        "python": (int(version), tuple(int(v) for v in internal), gauss),
        "numpy": (str(kind), tuple(int(k) for k in keys), int(pos), int(has_gauss),
                  float(cached)),
        "cpu": rng["cpu"].clone()}
    if "cuda" in rng:
        tree["cuda"] = rng["cuda"].clone()
    return tree


def _rng_from_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_rng_to_tree` undone: the Trainer's ``rng_state.pth`` content."""
    import numpy as np

    kind, keys, pos, has_gauss, cached = tree["numpy"]
    rng = {"python": tuple(tree["python"]),
           "numpy": (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
           "cpu": tree["cpu"]}
    if "cuda" in tree:
        rng["cuda"] = tree["cuda"]
    return rng


class _OwnedCallback(SnapkeepCallback):
    """The mixin's half of :class:`SnapkeepCallback`: the session (lock, lineage, retention,
    status) from ``on_train_begin``; the mixin commits and rotates from its writer thread, and
    records the end of the run once the last commit is done."""

    @classmethod
    def like(cls, given: SnapkeepCallback | None) -> _OwnedCallback:
        """One with the settings of the callback the user gave (or the defaults)."""
        if given is None:
            return cls()
        return cls(output_dir=given.output_dir, save_best=given.save_best, keep=given.keep,
                   preemption=given.signals or False, timeout_s=given.timeout_s,
                   staging_budget=given.staging_budget, grace_s=given.grace_s)

    mixin: Callable[[], SnapkeepSaveMixin | None] = staticmethod(lambda: None)
    """The owned save this callback belongs to (a weak reference, set by the mixin)."""

    def _ram_keeper(self) -> Callable[[], None] | None:
        mixin = self.mixin()
        return None if mixin is None else mixin._snapkeep_ram_keeper()

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        return None  # the mixin's train(): after the last commit

    def uncommit(self, *args: Any, **kwargs: Any) -> None:
        return None  # the owned write uncommits a directory it saves again itself

    def claim(self, *args: Any, **kwargs: Any) -> None:
        return None  # the mixin's _save_checkpoint claims, before staging

    def on_save(self, *args: Any, **kwargs: Any) -> None:
        return None


class SnapkeepTrainer(SnapkeepSaveMixin, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` with :class:`SnapkeepSaveMixin`'s asynchronous, committed
    save (the same arguments as ``Trainer``)."""
