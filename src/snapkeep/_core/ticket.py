"""A snapshot in flight: its :class:`SaveHandle` (two futures the caller may wait on), the
buffer-set slot it holds while staged or being written, and the :class:`Ticket` the saver hands to
whoever writes it (see :mod:`.saver`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from snapkeep._core.errors import SnapshotTimeoutError
from snapkeep._core.job import CommitRecord, SaveJob
from snapkeep._core.staging import BufferSet, StageStats
from snapkeep._core.store import Retain


@dataclasses.dataclass(eq=False)
class SaveHandle:
    """A snapshot in flight.

    Attributes:
        path: final path of the snapshot.
        step: training iteration when known.
        staged: resolves (to :class:`StageStats`) when the state has been copied and the caller
            may mutate it. With overlapped staging, only once the background copy has been
            validated on the training thread (:mod:`snapkeep._core.overlap`); raises the
            :class:`~snapkeep.StagingRaceError` of a dropped snapshot.
        committed: resolves (to :class:`CommitRecord`) when the snapshot is durable; raises the
            save's error otherwise; cancelled when the snapshot was replaced by a newer one.
    """

    path: str
    step: int | None
    staged: concurrent.futures.Future[StageStats] = dataclasses.field(
        default_factory=concurrent.futures.Future)
    committed: concurrent.futures.Future[CommitRecord] = dataclasses.field(
        default_factory=concurrent.futures.Future)
    #: the :class:`~snapkeep._core.overlap.PendingVerdict` of an overlapped staging, else None
    verdict: Any = None

    def wait(self, timeout_s: float | None = None) -> CommitRecord:
        """Block until committed and return the record.

        Raises:
            SnapshotTimeoutError: not committed within ``timeout_s`` seconds.
            concurrent.futures.CancelledError: the snapshot was replaced by a newer one.
            StagingRaceError: an overlapped snapshot was dropped (see :mod:`.overlap`).
            Exception: the save's own error.
        """
        verdict = self.verdict
        if verdict is not None and verdict.made_here():  # a safe point: this thread waits
            race = verdict.settle(block=True, timeout_s=timeout_s)
            if race is not None:
                if verdict.on_race is None:
                    raise race
                verdict.on_race(race)
        try:
            return self.committed.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise SnapshotTimeoutError(
                f"snapshot {self.path!r} was not committed within {timeout_s} s"
            ) from e


@dataclasses.dataclass(eq=False)
class Slot:
    """A buffer set and the snapshot (if any) that currently owns it."""

    buffers: BufferSet
    handle: SaveHandle | None = None
    started: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Ticket:
    """One staged snapshot waiting to be written: its slot, handle, job and staged tree."""

    slot: Slot
    handle: SaveHandle
    job: SaveJob
    staged: Any
    retain: Retain | None = None
