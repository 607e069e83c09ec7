"""Agreements between ranks, on snapkeep's own process group (see ``groups``).

Every step that involves several ranks follows one pattern: each rank does its local part and
catches its own failure, then all ranks exchange their outcomes in one bounded collective, so a
failure on any rank becomes the same error on every rank (naming the failing ranks) instead of a
hang in the next collective. A rank that died or hangs makes the exchange time out (the group's
``timeout_s``), which is raised as :class:`CollectiveTimeoutError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from snapkeep._core.distributed.errors import (
    CollectiveTimeoutError,
    NoCommonSnapshotError,
    RankFailedError,
)
from snapkeep._core.store.contract import CandidateRefused, Listed, newest_valid


def all_gather(group: dist.ProcessGroup | None, value: Any, *, what: str,
               timeout_s: float | None = None) -> list[Any]:
    """``value`` of every rank (a list indexed by rank), gathered on ``group``.

    Args:
        group: the process group (None: single process, returns ``[value]``).
        value: a small picklable object.
        what: the step, for the error message.
        timeout_s: the group's timeout, for the error message.

    Raises:
        CollectiveTimeoutError: a rank did not take part within the group's timeout (it died,
            hangs, or raised outside snapkeep before reaching this step).
    """
    if group is None:
        return [value]
    size = dist.get_world_size(group)
    out: list[Any] = [None] * size
    try:
        dist.all_gather_object(out, value, group=group)
    except RuntimeError as e:  # gloo: DistBackendError / "Timed out" / connection closed
        bound = f" for more than {timeout_s:g} s" if timeout_s is not None else ""
        raise CollectiveTimeoutError(
            f"{what}: rank {dist.get_rank()} lost the other ranks (one died, hung{bound} or "
            f"failed outside snapkeep): {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}") from e
    return out


def broadcast_object(group: dist.ProcessGroup | None, value: Any, *, src: int) -> Any:
    """Rank ``src``'s ``value`` on every rank of ``group`` (a picklable object: bytes of a
    snapshot included); ``value`` as is without a group."""
    if group is None:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def exchange_outcomes(group: dist.ProcessGroup | None, error: BaseException | str | None, *,
                      what: str, timeout_s: float | None = None) -> list[Any]:
    """Tell every rank whether this rank's part of ``what`` succeeded; raise on every rank if
    any failed.

    Args:
        group: snapkeep's process group (None: single process).
        error: this rank's failure (an exception or a message), or None.
        what: the step, named in the error.

    Raises:
        RankFailedError: ``what`` failed on some rank (raised on every rank, naming them all;
            on a failing rank chained to its own exception).
        CollectiveTimeoutError: see :func:`all_gather`.
    """
    mine = None if error is None else (
        error if isinstance(error, str) else f"{type(error).__name__}: {error}")
    outcomes = all_gather(group, mine, what=what, timeout_s=timeout_s)
    failed = {r: m for r, m in enumerate(outcomes) if m is not None}
    if failed:
        exc = RankFailedError(what, failed)
        if isinstance(error, BaseException):
            raise exc from error
        raise exc
    return outcomes


def together(group: dist.ProcessGroup | None, error: BaseException | None, *, what: str,
             timeout_s: float | None = None) -> None:
    """:func:`exchange_outcomes` of one step of a collective load or check; a single process
    (no group) raises its own ``error`` with its own type (``UnsafeSnapshotError``,
    ``StateMismatchError``), as a single-file load would.

    Raises:
        RankFailedError, CollectiveTimeoutError: see :func:`exchange_outcomes`.
    """
    if group is None and error is not None:
        raise error
    exchange_outcomes(group, error, what=what, timeout_s=timeout_s)


def agree_on_resume(
    group: dist.ProcessGroup | None,
    listing: Sequence[tuple[tuple[float, ...], str]],
    check: Callable[[str], str | None],
    *, what: str, timeout_s: float | None = None, required: bool = True,
    on_skip: Callable[[str, dict[int, str]], None] | None = None,
) -> str | None:
    """Choose the snapshot every rank resumes from, once, together.

    The candidates are the union of every rank's ``listing`` (so a snapshot one rank lacks is
    noticed, not silently skipped by that rank alone). The store's one newest-valid-with-fallback
    (:func:`~snapkeep._core.store.contract.newest_valid`: order, skip, warning, error) walks them
    from the newest (highest key) down with a collective check: every rank runs ``check(name)``
    on its part and all ranks exchange the results; a snapshot any rank objects to is refused
    on every rank (:class:`~snapkeep._core.store.contract.CandidateRefused`), and the first one no
    rank objects to is chosen on every rank. A rank lacking a listed snapshot objects to it.

    Args:
        group: snapkeep's control group (None: single process).
        listing: this rank's committed snapshots as ``(key, name)``; the key orders them (step
            first, parsed from the filename template, never mtime).
        check: ``check(name) -> None`` when this rank can read and verify its part of ``name``,
            else a short reason; an exception it raises counts as its reason.
        what: named in messages (e.g. the template and directory).
        required: whether this rank objects to a snapshot missing from its own listing
            (False: ``check`` is asked about every candidate, e.g. a rank that receives the
            snapshot's bytes from the saver rank instead of reading its node-local disk).
        on_skip: ``on_skip(name, {rank: reason})`` for each snapshot skipped (the same calls on
            every rank), instead of the store's fallback warning on every rank; the caller
            reports them once.

    Returns:
        The chosen name (the same on every rank), or None when no rank has any snapshot.

    Raises:
        NoCommonSnapshotError: snapshots exist but none is readable on every rank; the same
            message on every rank names, per step, the ranks that could not read it and why.
        CollectiveTimeoutError: a rank did not take part within ``timeout_s``.
    """
    gathered = all_gather(group, [(tuple(k), n) for k, n in listing],
                          what=f"{what}: listing snapshots", timeout_s=timeout_s)
    union = sorted({(tuple(k), n) for per_rank in gathered for k, n in per_rank})
    own = {n for _, n in listing}

    def vote(candidate: Listed) -> str:
        """This rank's verdict, exchanged: every rank skips or takes ``candidate`` together."""
        reason: str | None
        if required and candidate.name not in own:
            reason = "not found on this rank"
        else:
            try:
                reason = check(candidate.name)
            except Exception as e:  # any failure to read is this rank's reason, exchanged
                reason = f"{type(e).__name__}: {e}"
        reasons = all_gather(group, reason, what=f"{what}: checking {candidate.name}",
                             timeout_s=timeout_s)
        failed = {r: m for r, m in enumerate(reasons) if m is not None}
        if failed:
            raise CandidateRefused(failed)
        return candidate.name

    skipped = None if on_skip is None else (lambda candidate, e: on_skip(
        candidate.name, e.reasons if isinstance(e, CandidateRefused) else {}))
    found = newest_valid([Listed.of(k, n) for k, n in union], vote, what=what, skipped=skipped,
                         error=NoCommonSnapshotError)
    return None if found is None else found[1]
