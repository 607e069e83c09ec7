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
read. A directory without a valid marker is *ignored* (with a warning naming it), never
quarantined or deleted: snapkeep cannot tell a crashed save from a checkpoint the stock Trainer
wrote before the callback was added, and ``trainer_state.json`` of other checkpoints may name it
(``best_model_checkpoint``).

Requires ``transformers`` (``pip install snapkeep[hf]``); ``import snapkeep`` does not import it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import uuid
from collections.abc import Mapping
from typing import Any

from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from snapkeep._core.checksum import ALGORITHM, digest_stream, require_match
from snapkeep._core.manifest import (
    CHECKSUM_HEX_CHARS,
    MAX_MANIFEST_BYTES,
    finite_metrics,
    now_unix_s,
)
from snapkeep._version import __version__
from snapkeep.errors import SnapshotCorruptError, SnapshotStorageError
from snapkeep.retention import KeepLatest, SnapshotInfo, plan_deletions
from snapkeep.store import Storage, resolve_storage, warn_user

__all__ = [
    "CHECKPOINT_PATTERN", "MARKER_FORMAT", "MARKER_NAME", "CheckpointMarker", "FileRecord",
    "SnapkeepCallback", "SnapkeepSaveMixin", "SnapkeepTrainer", "checkpoint_step",
    "commit_checkpoint", "latest_verified", "read_marker", "rotate", "verify_checkpoint",
]

logger = logging.getLogger(__name__)

#: The commit marker inside a committed ``checkpoint-N`` directory (the name sharded snapshots
#: use for theirs; the ``format`` field tells the two apart).
MARKER_NAME = ".snapkeep-commit.json"
#: Schema name and major version of the marker.
MARKER_FORMAT = "snapkeep.hf-checkpoint/1"
#: A Trainer checkpoint directory: ``checkpoint-<N>`` (transformers' ``PREFIX_CHECKPOINT_DIR``).
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-([0-9]+)$")
#: Most files one marker lists.
MAX_FILES = 10_000


def checkpoint_step(name: str) -> int | None:
    """N of a directory named ``checkpoint-N``; ``None`` for any other name."""
    found = CHECKPOINT_PATTERN.match(name)
    return int(found.group(1)) if found else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileRecord:
    """One file of a committed checkpoint directory.

    Attributes:
        size_bytes: its size in bytes.
        checksum: xxh3-128 hex digest of its content.
    """

    size_bytes: int
    checksum: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointMarker:
    """The commit marker of one ``checkpoint-N`` directory.

    Attributes:
        step: N (the Trainer's ``global_step`` when it saved).
        files: ``{path relative to the directory, '/'-separated: FileRecord}`` of every file
            the directory held when it was committed (the marker itself excluded).
        algorithm: checksum algorithm, ``'xxh3_128'``.
        run_id: the training lineage that committed it (inherited on resume); rotation only
            ever deletes checkpoints of its own lineage.
        metrics: finite numbers recorded at commit (the Trainer's ``best_metric`` as
            ``'best_metric'`` when it has one).
        created_unix_s: commit time, informational only (never used to order checkpoints).
        snapkeep_version: version that wrote it.
    """

    step: int
    files: dict[str, FileRecord]
    algorithm: str = ALGORITHM
    run_id: str | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    created_unix_s: float = 0.0
    snapkeep_version: str = ""

    def to_bytes(self) -> bytes:
        """The marker as strict JSON (UTF-8)."""
        body: dict[str, Any] = {"format": MARKER_FORMAT, **dataclasses.asdict(self)}
        body["metrics"] = finite_metrics(self.metrics)
        return json.dumps(body, sort_keys=True, indent=1, allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "marker") -> CheckpointMarker:
        """Parse and validate a marker (untrusted input: every field's type and size checked).

        Raises:
            SnapshotCorruptError: not a valid ``snapkeep.hf-checkpoint/1`` marker; the message
                names ``source`` and the field.
        """
        def bad(why: str) -> SnapshotCorruptError:
            return SnapshotCorruptError(f"{source}: {why}")

        if len(data) > MAX_MANIFEST_BYTES:
            raise bad(f"{len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise bad(f"not valid UTF-8 JSON ({e})") from None
        if not isinstance(body, dict) or body.get("format") != MARKER_FORMAT:
            raise bad(f"not a {MARKER_FORMAT!r} marker")
        step: Any = body.get("step")
        files: Any = body.get("files")
        algorithm: Any = body.get("algorithm")
        if not _is_int(step) or step < 0:
            raise bad(f"field 'step' {step!r} is not an int >= 0")
        hex_chars = CHECKSUM_HEX_CHARS.get(algorithm) if isinstance(algorithm, str) else None
        if hex_chars is None:
            raise bad(f"field 'algorithm' {algorithm!r} is not one of {sorted(CHECKSUM_HEX_CHARS)}")
        if not isinstance(files, dict) or len(files) > MAX_FILES:
            raise bad(f"field 'files' is not an object of at most {MAX_FILES} entries")
        records = {}
        for name, record in files.items():
            if not _safe_relative(name):
                raise bad(f"file name {str(name)[:80]!r} is not a relative path inside the "
                          "directory")
            if not isinstance(record, dict) or set(record) != {"size_bytes", "checksum"}:
                raise bad(f"file {name!r}: not an object with size_bytes and checksum")
            size, checksum = record["size_bytes"], record["checksum"]
            if not _is_int(size) or size < 0:
                raise bad(f"file {name!r}: size_bytes {size!r} is not an int >= 0")
            if not isinstance(checksum, str) or not re.fullmatch(f"[0-9a-f]{{{hex_chars}}}",
                                                                 checksum):
                raise bad(f"file {name!r}: checksum is not {hex_chars} lowercase hex digits")
            records[name] = FileRecord(size_bytes=size, checksum=checksum)
        run_id = body.get("run_id")
        if run_id is not None and (not isinstance(run_id, str) or len(run_id) > 200):
            raise bad("field 'run_id' is not a short string or null")
        metrics = body.get("metrics", {})
        if not isinstance(metrics, dict):
            raise bad("field 'metrics' is not an object")
        created = body.get("created_unix_s", 0.0)
        version = body.get("snapkeep_version", "")
        return cls(step=step, files=records, algorithm=algorithm, run_id=run_id,
                   metrics=finite_metrics(metrics),
                   created_unix_s=float(created) if _is_number(created) else 0.0,
                   snapkeep_version=version[:200] if isinstance(version, str) else "")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _safe_relative(name: Any) -> bool:
    if not isinstance(name, str) or not name or len(name) > 4096 or "\0" in name:
        return False
    parts = name.split("/")
    return not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


# -- committing and verifying one directory ----------------------------------------------------
def _storage(directory: str | os.PathLike[str]) -> tuple[Storage, str]:
    return resolve_storage(os.fspath(directory))


def _files_of(storage: Storage, directory: str, prefix: str = "") -> list[str]:
    """Every file under ``directory`` (relative, '/'-separated), the marker excluded."""
    files, dirs = storage.list_children(storage.join(directory, prefix) if prefix else directory)
    found = [f"{prefix}{name}" for name in files if not (not prefix and name == MARKER_NAME)]
    for sub in dirs:
        found.extend(_files_of(storage, directory, f"{prefix}{sub}/"))
    if len(found) > MAX_FILES:
        raise ValueError(f"{directory}: more than {MAX_FILES} files; not a Trainer checkpoint")
    return found


def _path_in(storage: Storage, directory: str, relative: str) -> str:
    return storage.join(directory, *relative.split("/"))


def commit_checkpoint(
    checkpoint_dir: str | os.PathLike[str], *, step: int | None = None,
    run_id: str | None = None, metrics: Mapping[str, Any] | None = None,
) -> CheckpointMarker:
    """Commit a complete ``checkpoint-N`` directory: make every file in it durable, then write
    its marker (:data:`MARKER_NAME`) last, atomically (temp file, ``fsync``, ``os.replace``,
    ``fsync`` of the directory: snapkeep's storage layer).

    Call it only once the directory is complete (the callback does, from ``on_save``, which the
    Trainer calls after ``trainer_state.json``). Reads every byte once (xxh3-128, ~8 GiB/s on
    one core).

    Args:
        checkpoint_dir: a local ``checkpoint-N`` directory.
        step: N; default parsed from the directory's name.
        run_id: the lineage to record (see :class:`CheckpointMarker`).
        metrics: numbers to record (non-finite ones are left out).

    Returns:
        The marker written.

    Raises:
        ValueError: ``step`` is None and the name is not ``checkpoint-N``, or the directory
            holds more than :data:`MAX_FILES` files.
        FileNotFoundError: the directory does not exist.
        OSError, SnapshotStorageError: a file could not be read or synced, or the marker not
            written (no marker is left then).
    """
    storage, path = _storage(checkpoint_dir)
    if step is None:
        step = checkpoint_step(storage.basename(path.rstrip("/")))
        if step is None:
            raise ValueError(f"checkpoint_dir {path!r} is not named checkpoint-N; pass step=")
    if not storage.isdir(path):
        raise FileNotFoundError(f"checkpoint_dir {path!r} is not a directory")
    records: dict[str, FileRecord] = {}
    for relative in _files_of(storage, path):
        file_path = _path_in(storage, path, relative)
        storage.sync_file(file_path)
        with storage.open_read(file_path) as f:
            checksum, size = digest_stream(f)
        records[relative] = FileRecord(size_bytes=size, checksum=checksum)
    for relative in {r.rpartition("/")[0] for r in records if "/" in r}:
        storage.sync_directory(_path_in(storage, path, relative))
    marker = CheckpointMarker(step=step, files=records, run_id=run_id,
                              metrics=finite_metrics(dict(metrics or {})),
                              created_unix_s=now_unix_s(), snapkeep_version=__version__)
    storage.write_bytes(storage.join(path, MARKER_NAME), marker.to_bytes(), tag="hf")
    logger.info("snapkeep: committed %s (step %d, %d files, %d bytes)", path, step,
                len(records), sum(r.size_bytes for r in records.values()))
    return marker


def read_marker(checkpoint_dir: str | os.PathLike[str]) -> CheckpointMarker | None:
    """The marker of ``checkpoint_dir`` as recorded (no file is hashed); ``None`` without one.

    Raises:
        SnapshotCorruptError: the marker is not a regular file, too large, or invalid.
        SnapshotStorageError: the storage could not be reached.
    """
    storage, path = _storage(checkpoint_dir)
    marker_path = storage.join(path, MARKER_NAME)
    try:
        data = storage.read_bytes(marker_path, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    except SnapshotStorageError:
        raise
    except OSError as e:
        raise SnapshotCorruptError(f"{marker_path}: {e}") from e
    return CheckpointMarker.from_bytes(data, source=marker_path)


def verify_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> CheckpointMarker:
    """Check every file the marker of ``checkpoint_dir`` lists: present, a regular file, its
    recorded size and xxh3-128 checksum. Files the marker does not list are not checked.

    Returns:
        The verified marker.

    Raises:
        SnapshotCorruptError: no marker (a save that did not finish, or a directory the
            callback never committed), an invalid marker, or a file missing, truncated or
            changed; the message names the directory and file.
        SnapshotStorageError: the storage could not be reached.
    """
    storage, path = _storage(checkpoint_dir)
    marker = read_marker(path)
    if marker is None:
        raise SnapshotCorruptError(
            f"{path}: no commit marker {MARKER_NAME} (the save did not finish, or it was not "
            "written with snapkeep.hf.SnapkeepCallback)")
    for relative, record in marker.files.items():
        file_path = _path_in(storage, path, relative)
        try:
            with storage.open_read(file_path) as f:
                checksum, size = digest_stream(f)
        except FileNotFoundError:
            raise SnapshotCorruptError(f"{file_path}: listed by the marker, missing") from None
        except SnapshotStorageError:
            raise
        except OSError as e:
            raise SnapshotCorruptError(f"{file_path}: {e}") from e
        require_match(file_path, checksum, size, recorded_checksum=record.checksum,
                      recorded_size=record.size_bytes, algorithm=marker.algorithm,
                      record="marker")
    return marker


def _checkpoints(storage: Storage, output_dir: str) -> list[tuple[int, str]]:
    """``(N, name)`` of the ``checkpoint-N`` directories in ``output_dir``, highest N first."""
    found = [(step, name) for name in storage.list_dirs(output_dir)
             if (step := checkpoint_step(name)) is not None]
    return sorted(found, reverse=True)


def latest_verified(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` (highest N, never mtime) whose marker
    verifies; pass it as ``trainer.train(resume_from_checkpoint=...)``.

    A directory that does not verify (no marker: a save killed midway; a truncated or changed
    file) is skipped with a ``RuntimeWarning`` naming it and why, and the next lower N is tried.
    Skipped directories are left as they are (not deleted or moved; see the module docstring).

    Args:
        output_dir: the Trainer's ``args.output_dir`` (a local path).

    Returns:
        The directory's path, or ``None`` when none verifies or there is none (the Trainer
        then starts from scratch; the warnings name what was skipped).

    Raises:
        SnapshotStorageError: the storage could not be reached.
    """
    storage, path = _storage(output_dir)
    for step, name in _checkpoints(storage, path):
        candidate = storage.join(path, name)
        try:
            verify_checkpoint(candidate)
        except SnapshotCorruptError as e:
            warn_user(f"snapkeep: skipping {candidate} (step {step}) for resume: {e}",
                      RuntimeWarning)
            continue
        logger.info("snapkeep: newest verified checkpoint in %s is %s", path, candidate)
        return candidate
    return None


# -- the callback --------------------------------------------------------------------------------
class SnapkeepCallback(TrainerCallback):  # type: ignore[misc]
    """Commits every ``checkpoint-N`` the Trainer saves, and rotates them safely.

    ``Trainer(..., callbacks=[SnapkeepCallback()])``. On the process that saves
    (``args.should_save``):

    - ``on_save`` (the Trainer calls it after the whole directory, ``trainer_state.json``
      included, is written): :func:`commit_checkpoint`.
    - ``on_step_end`` when a save follows at a step whose directory already exists (a resumed
      run saving N again): its old marker is removed first, so a directory being overwritten
      never carries a marker that describes other bytes.
    - ``save_total_limit``: at ``on_train_begin`` the callback takes the limit over (it sets
      ``args.save_total_limit`` to ``None`` so the Trainer's own rotation, which runs *before*
      ``on_save`` and orders by mtime or number, deletes nothing) and after each commit keeps
      the newest ``limit`` committed checkpoints of this run plus, always, the newest committed
      one and ``state.best_model_checkpoint``. It never deletes a directory without a marker
      (a foreign or half-written one) or one committed by another run (a stale
      ``checkpoint-700`` in a reused ``output_dir``). A failed delete is logged, not raised.
      At the end of training with ``save_total_limit=1`` the Trainer would delete all but the
      best; here the newest committed one stays too (so the run can be resumed).
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

    Raises:
        TypeError: ``save_best`` is not a bool.
    """

    def __init__(self, *, output_dir: str | os.PathLike[str] | None = None,
                 save_best: bool = True) -> None:
        if not isinstance(save_best, bool):
            raise TypeError(f"save_best must be True or False, got {save_best!r}")
        self.save_best = save_best
        self._output_dir = None if output_dir is None else os.fspath(output_dir)
        self.save_total_limit: int | None = None
        self.run_id: str | None = None

    def _dir(self, args: TrainingArguments) -> str:
        return self._output_dir if self._output_dir is not None else str(args.output_dir)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        if args.save_total_limit is not None:
            self.save_total_limit = args.save_total_limit if args.save_total_limit > 0 else None
            args.save_total_limit = None
            logger.info("snapkeep: rotation of %s (save_total_limit=%s) runs after each commit",
                        self._dir(args), self.save_total_limit)
        self.run_id = None
        if state.global_step > 0:  # resumed: inherit the lineage of the checkpoint resumed
            storage, path = _storage(self._dir(args))
            try:
                marker = read_marker(storage.join(path, f"checkpoint-{state.global_step}"))
            except SnapshotCorruptError:
                marker = None
            self.run_id = marker.run_id if marker is not None else None
        if self.run_id is None:
            self.run_id = uuid.uuid4().hex

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

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
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
        metrics = {} if state.best_metric is None else {"best_metric": state.best_metric}
        commit_checkpoint(checkpoint, step=state.global_step, run_id=self.run_id,
                          metrics=metrics)
        self._rotate(storage, path, state)

    def _rotate(self, storage: Storage, output_dir: str, state: TrainerState) -> None:
        if self.save_total_limit is not None and self.run_id is not None:
            rotate(storage, output_dir, limit=self.save_total_limit, run_id=self.run_id,
                   protect=[f"checkpoint-{state.global_step}", state.best_model_checkpoint])


def rotate(storage: Storage, output_dir: str, *, limit: int, run_id: str,
           protect: list[str | None]) -> list[str]:
    """Delete committed checkpoints of lineage ``run_id`` beyond the newest ``limit`` (by N),
    never the newest committed one (of any lineage), nor the directories named in
    ``protect`` (names or paths), nor a directory without a valid marker or of another lineage.
    Markers are read, not verified (files are not hashed). A failed delete is logged.

    Returns:
        The paths deleted.
    """
    ours: list[SnapshotInfo] = []
    newest_committed: str | None = None
    for step, name in _checkpoints(storage, output_dir):
        try:
            marker = read_marker(storage.join(output_dir, name))
        except SnapshotCorruptError:
            continue
        if marker is None:
            continue
        newest_committed = newest_committed or name
        if marker.run_id == run_id:
            ours.append(SnapshotInfo(name=name, key=(float(step),), step=step))
    kept = [newest_committed] + [os.path.basename(os.path.normpath(p)) for p in protect if p]
    deleted = []
    for name in plan_deletions(KeepLatest(limit), ours, protect=[k for k in kept if k]):
        doomed = storage.join(output_dir, name)
        try:
            storage.remove(storage.join(doomed, MARKER_NAME))  # uncommitted first
            storage.remove_tree(doomed)
        except OSError as e:
            logger.warning("snapkeep: could not delete %s (rotation, save_total_limit=%d): %s",
                           doomed, limit, e)
            continue
        logger.info("snapkeep: deleted %s (save_total_limit=%d)", doomed, limit)
        deleted.append(doomed)
    return deleted


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
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import concurrent.futures

        from snapkeep.staging import BufferSet

        super().__init__(*args, **kwargs)
        trainer: Any = self
        while any(isinstance(c, SnapkeepCallback) for c in trainer.callback_handler.callbacks):
            trainer.callback_handler.remove_callback(SnapkeepCallback)
        self._snapkeep_callback = _OwnedCallback()  # rotation limit and lineage, as the callback
        trainer.add_callback(self._snapkeep_callback)
        self._snapkeep_buffers = BufferSet()
        self._snapkeep_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="snapkeep-hf")
        self._snapkeep_pending: Any = None

    def _snapkeep_owned(self) -> bool:
        from transformers import PreTrainedModel

        trainer: Any = self
        args = trainer.args
        plain = (args.world_size <= 1 and not trainer.is_deepspeed_enabled
                 and not trainer.is_fsdp_enabled and not args.save_only_model
                 and not args.push_to_hub and isinstance(trainer.model, PreTrainedModel))
        if not plain and not getattr(self, "_snapkeep_told", False):
            logger.info("snapkeep: this Trainer setup saves synchronously (stock save, then the "
                        "commit marker)")
            self._snapkeep_told = True
        return plain

    def wait_for_checkpoint(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error once.

        Raises:
            SnapshotSaveError: the background save failed (its error chained).
        """
        from snapkeep.errors import SnapshotSaveError

        pending = getattr(self, "_snapkeep_pending", None)
        if pending is None:
            return
        self._snapkeep_pending = None
        try:
            pending.result()
        except Exception as e:
            raise SnapshotSaveError(f"snapkeep: the background save of a checkpoint failed: "
                                    f"{e}") from e

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer: Any = self
        self.wait_for_checkpoint()
        if not self._snapkeep_owned() or trial is not None:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            SnapkeepCallback.on_save(self._snapkeep_callback, trainer.args, trainer.state,
                                     trainer.control)
            return
        job = self._snapkeep_stage(trainer)
        self._snapkeep_pending = self._snapkeep_pool.submit(self._snapkeep_write, *job)

    def _snapkeep_stage(self, trainer: Any) -> tuple[Any, ...]:
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
        staged, _ = self._snapkeep_buffers.stage(tree)
        scheduler = copy.deepcopy(trainer.lr_scheduler.state_dict())
        scaler = getattr(trainer.accelerator, "scaler", None)
        scaler_state = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        rng: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                               "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.random.get_rng_state()
        return (output_dir, step, staged, scheduler, scaler_state, rng, copy.deepcopy(state))

    def _snapkeep_write(self, output_dir: str, step: int, staged: dict[str, Any],
                        scheduler: Any, scaler: Any, rng: Any, state: Any) -> None:
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
        metrics = {} if state.best_metric is None else {"best_metric": state.best_metric}
        commit_checkpoint(path, step=step, run_id=callback.run_id, metrics=metrics)
        callback._rotate(storage, storage.dirname(path), state)

    def _load_best_model(self) -> None:
        self.wait_for_checkpoint()
        super()._load_best_model()  # type: ignore[misc]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, then a wait for the last checkpoint to commit (its error
        raised; see :meth:`wait_for_checkpoint`)."""
        try:
            result = super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            try:
                self.wait_for_checkpoint()
            except Exception as e:  # the training error wins; the save's is logged
                logger.error("snapkeep: a background checkpoint save also failed: %s", e)
            raise
        self.wait_for_checkpoint()
        return result


class _OwnedCallback(SnapkeepCallback):
    """The mixin's half of :class:`SnapkeepCallback`: the rotation limit and the lineage at
    ``on_train_begin``; the mixin commits and rotates from its writer thread."""

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        return None

    def on_save(self, *args: Any, **kwargs: Any) -> None:
        return None


class SnapkeepTrainer(SnapkeepSaveMixin, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` with :class:`SnapkeepSaveMixin`'s asynchronous, committed
    save (the same arguments as ``Trainer``)."""
