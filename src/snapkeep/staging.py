"""Staging seams used by the snapshot extension (public names): overlapped staging, validated
on the training thread (:mod:`snapkeep._core.overlap`), preparing staging buffers before the
first snapshot (:mod:`snapkeep._core.prefault`), and loading into the trainer's existing tensors
(:mod:`snapkeep._core.loading`)."""

from snapkeep._core.errors import StagingRaceError
from snapkeep._core.loading import into_existing_state, optimizers_in
from snapkeep._core.overlap import StagingGuard, arm
from snapkeep._core.prefault import prefault_before_first_snapshot

__all__ = [
    "StagingGuard", "StagingRaceError", "arm", "into_existing_state", "optimizers_in",
    "prefault_before_first_snapshot",
]
