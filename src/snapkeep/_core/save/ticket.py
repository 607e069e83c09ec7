"""A snapshot in flight: its :class:`SaveHandle` (two futures the caller may wait on), the
buffer-set slot it holds while staged or being written, the :class:`Ticket` the saver hands to
whoever writes it (see :mod:`.saver`), and a :class:`StagedLoan` of its staged copy to a second
reader of the same state at the same step (the memory tier), instead of a second staging."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any

from snapkeep._core.errors import SnapshotTimeoutError
from snapkeep._core.save.job import CommitRecord, SaveJob
from snapkeep._core.save.staging import BufferSet, StageStats
from snapkeep._core.store.files import Retain


@dataclasses.dataclass(eq=False)
class SaveHandle:
    """A snapshot in flight.

    Attributes:
        path: final path of the snapshot.
        step: training iteration when known.
        staged: resolves (to :class:`StageStats`) when the state has been copied and the caller
            may mutate it. With overlapped staging, only once the background copy has been
            validated on the training thread (:mod:`snapkeep._core.save.overlap`); raises the
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
    #: the :class:`~snapkeep._core.save.overlap.PendingVerdict` of an overlapped staging, else None
    verdict: Any = None

    def wait(self, timeout_s: float | None = None) -> CommitRecord:
        """Block until committed and return the record.

        Raises:
            SnapshotTimeoutError: not committed within ``timeout_s`` seconds.
            concurrent.futures.CancelledError: the snapshot was replaced by a newer one.
            StagingRaceError: an overlapped snapshot was dropped (see :mod:`.overlap`).
            Exception: the save's own error.
        """
        self.settle_here(timeout_s)
        try:
            return self.committed.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise SnapshotTimeoutError(
                f"snapshot {self.path!r} was not committed within {timeout_s} s"
            ) from e


    def settle_here(self, timeout_s: float | None = None) -> None:
        """On the thread that made the snapshot call (a safe point), give the verdict of its
        overlapped staging now, waiting for the background copy; elsewhere, or without
        overlapped staging, do nothing. A race is passed to the plan's ``on_race``.

        Raises:
            StagingRaceError: a counter moved and the plan has no ``on_race`` (or it raises).
            SnapshotTimeoutError: the copy was not done within ``timeout_s`` seconds.
        """
        verdict = self.verdict
        if verdict is not None and verdict.made_here():  # a safe point: this thread waits
            race = verdict.settle(block=True, timeout_s=timeout_s)
            if race is not None:
                if verdict.on_race is None:
                    raise race
                verdict.on_race(race)


@dataclasses.dataclass(eq=False)
class Slot:
    """A buffer set and the snapshot (if any) that currently owns it.

    Attributes:
        holds: the snapshot whose staged copy the buffers hold (kept after its commit, until
            the slot is staged again), with ``staged`` its tree; None once restaged or closed.
        loans: :class:`StagedLoan` of that copy not returned yet; the slot is neither staged
            again, handed to another snapshot nor closed meanwhile.
        close_when_returned: the saver was closed while a loan was out: the last return closes
            the buffers' allocator.
    """

    buffers: BufferSet
    handle: SaveHandle | None = None
    started: bool = False
    holds: SaveHandle | None = None
    staged: Any = None
    loans: int = 0
    close_when_returned: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class StagedLoan:
    """The staged copy of one snapshot, lent to a second reader of the same state at the same
    step (:meth:`snapkeep._core.save.saver.Saver.lend`): the memory tier serialises it instead of
    staging the state a second time.

    Why reading it is safe (order, not luck): the copy's bytes are final once
    :meth:`wait_staged` returns. Without overlapped staging they were written before the writer
    call returned; with it, ``handle.staged`` resolves only after the background copy finished
    and its verdict was given on the training thread (:mod:`snapkeep._core.save.overlap`), and a
    future's result happens after it is set. Nothing writes the buffers after that while the
    loan is out: only staging writes them, and the saver stages into a slot only when no loan
    of it is out (nor hands it to ``on_full='replace'``, nor closes its shared memory); the
    writer and a process worker only read them.

    Attributes:
        tree: the staged state (CPU tensors in the writer's buffers; a process writer's are in
            its shared memory). Read only; valid until :meth:`release`.
        handle: the snapshot's handle (its step, path and futures).
    """

    tree: Any
    handle: SaveHandle
    _release: Callable[[], None]
    _timeout_s: float | None = None
    _warn_after_s: float = 30.0

    def wait_staged(self, timeout_s: float | None = None) -> None:
        """Block until the copy is final (any thread; see the class docstring), at most
        ``timeout_s`` seconds (default: the writer's ``timeout_s``).

        Raises:
            StagingRaceError: the snapshot's overlapped staging raced with training: it was
                dropped, and so must this copy be.
            SnapshotTimeoutError: no verdict within ``timeout_s``.
            Exception: the staging's own error.
        """
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        verdict = self.handle.verdict
        if verdict is not None:
            verdict.wait(timeout_s, self._warn_after_s)
        else:
            self.handle.staged.result()

    def release(self) -> None:
        """Return the loan (once; later calls do nothing): the writer may stage into the slot
        again."""
        self._release()


@dataclasses.dataclass(frozen=True, eq=False)
class Ticket:
    """One staged snapshot waiting to be written: its slot, handle, job and staged tree, and
    for an incremental snapshot its :class:`~snapkeep._core.tiers.incremental.IncrementalPlan`."""

    slot: Slot
    handle: SaveHandle
    job: SaveJob
    staged: Any
    retain: Retain | None = None
    incremental: Any = None
    #: the :class:`~snapkeep._core.save.budget.Stream` of a budgeted snapshot (staged and
    #: written in pieces), else None
    stream: Any = None
