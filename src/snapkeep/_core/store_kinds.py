"""The store contract: what every kind of snapshot store provides, and one kind per template.

A *kind* is how one snapshot is laid out on storage: :class:`~snapkeep._core.store.SnapshotStore`
(one file per snapshot, plus a checksum manifest) and
:class:`~snapkeep._core.distributed.sharded_store.ShardedStore` (one directory per snapshot: DCP
shards plus a marker). A later kind (node memory with peer copies) implements the same
:class:`StoreKind`; callers never branch on the kind for a guarantee.

Call order (per trainer, one store per out_dir and template), after DCP's ``StorageWriter`` docs:

1. ``check_kind()`` -- at start, before anything runs (every kind): a template that already names
   snapshots of another kind in the directory is refused (:func:`require_one_kind`).
2. ``lock()`` -- at start, on the one rank that writes commit records (the saver rank, or rank 0
   of a sharded save); released at ``finalize``. Raises ``StoreLockedError`` for a second trainer.
3. ``sweep(lineage)`` -- at start, same rank, after ``lock``: removes only what snapkeep itself
   started and did not finish (temp files of crashed writers; sharded directories carrying the
   in-progress mark, which is written before the first shard). Never a file or directory merely
   because it lacks snapkeep's marker.
4. ``entries()`` / newest-valid-with-fallback -- at resume: the highest step parsed from the name,
   among snapshots that verify, never mtime; on-error snapshots (``<name>.on-error``) are never
   listed. Single files: ``load_newest``/``validate``; sharded directories: ``verify_part`` on
   every rank inside the agreed resume.
5. commit -- per snapshot: data first, then the manifest/marker as the one publishing step
   (through the storage layer). A snapshot without its manifest/marker is not committed.
6. ``retain(policy, lineage, protect=...)`` -- after each commit, on the committing rank only;
   never deletes the newest snapshot, a protected one or another run's; failures are logged.
7. ``delete(entry)`` -- returns False (logged) on failure; never raises for a failed delete.

Failure contract: verification failures are :class:`~snapkeep.errors.SnapshotCorruptError` (the
reader falls back to the next older snapshot); a well-formed snapshot needing objects outside the
weights-only allow-list is :class:`~snapkeep.errors.UnsafeSnapshotError` (no fallback); an
unreachable store is :class:`~snapkeep.errors.SnapshotStorageError` (no fallback, not corruption).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from snapkeep._core.errors import (
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotStorageError,
    UnsafeSnapshotError,
)
from snapkeep._core.naming import FilenameTemplate
from snapkeep._core.retention import RetentionPolicy
from snapkeep._core.storage import Storage

MARKER_NAME = ".snapkeep-commit.json"
"""File name of the marker inside a committed sharded snapshot directory."""
IN_PROGRESS_NAME = ".snapkeep-in-progress"
"""Written by rank 0 before any shard: this directory is snapkeep's own work (swept when no
marker follows)."""
_DCP_METADATA = ".metadata"


@runtime_checkable
class StoreKind(Protocol):
    """One kind of snapshot store (see the module docstring for the call order and which rank
    calls what). Attributes: ``storage``, ``directory``, ``template``."""

    storage: Storage
    directory: str
    template: FilenameTemplate

    def check_kind(self) -> None:
        """Refuse a template already naming snapshots of another kind here (ValueError)."""

    def lock(self) -> Any:
        """Take the one-trainer lock (None where the storage cannot lock)."""

    def sweep(self, lineage: frozenset[str | None] | None = None) -> list[str]:
        """Remove only snapkeep's own unfinished work; return the removed paths."""

    def entries(self) -> list[Any]:
        """Committed snapshots, oldest (lowest key) first."""

    def manifest(self, entry: Any) -> Any:
        """The manifest or marker of ``entry`` (None when missing or invalid)."""

    def delete(self, entry: Any, *, by: str = "snapkeep") -> bool:
        """Delete one snapshot (manifest/marker with it); False, logged, on failure."""

    def retain(self, policy: RetentionPolicy, lineage: frozenset[str | None] | set[str | None],
               *, protect: Sequence[str] = ()) -> list[Any]:
        """Apply a retention policy to this run's snapshots; return those deleted."""


E = TypeVar("E")
R = TypeVar("R")


def newest_valid(entries: Sequence[E], check: Callable[[E], R], *,
                 skipped: Callable[[E, SnapshotCorruptError], None] | None = None,
                 what: str) -> tuple[E, R] | None:
    """THE newest-valid-with-fallback of every kind and reader: try ``entries`` newest (last)
    first; ``check(entry)`` returns the loaded result or raises. A
    :class:`SnapshotCorruptError` (failed verification, junk, misnamed) skips to the next older
    one (``skipped`` is told, e.g. to warn); an :class:`UnsafeSnapshotError` or a
    :class:`SnapshotStorageError` stops at once (never a fallback past a refusal or an outage).
    The collective variant (every rank agreeing on one) is
    :func:`~snapkeep._core.distributed.agreement.agree_on_resume`, with the same per-entry check.

    Args:
        entries: oldest first (as ``entries()`` lists them).
        check: validates and loads one entry (the kind's ``validate``).
        skipped: called for each entry skipped as corrupt.
        what: the template and directory, for the error.

    Returns:
        ``(entry, check's result)``, or None when ``entries`` is empty.

    Raises:
        NoValidSnapshotError: entries exist but none is valid (each reason listed).
        UnsafeSnapshotError, SnapshotStorageError: as raised by ``check``.
    """
    if not entries:
        return None
    reasons = []
    for entry in reversed(entries):
        try:
            return entry, check(entry)
        except (UnsafeSnapshotError, SnapshotStorageError):
            raise
        except SnapshotCorruptError as e:
            if skipped is not None:
                skipped(entry, e)
            reasons.append(str(e))
    raise NoValidSnapshotError(
        f"{len(entries)} snapshot file(s) of {what}, none valid; refusing to start over "
        "silently. "
        f"Reasons: {'; '.join(reasons[:10])}. Move them away to start fresh, or restore a good "
        "copy.")


def require_one_kind(storage: Storage, parent: str, base: FilenameTemplate, *,
                     expected: str, listed: Sequence[str] | None = None) -> None:
    """Refuse to start when ``base`` (the template's last part) already names snapshots of the
    other kind in ``parent``: files when ``expected`` is ``'directory'`` (sharded), directories
    when it is ``'file'`` (a directory counts when it holds a marker, the in-progress mark or
    DCP's ``.metadata``). One listing of ``parent``, none when the caller gives what it
    listed: ``listed``, the file names (``expected='directory'``) or directory names
    (``expected='file'``) directly in ``parent``.

    Raises:
        ValueError: both kinds are present, naming one of each and how to fix it.
    """
    if expected not in ("file", "directory"):
        raise ValueError(f"expected must be 'file' or 'directory', got {expected!r}")
    if listed is None:
        listed = storage.list_names(parent) if expected == "directory" \
            else storage.list_dirs(parent)
    other = sorted((n for n in listed if base.parse(n) is not None),
                   key=lambda n: base.parse(n) or ())
    if expected == "file":  # a directory counts only when it is a sharded snapshot (or one begun)
        other = [n for n in other if any(
            storage.exists(storage.join(parent, n, f))
            for f in (MARKER_NAME, IN_PROGRESS_NAME, _DCP_METADATA))]
    if not other:
        return
    ours, theirs = ("sharded (DCP) snapshot directories", "single-file snapshots") \
        if expected == "directory" else ("single-file snapshots", "sharded snapshot directories")
    raise ValueError(
        f"the filename template {base.template!r} in {storage.url(parent)!r} already names "
        f"{len(other)} {theirs} (e.g. {other[-1]!r}); this trainer writes {ours}. One template "
        "holds one kind: use another filename template or out_dir, or move those away")


__all__ = ["IN_PROGRESS_NAME", "MARKER_NAME", "StoreKind", "newest_valid", "require_one_kind"]
