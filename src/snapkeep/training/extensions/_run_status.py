"""Records how a run ended in its output directory (``.snapkeep/status.json``) for
``extensions.preemption``; see :mod:`snapkeep._core.run_status` for the file and its states.

Only rank 0 writes (the states are agreed: a preemption is recorded after the outcome exchange),
also when ``snapshot(saver_rank=k)`` writes the snapshots on another rank. Decided so because
the status is the job's outcome, not a snapshot's: rank 0 is on the node where the job script
runs (SLURM runs the batch script on the job's first node, where torchrun's node rank 0 is) and
where ``snapkeep status`` can check the recorded pid of a ``running`` state; with the shared
``out_dir`` that resuming on any rank needs anyway, it is the same file beside the snapshots.
With node-local output directories, read the status on rank 0's node.
An error raised on another rank reaches rank 0 through ``extensions.preemption``'s per-iteration
agreement (its ``on_error`` reports it there), as a
:class:`~snapkeep.errors.RankFailedError`: ``failed`` then names that rank and its error.
The directory is the one of the manager's first snapshot extension with a snapkeep writer. A
status that cannot be written is logged, never fatal: the snapshots are what matter.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from snapkeep.errors import RankFailedError
from snapkeep.store import Storage, write_run_status

logger = logging.getLogger(__name__)


class StatusRecorder:
    """Writes the run's state at start, preemption, error and finalize (rank 0 only)."""

    def __init__(self) -> None:
        self._where: tuple[Storage, str] | None = None
        self._rank = 0
        self._world_size = 1
        self._final = False

    def start(self, manager: Any, snapshots: Sequence[Any], *, rank: int, world_size: int
              ) -> None:
        """Find the directory and record ``running`` at the manager's iteration."""
        self._rank, self._world_size = rank, world_size
        for ext in snapshots:
            writer = ext.writer if ext.writer is not None else manager.writer
            storage_for = getattr(writer, "storage_for", None)
            if callable(storage_for):
                self._where = storage_for(manager.out)
                break
        else:
            logger.warning("preemption: no snapshot extension with a snapkeep writer; the run's "
                           "status is not recorded")
        self._write(manager, "running")

    def preempted(self, manager: Any, *, reason: str, snapshots: Sequence[str]) -> None:
        self._final = True
        self._write(manager, "preempted", reason=reason, snapshots=tuple(snapshots))

    def failed(self, manager: Any, error: BaseException) -> None:
        """``failed`` with ``error``'s type and first line; a :class:`RankFailedError` (an error
        on another rank, or on several) gives each failing rank's error instead."""
        if self._final:
            return
        self._final = True
        if isinstance(error, RankFailedError):
            reason = "; ".join(f"rank {r}: {m}" for r, m in sorted(error.failed.items()))
        else:
            reason = f"{type(error).__name__}: {str(error)}"
        self._write(manager, "failed", reason=reason.splitlines()[0][:500] if reason else "")

    def finalize(self, manager: Any) -> None:
        """``finished``, unless an error is being raised (a ``with manager:`` block left by
        an exception: ``failed``) or another state was recorded."""
        if self._final:
            return
        error = sys.exc_info()[1]
        if error is not None and not isinstance(error, SystemExit) or \
                isinstance(error, SystemExit) and error.code not in (0, None):
            self.failed(manager, error)
            return
        self._final = True
        self._write(manager, "finished", reason="the manager was finalized")

    def _write(self, manager: Any, state: str, **fields: Any) -> None:
        if self._rank != 0 or self._where is None:
            return
        storage, directory = self._where
        try:
            write_run_status(storage, directory, state=state, step=int(manager.iteration),
                             world_size=self._world_size, **fields)
        except OSError as e:
            logger.warning("rank 0: could not record the run's status %r in %s: %s", state,
                           directory, e)
        else:
            logger.debug("rank 0: run status %r at iteration %s recorded in %s", state,
                         manager.iteration, directory)
