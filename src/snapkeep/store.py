"""The snapshot store (public names for the doors): the files of one filename template in one
directory, their manifests, and the one verified reader.

``SnapshotStore(storage, directory, template)`` lists snapshots by step, verifies them against
their manifests, loads the newest valid one, deletes, applies retention, sweeps stale temps and
orphan manifests, and takes the directory lock (one owner per directory); see
:mod:`snapkeep._core.store.files`. :func:`open_store` builds one from a directory or URL as the
writers do. The ``checkpoint-N`` directories of the Hugging Face door are the store kind of
:mod:`snapkeep._core.store.marked_dirs` (commit markers). The run around a store (the session,
run control, cadence) is :mod:`snapkeep.session`; the memory tier and incremental snapshots are
:mod:`snapkeep.tiers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from snapkeep._core.format.json_records import RecordError, parse_json
from snapkeep._core.format.manifest import (
    MANIFEST_DIR,
    Manifest,
    ManifestError,
    manifest_path,
    read_manifest,
)
from snapkeep._core.format.naming import FilenameTemplate, ppe_name, ppe_template, step_template
from snapkeep._core.load.loading import load_file, unloadable_value
from snapkeep._core.load.preflight import check_timeout_s, check_writable
from snapkeep._core.load.structure import describe, find_mismatches
from snapkeep._core.storage import Storage, resolve_storage
from snapkeep._core.store.contract import StoreKind, newest_valid, skip_message
from snapkeep._core.store.files import DECODE_ERRORS, ON_ERROR_SUFFIX, Entry, SnapshotStore
from snapkeep._core.store.lock import StoreLock
from snapkeep._core.store.lookalikes import lookalike_message
from snapkeep._core.store.marked_dirs import (
    CHECKPOINT_PATTERN,
    MARKER_FORMAT,
    MARKER_NAME,
    TEMPLATE,
    CheckpointDirs,
    CheckpointMarker,
    FileRecord,
    checkpoint_step,
    commit_checkpoint,
    is_marker,
    marker_of_file,
    read_marker,
    verify_checkpoint,
    verify_marked_file,
)
from snapkeep._core.store.name_check import misnamed_reason


def open_store(
    directory: str, template: str | FilenameTemplate, *, fs: Any = None,
    storage_options: Mapping[str, Any] | None = None,
) -> SnapshotStore:
    """The store of ``template`` in ``directory`` (a local path or an fsspec URL), with the
    storage picked as the writers pick it (``fs``, ``storage_options`` as theirs)."""
    storage, path = resolve_storage(directory, fs, dict(storage_options or {}))
    return SnapshotStore(storage, path, template)


__all__ = [
    "CHECKPOINT_PATTERN", "DECODE_ERRORS", "MANIFEST_DIR", "MARKER_FORMAT", "MARKER_NAME",
    "ON_ERROR_SUFFIX", "TEMPLATE", "CheckpointDirs", "CheckpointMarker", "Entry", "FileRecord",
    "FilenameTemplate", "Manifest", "ManifestError", "RecordError", "SnapshotStore", "Storage",
    "StoreKind", "StoreLock", "check_timeout_s", "check_writable", "checkpoint_step",
    "commit_checkpoint", "describe", "find_mismatches", "is_marker", "load_file",
    "lookalike_message", "manifest_path", "marker_of_file", "misnamed_reason", "newest_valid",
    "open_store", "parse_json", "ppe_name", "ppe_template", "read_manifest", "read_marker",
    "resolve_storage", "skip_message", "step_template", "unloadable_value", "verify_checkpoint",
    "verify_marked_file",
]
