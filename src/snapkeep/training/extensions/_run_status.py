"""Records how a run ended in its output directory (``.snapkeep/status.json``) for
``extensions.preemption``; see :mod:`snapkeep._core.session.run_status` for the file and its states.

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

from snapkeep.store import StatusLog, failure_reason
from snapkeep.writing import Writer

logger = logging.getLogger(__name__)


class StatusRecorder:
    """Writes the run's state at start, preemption, error and finalize (rank 0 only; the
    core's :class:`snapkeep.store.StatusLog`, found in the first snapshot extension's
    directory)."""

    def __init__(self) -> None:
        self._log: StatusLog | None = None

    def start(self, manager: Any, snapshots: Sequence[Any], *, rank: int, world_size: int
              ) -> None:
        """Find the directory and record ``running`` at the manager's iteration."""
        for ext in snapshots:
            writer = ext.writer if ext.writer is not None else manager.writer
            if isinstance(writer, Writer):
                storage, directory = writer.storage_for(manager.out)
                self._log = StatusLog(storage, directory, rank=rank, world_size=world_size)
                break
        else:
            logger.warning("preemption: no snapshot extension with a snapkeep writer; the run's "
                           "status is not recorded")
        self._record(manager, "running")

    def preempted(self, manager: Any, *, reason: str, snapshots: Sequence[str]) -> None:
        self._record(manager, "preempted", reason=reason, snapshots=tuple(snapshots))

    def failed(self, manager: Any, error: BaseException) -> None:
        """``failed`` with ``error``'s type and first line (each failing rank's error for a
        :class:`~snapkeep.errors.RankFailedError`), unless a final state was recorded."""
        self._record(manager, "failed", reason=failure_reason(error))

    def finalize(self, manager: Any) -> None:
        """``finished``, unless an error is being raised (a ``with manager:`` block left by
        an exception: ``failed``) or another state was recorded."""
        error = sys.exc_info()[1]
        if error is not None and not isinstance(error, SystemExit) or \
                isinstance(error, SystemExit) and error.code not in (0, None):
            self.failed(manager, error)
            return
        self._record(manager, "finished", reason="the manager was finalized")

    def _record(self, manager: Any, state: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.record(state, int(manager.iteration), **fields)
