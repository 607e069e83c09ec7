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
from collections.abc import Mapping, Sequence
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
from snapkeep.retention import KeepLatest, RetentionPolicy, SnapshotInfo, plan_deletions
from snapkeep.store import (
    MANIFEST_DIR,
    Entry,
    FilenameTemplate,
    Session,
    StatusLog,
    Storage,
    StoreLock,
    resolve_storage,
)

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


#: The store's template: ``checkpoint-N`` (the lock's key, the notices' name).
TEMPLATE = "checkpoint-{step}"
_TEMPLATE = FilenameTemplate("checkpoint-{.iteration}")


class CheckpointDirs:
    """The ``checkpoint-N`` directories of one output directory as a snapshot store of the
    engine (:class:`snapkeep.store.StoreKind`): listed by N, each committed by its marker,
    locked as the other kinds (``.snapkeep/``, one trainer per output directory), retained
    after each commit. The Trainer writes them in place (nothing of snapkeep's own to sweep);
    a directory without a valid marker is never counted, deleted or moved.

    Args:
        storage: where they live.
        directory: the Trainer's ``output_dir`` on ``storage``.
    """

    template = _TEMPLATE

    def __init__(self, storage: Storage, directory: str) -> None:
        self.storage = storage
        self.directory = directory

    def __repr__(self) -> str:
        return f"CheckpointDirs({self.storage.url(self.directory)!r})"

    def hold_listing(self) -> None:
        """Nothing held: the Trainer writes the directories, snapkeep only their markers."""

    def check_kind(self) -> None:
        """One kind only: ``checkpoint-N`` directories."""

    def lock(self) -> StoreLock | None:
        """The one-trainer lock of the output directory (None on object stores)."""
        if not self.storage.is_local:
            return None
        return StoreLock.acquire(self.storage.join(self.directory, MANIFEST_DIR), TEMPLATE,
                                 self.storage.url(self.directory), key=_TEMPLATE.lock_key)

    def sweep(self, lineage: frozenset[str | None] | None = None) -> list[str]:
        """Nothing: an unmarked directory may be the stock Trainer's (never removed)."""
        return []

    def entries(self) -> list[Entry]:
        """The ``checkpoint-N`` directories, oldest (lowest N) first; not verified."""
        return [Entry(name=name, path=self.storage.join(self.directory, name),
                      key=(float(step),), step=step)
                for step, name in reversed(_checkpoints(self.storage, self.directory))]

    def manifest(self, entry: Entry) -> CheckpointMarker | None:
        """The marker of ``entry`` as recorded (None when it has none or an invalid one)."""
        try:
            return read_marker(entry.path)
        except SnapshotCorruptError:
            return None

    def verify(self, entry: Entry) -> CheckpointMarker:
        """:func:`verify_checkpoint` of ``entry`` (``SnapshotCorruptError`` when it fails)."""
        return verify_checkpoint(entry.path)

    def delete(self, entry: Entry, *, by: str = "snapkeep") -> bool:
        """Delete one checkpoint: its marker first (uncommitted), then the directory; False,
        logged, on failure."""
        try:
            try:
                self.storage.remove(self.storage.join(entry.path, MARKER_NAME))
            except FileNotFoundError:
                pass
            self.storage.remove_tree(entry.path)
        except OSError as e:
            logger.warning("snapkeep: %s could not delete %s: %s", by, entry.path, e)
            return False
        logger.info("snapkeep: %s deleted %s", by, entry.path)
        return True

    def retain(self, policy: RetentionPolicy, lineage: frozenset[str | None] | set[str | None],
               *, protect: Sequence[str | None] = ()) -> list[Entry]:
        """Delete the committed checkpoints of ``lineage`` that ``policy`` does not keep (by
        the markers' metrics), never the newest committed one (of any lineage), one named in
        ``protect`` (names or paths), one without a valid marker or of another lineage.
        Markers are read, not verified. A failed delete is logged.

        Returns:
            The entries deleted.
        """
        ours: list[SnapshotInfo] = []
        by_name: dict[str, Entry] = {}
        newest: str | None = None
        for entry in self.entries():
            marker = self.manifest(entry)
            if marker is None:
                continue
            newest = entry.name
            if marker.run_id in lineage:
                by_name[entry.name] = entry
                ours.append(SnapshotInfo(name=entry.name, key=entry.key, step=entry.step,
                                         metrics=dict(marker.metrics)))
        kept = [newest] + [os.path.basename(os.path.normpath(p)) for p in protect if p]
        return [by_name[name] for name in plan_deletions(policy, ours,
                                                         protect=[k for k in kept if k])
                if self.delete(by_name[name], by="retention")]


def _session(output_dir: str | os.PathLike[str], *, policy: RetentionPolicy | None = None,
             quiet: bool = False) -> Session:
    storage, path = _storage(output_dir)
    return Session(CheckpointDirs(storage, path), policy=policy, quiet=quiet,
                   shown_template=TEMPLATE)


def latest_verified(output_dir: str | os.PathLike[str], *, quiet: bool = False) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` (highest N, never mtime) whose marker
    verifies; pass it as ``trainer.train(resume_from_checkpoint=...)``.

    The engine session's resume choice (as every door's): the newest one that verifies, said
    on stderr (rank 0: ``snapkeep: resuming from checkpoint-N (step N) in DIR``), each one
    skipped named with why (no marker: a save killed midway; a truncated or changed file), or
    that the run starts fresh. Skipped directories are left as they are (not deleted or
    moved; see the module docstring).

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
    entry = session.choose(store.verify)
    return None if entry is None else str(entry.path)


# -- the callback --------------------------------------------------------------------------------
class SnapkeepCallback(TrainerCallback):  # type: ignore[misc]
    """Commits every ``checkpoint-N`` the Trainer saves, and rotates them safely, through the
    engine session (:class:`snapkeep.store.Session`, as every door: lock, lineage, the
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

    Raises:
        TypeError: ``save_best`` is not a bool, or ``keep`` not an int or a policy.
        ValueError: ``keep`` < 1.
    """

    def __init__(self, *, output_dir: str | os.PathLike[str] | None = None,
                 save_best: bool = True, keep: int | RetentionPolicy | None = None) -> None:
        if not isinstance(save_best, bool):
            raise TypeError(f"save_best must be True or False, got {save_best!r}")
        if keep is not None and (isinstance(keep, bool) or not (
                isinstance(keep, int) or callable(getattr(keep, "select", None)))):
            raise TypeError(f"keep must be an int >= 1, a policy from snapkeep.retention, or "
                            f"None, got {keep!r}")
        if isinstance(keep, int) and keep < 1:
            raise ValueError(f"keep must be >= 1 (None: save_total_limit's), got {keep}")
        self.save_best = save_best
        self.keep: RetentionPolicy | None = KeepLatest(keep) if isinstance(keep, int) else keep
        self._output_dir = None if output_dir is None else os.fspath(output_dir)
        self.save_total_limit: int | None = None
        self.session: Session | None = None
        self.status: StatusLog | None = None

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
        """Release the output directory's lock (idempotent)."""
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
        if state.global_step > 0:  # resumed: inherit the lineage of the checkpoint resumed
            store: Any = session.store
            marker = store.manifest(Entry(
                name=f"checkpoint-{state.global_step}", step=state.global_step,
                path=store.storage.join(store.directory, f"checkpoint-{state.global_step}"),
                key=(float(state.global_step),)))
            session.lineage.continue_run(marker.run_id if marker is not None else None)
        storage, path = _storage(directory)
        self.status = StatusLog(storage, path, rank=args.process_index,
                                world_size=args.world_size)
        self.status.record("running", state.global_step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self.status is not None:
            self.status.record("finished", state.global_step)
        self.close()

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
        metrics = self.check_retention(state)
        commit_checkpoint(checkpoint, step=state.global_step, run_id=self.run_id,
                          metrics=metrics)
        self.retain(state)

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
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import concurrent.futures

        from snapkeep.staging import BufferSet

        super().__init__(*args, **kwargs)
        trainer: Any = self
        given = [c for c in trainer.callback_handler.callbacks
                 if isinstance(c, SnapkeepCallback)]
        while any(isinstance(c, SnapkeepCallback) for c in trainer.callback_handler.callbacks):
            trainer.callback_handler.remove_callback(SnapkeepCallback)
        # the session (lock, lineage, retention, status) as the callback's, with its settings
        self._snapkeep_callback = _OwnedCallback.like(given[0] if given else None)
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
        metrics = self._snapkeep_callback.check_retention(trainer.state)  # before staging
        job = self._snapkeep_stage(trainer)
        self._snapkeep_pending = self._snapkeep_pool.submit(self._snapkeep_write, *job, metrics)

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
        try:
            try:
                result = super().train(*args, **kwargs)  # type: ignore[misc]
            except BaseException as e:
                try:
                    self.wait_for_checkpoint()
                except Exception as save_error:  # the training error wins; the save's logged
                    logger.error("snapkeep: a background checkpoint save also failed: %s",
                                 save_error)
                if callback.status is not None and not isinstance(e, KeyboardInterrupt):
                    callback.status.record("failed", trainer.state.global_step,
                                           reason=f"{type(e).__name__}: {e}"
                                           .splitlines()[0][:500])
                raise
            try:
                self.wait_for_checkpoint()
            except Exception as e:
                if callback.status is not None:
                    callback.status.record("failed", trainer.state.global_step,
                                           reason=f"{type(e).__name__}: {e}"
                                           .splitlines()[0][:500])
                raise
            if callback.status is not None:
                callback.status.record("finished", trainer.state.global_step)
            return result
        finally:
            callback.close()


class _OwnedCallback(SnapkeepCallback):
    """The mixin's half of :class:`SnapkeepCallback`: the session (lock, lineage, retention,
    status) from ``on_train_begin``; the mixin commits and rotates from its writer thread, and
    records the end of the run once the last commit is done."""

    @classmethod
    def like(cls, given: SnapkeepCallback | None) -> _OwnedCallback:
        """One with the settings of the callback the user gave (or the defaults)."""
        if given is None:
            return cls()
        return cls(output_dir=given.output_dir, save_best=given.save_best, keep=given.keep)

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        return None  # the mixin's train(): after the last commit

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        return None

    def on_save(self, *args: Any, **kwargs: Any) -> None:
        return None


class SnapkeepTrainer(SnapkeepSaveMixin, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` with :class:`SnapkeepSaveMixin`'s asynchronous, committed
    save (the same arguments as ``Trainer``)."""
