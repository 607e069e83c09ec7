"""The snapshot store: the files of one filename template in one directory (public names).

``SnapshotStore(storage, directory, template)`` lists snapshots by step, verifies them against
their manifests, loads the newest valid one, deletes, applies retention, sweeps stale temps and
orphan manifests, and takes the directory lock; see :mod:`snapkeep._core.store`.
:func:`open_store` builds one from a directory or URL as the writers do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from snapkeep._core.loading import load_file
from snapkeep._core.lock import StoreLock
from snapkeep._core.manifest import (
    MANIFEST_DIR,
    Manifest,
    ManifestError,
    manifest_path,
    read_manifest,
)
from snapkeep._core.name_check import misnamed_reason
from snapkeep._core.naming import FilenameTemplate
from snapkeep._core.one_pass import one_pass_loader
from snapkeep._core.preflight import check_writable
from snapkeep._core.storage import Storage, resolve_storage
from snapkeep._core.store import (
    DECODE_ERRORS,
    ON_ERROR_SUFFIX,
    Entry,
    Retain,
    SnapshotStore,
)
from snapkeep._core.structure import describe, find_mismatches
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
    "DECODE_ERRORS", "MANIFEST_DIR", "ON_ERROR_SUFFIX", "Entry", "FilenameTemplate", "Manifest",
    "ManifestError",
    "Retain", "SnapshotStore", "Storage", "StoreLock", "describe", "find_mismatches", "load_file",
    "manifest_path", "one_pass_loader", "open_store", "read_manifest", "resolve_storage",
    "check_writable", "misnamed_reason", "user_stacklevel", "warn_user",
]
