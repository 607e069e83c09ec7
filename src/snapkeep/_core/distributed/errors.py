"""Errors of the distributed engine (also re-exported by :mod:`snapkeep`'s distributed API)."""

from __future__ import annotations

from snapkeep._core.errors import NoValidSnapshotError, SnapshotError


class RankFailedError(SnapshotError, RuntimeError):
    """A collective step (save, commit, retention, resume) failed on one or more ranks.

    Raised on every rank with the same message, which names each failing rank and its error.

    Attributes:
        failed: ``{rank: error message}`` of the ranks that failed.
        what: the step that failed (``'sharded save of snapshot_iter_10'``, ...).
    """

    def __init__(self, what: str, failed: dict[int, str]) -> None:
        self.what = what
        self.failed = dict(failed)
        listed = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(failed)}: {listed}. Every rank "
                         "stopped here; fix the error of the rank(s) named (their logs have the "
                         "traceback) and rerun: the run resumes from the newest committed "
                         "snapshot")


class CollectiveTimeoutError(SnapshotError, TimeoutError):
    """A rank did not reach a collective step within ``timeout_s`` (it died, hangs or raised
    outside snapkeep). The message names the step and this rank; the ranks that did answer are
    listed when the store could tell."""


class NoCommonSnapshotError(NoValidSnapshotError):
    """Snapshots exist, but no step is readable and verified on every rank.

    Raised on every rank with the same message naming, for each step, the ranks that could not
    read it and why.
    """
