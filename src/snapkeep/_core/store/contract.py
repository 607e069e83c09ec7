"""The store contract: what every kind of snapshot store provides, and one kind per template.

A *kind* is how one snapshot is laid out on storage:
:class:`~snapkeep._core.store.files.SnapshotStore`
(one file per snapshot, plus a checksum manifest) and
:class:`~snapkeep._core.distributed.sharded_store.ShardedStore` (one directory per snapshot: DCP
shards plus a marker). A later kind (node memory with peer copies) implements the same
:class:`StoreKind`; callers never branch on the kind for a guarantee.

Call order (per trainer, one store per template in the directory it owns), after DCP's
``StorageWriter`` docs:

0. ``hold_listing()`` -- at start, on the one rank that writes: the start-up (kind check, sweep,
   autoload's candidates) lists out_dir once, and the store keeps what it knows
   (:class:`~snapkeep._core.store.files.HeldListing`), updated by its own commits and deletes,
   instead of listing again between snapshots. Other ranks and readers list afresh.
1. ``check_kind()`` -- at start, before anything runs (every kind): a template that already names
   snapshots of another kind in the directory is refused (:func:`require_one_kind`).
2. ``lock()`` -- at start, on the one rank that writes commit records (the saver rank, or rank 0
   of a sharded save); released at ``finalize``. Raises ``StoreLockedError`` for a second trainer
   of the directory, whatever its template (one trainer per directory; see ``_core/store/lock.py``).
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

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from snapkeep._core.errors import (
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotStorageError,
    UnsafeSnapshotError,
)
from snapkeep._core.format.naming import FilenameTemplate
from snapkeep._core.storage import Storage
from snapkeep._core.store.retention import RetentionPolicy
from snapkeep._core.user_warnings import warn_user

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

    def hold_listing(self) -> None:
        """Keep the listing of out_dir (the writing rank's store; see the call order)."""

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


class Candidate(Protocol):
    """What :func:`newest_valid` needs of a candidate: its name and step (an ``Entry`` of either
    kind, or :class:`Listed`)."""

    @property
    def name(self) -> str: ...

    @property
    def step(self) -> int | None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Listed:
    """A candidate known only by name and key (the union of every rank's listing; a step of the
    memory tier).

    Attributes:
        name: the snapshot's name (relative to the output directory).
        key: its sort key, parsed from the name (step first).
        step: the first number of ``key`` (None when the key is empty).
    """

    name: str
    key: tuple[float, ...] = ()
    step: int | None = None

    @classmethod
    def of(cls, key: Sequence[float], name: str) -> Listed:
        """The candidate ``name`` with sort key ``key`` (its step: ``key[0]``)."""
        key = tuple(key)
        return cls(name=name, key=key, step=int(key[0]) if key else None)


class CandidateRefused(SnapshotCorruptError):
    """Raised by a collective ``check`` of :func:`newest_valid`: one or more ranks cannot use the
    candidate (missing there, corrupt, unreadable); every rank skips it together.

    Attributes:
        reasons: ``{rank: reason}`` of the ranks that refused it.
    """

    def __init__(self, reasons: Mapping[int, str]) -> None:
        self.reasons = dict(sorted(reasons.items()))
        super().__init__(f"not readable on rank(s) {sorted(self.reasons)}: "
                         + "; ".join(f"rank {r}: {m}" for r, m in self.reasons.items()))


def skip_message(candidate: Candidate, error: Exception, *, kind: str = "snapshot") -> str:
    """The one text of a fallback: ``skipping snapshot NAME (step N): REASON``."""
    return f"skipping {kind} {candidate.name} (step {candidate.step}): {error}"


def nothing_valid_message(what: str, refused: Sequence[tuple[Candidate, Exception]]) -> str:
    """The one text of "snapshots exist, none valid": each refused candidate with its reason,
    per rank where ranks voted (:class:`CandidateRefused`), newest first."""
    by_rank = [(c, e) for c, e in refused if isinstance(e, CandidateRefused)]
    if refused and len(by_rank) == len(refused):
        described = ", ".join(
            f"{c.name} (" + "; ".join(f"rank {r}: {m}" for r, m in list(e.reasons.items())[:8])
            + ")" for c, e in by_rank[:10])
        return (f"{what}: {len(refused)} snapshot(s) found, none readable and verified on "
                "every rank; refusing to resume ranks from different steps or to start over "
                f"silently. {described}. Restore the missing or corrupt parts, or move the "
                "snapshots away to start fresh.")
    reasons = "; ".join(str(e) for _, e in refused[:10])
    return (f"{len(refused)} snapshot file(s) of {what}, none valid; refusing to start over "
            f"silently. Reasons: {reasons}. Move them away to start fresh, or restore a good "
            "copy.")


C = TypeVar("C", bound=Candidate)
R = TypeVar("R")


def newest_valid(
    candidates: Sequence[C], check: Callable[[C], R], *, what: str,
    skipped: Callable[[C, SnapshotCorruptError], None] | None = None,
    required: bool = True, error: type[NoValidSnapshotError] = NoValidSnapshotError,
) -> tuple[C, R] | None:
    """THE newest-valid-with-fallback of every kind and reader (autoload single-process,
    DISTRIBUTED and SHARDED, ``load_latest``, ``verify``/``ls``'s "autoload would resume from",
    the ppe file view): the ordering, the skip, the fallback warning and the "nothing valid"
    error live here; what differs is ``check``.

    Candidates are tried newest (last) first; ``check(candidate)`` returns the loaded result or
    raises. A :class:`SnapshotCorruptError` (failed verification, junk, misnamed; a collective
    check raises :class:`CandidateRefused` on every rank alike) skips to the next older one; an
    :class:`UnsafeSnapshotError` or a :class:`SnapshotStorageError` stops at once (never a
    fallback past a refusal or an outage). The collective variant is
    :func:`~snapkeep._core.distributed.agreement.agree_on_resume`, whose ``check`` is every
    rank's vote on one candidate.

    Args:
        candidates: oldest first (as ``entries()`` lists them); anything with ``name`` and
            ``step`` (:class:`Candidate`).
        check: validates and loads one candidate (the kind's ``validate``), or votes on it.
        what: the template and directory, for the error.
        skipped: called for each candidate skipped, instead of a ``RuntimeWarning`` with
            :func:`skip_message` (e.g. autoload's resume notice collects them).
        required: raise when candidates exist but none is valid (False: return None, as the
            memory tier does before it falls back to storage).
        error: the error class raised then (:class:`NoValidSnapshotError` or a subclass).

    Returns:
        ``(candidate, check's result)``, or None when ``candidates`` is empty (or none is valid
        and not ``required``).

    Raises:
        NoValidSnapshotError: (``error``) candidates exist but none is valid, each reason
            listed (:func:`nothing_valid_message`).
        UnsafeSnapshotError, SnapshotStorageError: as raised by ``check``.
    """
    if not candidates:
        return None
    refused: list[tuple[C, SnapshotCorruptError]] = []
    for candidate in reversed(candidates):
        try:
            return candidate, check(candidate)
        except (UnsafeSnapshotError, SnapshotStorageError):
            raise
        except SnapshotCorruptError as e:
            refused.append((candidate, e))
            if skipped is not None:
                skipped(candidate, e)
            else:
                warn_user(skip_message(candidate, e), RuntimeWarning)
    if not required:
        return None
    raise error(nothing_valid_message(what, refused))


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


__all__ = [
    "IN_PROGRESS_NAME", "MARKER_NAME", "Candidate", "CandidateRefused", "Listed", "StoreKind",
    "newest_valid", "nothing_valid_message", "require_one_kind", "skip_message",
]
