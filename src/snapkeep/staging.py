"""Staging seams used by the snapshot extension and the memory tier (public names): overlapped
staging, validated on the training thread (:mod:`snapkeep._core.overlap`), preparing staging
buffers before the first snapshot (:mod:`snapkeep._core.prefault`), a consistent CPU copy of a
state tree into reused buffers (:class:`BufferSet`, :mod:`snapkeep._core.staging`), a writer's
staged copy lent to a second reader (:class:`StagedLoan`, :mod:`snapkeep._core.ticket`), and
loading into the trainer's existing tensors (:mod:`snapkeep._core.loading`)."""

from snapkeep._core.errors import StagingRaceError
from snapkeep._core.loading import into_existing_state, optimizers_in
from snapkeep._core.overlap import StagingGuard, arm
from snapkeep._core.prefault import prefault_before_first_snapshot
from snapkeep._core.staging import BufferSet
from snapkeep._core.ticket import StagedLoan

__all__ = [
    "BufferSet", "StagedLoan", "StagingGuard", "StagingRaceError", "arm", "into_existing_state",
    "optimizers_in", "prefault_before_first_snapshot",
]
