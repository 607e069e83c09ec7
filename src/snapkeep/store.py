"""The snapshot store: the files of one filename template in one directory (public names).

``SnapshotStore(storage, directory, template)`` lists snapshots by step, verifies them against
their manifests, loads the newest valid one, deletes, applies retention, sweeps stale temps and
orphan manifests, and takes the directory lock; see :mod:`snapkeep._core.store.files`.
:class:`MemoryStore` is the node-RAM kind of the memory tier (one rank's snapshots in a tmpfs).
:func:`open_store` builds one from a directory or URL as the writers do. :class:`Session` is
what every door (snapshot extensions, Checkpointer, Lightning, Hugging Face) does with a store:
open, resume, the retention stage, close (see :mod:`snapkeep._core.session.session`).
:class:`SaveEngine` is the one background lane under every save (see
:mod:`snapkeep._core.save.engine`).
:func:`run_status` reads how the last run in a directory ended (written by
``extensions.preemption``).
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
from snapkeep._core.format.naming import FilenameTemplate, step_template
from snapkeep._core.load.loading import load_file, unloadable_value
from snapkeep._core.load.preflight import check_timeout_s, check_writable
from snapkeep._core.load.resume_notice import (
    Skipped,
    announce,
    check_quiet,
    say,
)
from snapkeep._core.load.structure import describe, find_mismatches
from snapkeep._core.save.engine import SaveEngine
from snapkeep._core.save.ticket import SaveHandle
from snapkeep._core.session.cadence import (
    AutoInterval,
    Cadence,
    Choice,
    check_every,
    checkfreq_interval_s,
    choose,
    daly_interval_s,
    estimate_mtbf_s,
    young_interval_s,
)
from snapkeep._core.session.deadline import (
    Estimate,
    Grace,
    Plan,
    SaveTimes,
    check_grace_s,
    grace_from,
)
from snapkeep._core.session.goodput import Goodput, RunHistory, read_runs, summarize
from snapkeep._core.session.run_control import RunControl, preemption_signals
from snapkeep._core.session.run_status import RunStatus
from snapkeep._core.session.run_status import is_alive as run_is_alive
from snapkeep._core.session.run_status import read_status as read_run_status
from snapkeep._core.session.run_status import write_status as write_run_status
from snapkeep._core.session.session import Session
from snapkeep._core.storage import Storage, resolve_storage
from snapkeep._core.store.contract import (
    StoreKind,
    newest_valid,
    skip_message,
)
from snapkeep._core.store.files import (
    DECODE_ERRORS,
    ON_ERROR_SUFFIX,
    Entry,
    Retain,
    SnapshotStore,
)
from snapkeep._core.store.lineage import RunLineage, warn_about_existing
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
from snapkeep._core.store.retention_check import MetricCheck
from snapkeep._core.tiers.incremental import IncrementalTracker
from snapkeep._core.tiers.memory_store import (
    MemoryStore,
    NotPrivateError,
    check_space,
    describe_tiers,
    job_id,
    owners,
    reclaim_stale,
    tier_dir,
    write_owner,
)
from snapkeep._core.tiers.memory_tier import (
    MemoryTier,
    Restored,
    TierEngine,
    check_into_live,
    copy_into_live,
    flat_keys,
    local_shards,
    newest_listed_step,
    state_bytes,
)
from snapkeep._core.tiers.tiered_session import TieredSession, check_memory, tiered
from snapkeep._core.user_warnings import user_stacklevel, warn_user


def open_store(
    directory: str, template: str | FilenameTemplate, *, fs: Any = None,
    storage_options: Mapping[str, Any] | None = None,
) -> SnapshotStore:
    """The store of ``template`` in ``directory`` (a local path or an fsspec URL), with the
    storage picked as the writers pick it (``fs``, ``storage_options`` as theirs)."""
    storage, path = resolve_storage(directory, fs, dict(storage_options or {}))
    return SnapshotStore(storage, path, template)


__all__ = [
    "SaveEngine",
    "IncrementalTracker", "MemoryStore", "NotPrivateError", "check_space", "describe_tiers",
    "job_id", "owners", "reclaim_stale", "tier_dir", "write_owner", "DECODE_ERRORS",
    "MANIFEST_DIR", "ON_ERROR_SUFFIX", "Entry", "FilenameTemplate", "Manifest", "ManifestError",
    "Retain", "SnapshotStore", "Storage", "StoreLock", "describe", "find_mismatches",
    "load_file", "unloadable_value", "manifest_path", "open_store", "read_manifest",
    "resolve_storage", "check_writable", "check_timeout_s", "misnamed_reason",
    "user_stacklevel", "warn_user", "RunStatus", "write_run_status", "run_status",
    "lookalike_message", "SaveHandle", "StoreKind", "newest_valid", "run_is_alive", "Session",
    "RunLineage", "warn_about_existing", "MetricCheck", "Skipped", "announce", "check_quiet",
    "RunControl", "preemption_signals", "MemoryTier", "Restored",
    "TierEngine", "check_into_live", "copy_into_live", "flat_keys", "local_shards",
    "state_bytes", "say", "newest_listed_step", "CheckpointDirs", "CheckpointMarker",
    "is_marker", "CHECKPOINT_PATTERN", "MARKER_FORMAT", "MARKER_NAME", "TEMPLATE", "FileRecord",
    "checkpoint_step", "commit_checkpoint", "read_marker", "verify_checkpoint", "skip_message",
    "step_template", "marker_of_file", "verify_marked_file", "Estimate", "Grace", "Plan",
    "SaveTimes", "check_grace_s", "grace_from", "RecordError", "parse_json",
    "AutoInterval", "Cadence", "Choice", "check_every", "Goodput", "RunHistory", "run_goodput",
    "checkfreq_interval_s", "choose", "daly_interval_s", "young_interval_s", "estimate_mtbf_s",
    "TieredSession", "check_memory", "tiered",
]


def run_status(out_dir: str, *, fs: Any = None,
               storage_options: Mapping[str, Any] | None = None) -> RunStatus | None:
    """How the last run with ``extensions.preemption`` in ``out_dir`` ended (its
    ``.snapkeep/status.json``; see :mod:`snapkeep._core.session.run_status`), or None without one.

    Raises:
        ValueError: the status file is not valid.
        OSError, SnapshotStorageError: it could not be read.
    """
    storage, path = resolve_storage(out_dir, fs, dict(storage_options or {}))
    return read_run_status(storage, path)


def run_goodput(out_dir: str, *, fs: Any = None,
                storage_options: Mapping[str, Any] | None = None) -> Goodput | None:
    """The goodput of the runs recorded in ``out_dir`` (its ``.snapkeep/goodput.json``, written
    by a door with ``every="auto"``; see :mod:`snapkeep._core.session.goodput`), or None
    without a history.

    Raises:
        ValueError: the history is not valid.
        OSError, SnapshotStorageError: it could not be read.
    """
    storage, path = resolve_storage(out_dir, fs, dict(storage_options or {}))
    runs = read_runs(storage, path)
    return summarize(runs) if runs else None
