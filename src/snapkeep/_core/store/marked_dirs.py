"""Marked directories: a snapshot kind whose directories another program writes in place (the
Hugging Face Trainer's ``checkpoint-N``: weights, ``optimizer.pt``, ``trainer_state.json``, ...),
each committed afterwards by a marker, :data:`MARKER_NAME`, written last and atomically once
every file of the directory is durable: each file's size and xxh3-128 checksum (the checksums of
snapkeep's manifests). :class:`CheckpointDirs` holds them as a store of the engine
(:class:`~snapkeep._core.store.contract.StoreKind`): listed by the number in their name, locked,
verified, retained by their markers' metrics and run ids; the door (:mod:`snapkeep.hf`) and the
CLI (``snapkeep verify``/``ls``) use the same code, without importing the program that wrote
them.

A directory without a valid marker (or with the marker of another step: a copy) is never
counted, deleted, moved or quarantined. snapkeep's saves claim each directory before the
Trainer writes it (``.snapkeep/claims/``), so a crashed save of snapkeep's is told from a
complete checkpoint the stock Trainer wrote before snapkeep was added
(:meth:`CheckpointDirs.adoptable`: resumed unverified).
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

from snapkeep._core.errors import SnapshotCorruptError, SnapshotStorageError
from snapkeep._core.format.checksum import ALGORITHM, digest_open_file, digest_stream, require_match
from snapkeep._core.format.json_records import INT64_LIMIT, RecordError, parse_json
from snapkeep._core.format.manifest import (
    CHECKSUM_HEX_CHARS,
    MANIFEST_DIR,
    MAX_MANIFEST_BYTES,
    finite_metrics,
    now_unix_s,
)
from snapkeep._core.format.naming import FilenameTemplate
from snapkeep._core.storage import Storage, resolve_storage
from snapkeep._core.store.files import Entry
from snapkeep._core.store.lock import StoreLock
from snapkeep._core.store.retention import RetentionPolicy, SnapshotInfo, plan_deletions
from snapkeep._version import __version__

__all__ = [
    "CHECKPOINT_PATTERN", "MARKER_FORMAT", "MARKER_NAME", "MAX_FILES", "TEMPLATE",
    "marker_of_file", "verify_marked_file",
    "CheckpointDirs", "CheckpointMarker", "FileRecord", "checkpoint_step", "commit_checkpoint",
    "is_marker", "read_marker", "verify_checkpoint",
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
            body = parse_json(data, max_bytes=MAX_MANIFEST_BYTES, allow_nan=True)
        except RecordError as e:
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
    return isinstance(value, int) and not isinstance(value, bool) and value < INT64_LIMIT


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
    misnamed = _misnamed(storage.basename(path.rstrip("/")), marker)
    if misnamed:
        raise SnapshotCorruptError(f"{path}: {misnamed}")
    for relative in marker.files:
        verify_marked_file(storage, path, relative, marker)
    return marker


def verify_marked_file(storage: Storage, directory: str, relative: str,
                       marker: CheckpointMarker) -> str:
    """Check the file ``relative`` of the marked ``directory`` against ``marker``'s record of
    it (present, a regular file, its size and checksum); returns its checksum.

    Raises:
        KeyError: the marker does not list ``relative``.
        SnapshotCorruptError: missing, not a regular file, truncated or changed (named).
        SnapshotStorageError: the storage could not be reached.
    """
    record = marker.files[relative]
    file_path = _path_in(storage, directory, relative)
    try:
        with storage.open_read(file_path) as f:  # a local file: hashed in place, mapped
            checksum, size = digest_open_file(f) if storage.is_local else digest_stream(f)
    except FileNotFoundError:
        raise SnapshotCorruptError(f"{file_path}: listed by the marker, missing") from None
    except SnapshotStorageError:
        raise
    except OSError as e:
        raise SnapshotCorruptError(f"{file_path}: {e}") from e
    require_match(file_path, checksum, size, recorded_checksum=record.checksum,
                  recorded_size=record.size_bytes, algorithm=marker.algorithm, record="marker")
    return checksum


def marker_of_file(storage: Storage, file_path: str, *, levels: int = 4
                   ) -> tuple[str, str, CheckpointMarker] | None:
    """The marked directory holding ``file_path`` (its own directory or one up to ``levels``
    above, the nearest with a :data:`MARKER_NAME` of this kind): ``(directory, the file's path
    relative to it, its marker)``; None when there is none (a sharded snapshot's marker is not
    one of these).

    Raises:
        SnapshotCorruptError: the nearest marker is invalid, too large or not a regular file.
        SnapshotStorageError: the storage could not be reached.
    """
    directory, relative = storage.dirname(file_path), storage.basename(file_path)
    for _ in range(levels):
        marker_path = storage.join(directory, MARKER_NAME)
        try:
            data = storage.read_bytes(marker_path, max_bytes=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            data = None
        except SnapshotStorageError:
            raise
        except OSError as e:
            raise SnapshotCorruptError(f"{marker_path}: {e}") from e
        if data is not None:
            if not is_marker(data):
                return None
            return directory, relative, CheckpointMarker.from_bytes(data, source=marker_path)
        parent = storage.dirname(directory)
        if not parent or parent == directory:
            return None
        relative = f"{storage.basename(directory)}/{relative}"
        directory = parent
    return None


def _misnamed(name: str, marker: CheckpointMarker) -> str:
    """Why ``marker`` does not describe the directory ``name`` (``checkpoint-N`` whose marker
    records another step: a copy, ``cp -r checkpoint-4 checkpoint-40``), or ''."""
    step = checkpoint_step(name)
    if step is None or step == marker.step:
        return ""
    return (f"its marker records step {marker.step}, its name says {step} (a copy of "
            f"checkpoint-{marker.step}?); never resumed or counted as step {step}")


def _checkpoints(storage: Storage, output_dir: str) -> list[tuple[int, str]]:
    """``(N, name)`` of the ``checkpoint-N`` directories in ``output_dir``, highest N first."""
    found = [(step, name) for name in storage.list_dirs(output_dir)
             if (step := checkpoint_step(name)) is not None]
    return sorted(found, reverse=True)


#: The store's template: ``checkpoint-N`` (the lock's key, the notices' name).
TEMPLATE = "checkpoint-{step}"
_TEMPLATE = FilenameTemplate(TEMPLATE)


#: Where snapkeep's saves record the ``checkpoint-N`` they are about to write (under
#: ``.snapkeep/`` of the output directory), until its marker is written.
_CLAIMS = "claims"
#: The Trainer's state file, written last into each checkpoint.
_TRAINER_STATE = "trainer_state.json"
#: A ``trainer_state.json`` larger than this is not read (its log history grows per step).
_MAX_TRAINER_STATE_BYTES = 256 << 20


#: Files a Trainer checkpoint directory holds (a save interrupted before its marker included).
_TRAINER_FILE = re.compile(
    r"^(model|pytorch_model|adapter_model|config|generation_config|optimizer|scheduler|scaler"
    r"|rng_state|trainer_state|training_args|tokenizer|special_tokens_map|vocab|merges)"
    r"([._-]|$)")


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
        return StoreLock.acquire(self.storage.join(self.directory, MANIFEST_DIR),
                                 self.storage.url(self.directory), what=TEMPLATE)

    def sweep(self, lineage: frozenset[str | None] | None = None) -> list[str]:
        """Nothing: an unmarked directory may be the stock Trainer's (never removed)."""
        return []

    def claim(self, path: str, step: int) -> None:
        """Before a save writes ``checkpoint-<step>`` at ``path``: refuse a directory there that
        is neither committed (marker) nor a Trainer checkpoint (written or interrupted: a file
        a Trainer checkpoint holds), such as a user's directory named like one, which the
        Trainer would write into and retention later delete whole. An accepted one is recorded
        as claimed (``.snapkeep/claims/``) until its marker is written (:meth:`release`), so an
        interrupted save is never taken for a checkpoint written before snapkeep
        (:meth:`adoptable`).

        Raises:
            SnapshotStorageError: ``path`` is held by something else (named); nothing written.
        """
        storage = self.storage
        if not storage.exists(path):
            self._record_claim(os.path.basename(path.rstrip("/")))
            return
        names = storage.list_names(path) if storage.isdir(path) else None
        name = os.path.basename(path.rstrip("/"))
        if names is not None and (not names or any(
                n == MARKER_NAME or _TRAINER_FILE.match(n) for n in names)):
            self._record_claim(name)
            return
        raise SnapshotStorageError(
            f"{storage.url(path)} exists and is not a Trainer checkpoint ({name} (step {step}) "
            f"would be written into it, and retention would later delete it with its contents; "
            f"it holds {sorted(names or [])[:5] if names is not None else 'a file'}): nothing "
            "was written. Move it away, or use another output_dir")

    def _claim_path(self, name: str) -> str:
        return self.storage.join(self.directory, MANIFEST_DIR, _CLAIMS, name)

    def _record_claim(self, name: str) -> None:
        """Record that snapkeep's save is about to write ``name``: until its marker is written,
        the directory is an interrupted save of snapkeep's, never adopted as a checkpoint the
        stock Trainer wrote before snapkeep (see :meth:`adoptable`)."""
        path = self._claim_path(name)
        self.storage.makedirs(self.storage.dirname(path))
        self.storage.write_bytes(path, b"{}", tag="claim")

    def release(self, name: str) -> None:
        """Forget the claim on ``name`` (its marker is written, or it is deleted)."""
        try:
            self.storage.remove(self._claim_path(name))
        except FileNotFoundError:
            pass

    def adoptable(self, entry: Entry) -> str:
        """Why ``entry`` (a ``checkpoint-N`` without a valid marker) is not a complete
        checkpoint the stock Trainer wrote before snapkeep was added, or '' when it is one: no
        marker file at all, never claimed by snapkeep's save (so no save of snapkeep's was
        interrupted there), and a complete ``trainer_state.json`` (the Trainer writes it last)
        recording ``global_step`` N. Such a directory is resumed unverified (it has no
        checksums), said on stderr; it is never counted or deleted by retention."""
        storage = self.storage
        if storage.exists(storage.join(entry.path, MARKER_NAME)):
            return "its marker is not valid"
        if storage.exists(self._claim_path(entry.name)):
            return "a save of snapkeep's was interrupted there"
        state_path = storage.join(entry.path, _TRAINER_STATE)
        try:
            body = json.loads(storage.read_bytes(state_path, max_bytes=_MAX_TRAINER_STATE_BYTES)
                              .decode("utf-8"))
        except FileNotFoundError:
            return f"no {_TRAINER_STATE} (a save that did not finish)"
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            return f"{_TRAINER_STATE} is not complete JSON ({type(e).__name__})"
        step = body.get("global_step") if isinstance(body, dict) else None
        if step != entry.step or not _is_int(step):
            return f"{_TRAINER_STATE} records global_step {str(step)[:40]}, not {entry.step}"
        return ""

    def entries(self) -> list[Entry]:
        """The ``checkpoint-N`` directories, oldest (lowest N) first; not verified."""
        return [Entry(name=name, path=self.storage.join(self.directory, name),
                      key=(float(step),), step=step)
                for step, name in reversed(_checkpoints(self.storage, self.directory))]

    def manifest(self, entry: Entry) -> CheckpointMarker | None:
        """The marker of ``entry`` as recorded (None when it has none, an invalid one, or one
        recording another step than the name: a copied directory is never counted)."""
        try:
            marker = read_marker(entry.path)
        except SnapshotCorruptError:
            return None
        if marker is not None and _misnamed(entry.name, marker):
            logger.warning("snapkeep: %s: %s", entry.path, _misnamed(entry.name, marker))
            return None
        return marker

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
            self.release(entry.name)
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


def is_marker(data: bytes) -> bool:
    """Whether ``data`` (a marker file's bytes) claims to be a marked directory's marker (its
    ``format``); not validated further (the CLI tells the two kinds of marker apart by it)."""
    try:
        body = parse_json(data, max_bytes=MAX_MANIFEST_BYTES, allow_nan=True)
    except RecordError:
        return False
    return isinstance(body, dict) and body.get("format") == MARKER_FORMAT
