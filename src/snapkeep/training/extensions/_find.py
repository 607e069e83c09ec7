"""ppe's module-level helpers of ``ppe.training.extensions._snapshot``, ordered by the step parsed
from the name (never by mtime), on top of :class:`snapkeep.store.SnapshotStore`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from snapkeep.store import SnapshotStore, open_store, ppe_template
from snapkeep.writing import PpeFileSystem


def _store_for(fmt: str, path: str, fs: Any) -> SnapshotStore:
    fs, options = PpeFileSystem.unwrap(fs)  # a snapkeep writer's `fs`, as ppe's tests pass it
    return open_store(path, ppe_template(fmt), fs=fs, storage_options=options or None)


def find_snapshot_files(
    fmt: str, path: str, fs: Any = None,
) -> list[tuple[tuple[float, ...], str]]:
    """Snapshot files of template ``fmt`` directly under ``path``, as ppe's helper of that name.

    Names are matched against the whole template (not only its prefix and suffix); temporary
    files, manifests and other files are never listed. Unlike ppe, the first element of each
    pair is the sort key parsed from the name (iteration, then epoch, then other fields), not
    the mtime, and the list is ordered by it (oldest first).

    Args:
        fmt: a filename template such as ``'snapshot_iter_{.iteration}'``.
        path: directory (local path or fsspec URL).
        fs: filesystem as accepted by the writers' ``fs`` (None: picked from ``path``).
    """
    return [(entry.key, entry.name) for entry in _store_for(fmt, path, fs).entries()]


def find_latest_snapshot(fmt: str, path: str, fs: Any = None) -> str | None:
    """Name of the snapshot with the highest step in ``path`` (None when there is none), as
    ppe's helper of that name but by step instead of mtime. The file is not verified here;
    ``autoload`` verifies and falls back to older snapshots."""
    files = find_snapshot_files(fmt, path, fs)
    return files[-1][1] if files else None


def find_stale_snapshots(
    fmt: str, path: str, n_retains: int, fs: Any = None
) -> Iterator[str]:
    """Names of the snapshots beyond the newest ``n_retains`` by step, oldest first (as ppe's
    helper of that name, which used mtime). Yields nothing when ``n_retains`` <= 0."""
    files = find_snapshot_files(fmt, path, fs)
    if n_retains <= 0:
        return
    for _, name in files[: max(len(files) - n_retains, 0)]:
        yield name
