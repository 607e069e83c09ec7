"""Staging seams used by the snapshot extension and the memory tier (public names): overlapped
staging, validated on the training thread (:mod:`snapkeep._core.save.overlap`), preparing staging
buffers before the first snapshot (:mod:`snapkeep._core.save.prefault`), a consistent CPU copy of a
state tree into reused buffers (:class:`BufferSet`, :mod:`snapkeep._core.save.staging`), a writer's
staged copy lent to a second reader (:class:`StagedLoan`, :mod:`snapkeep._core.save.ticket`), the
staging budget's check and the bytes a full copy holds (:mod:`snapkeep._core.save.budget`), and
loading into the trainer's existing tensors (:mod:`snapkeep._core.load.loading`)."""

from snapkeep._core.errors import StagingRaceError
from snapkeep._core.load.loading import into_existing_state, optimizers_in
from snapkeep._core.save.budget import check_staging_budget, tensor_bytes
from snapkeep._core.save.overlap import StagingGuard, arm, owned_storages
from snapkeep._core.save.prefault import prefault_before_first_snapshot
from snapkeep._core.save.staging import BufferSet
from snapkeep._core.save.ticket import StagedLoan

__all__ = [
    "BufferSet", "StagedLoan", "StagingGuard", "StagingRaceError", "arm",
    "check_staging_budget", "into_existing_state", "optimizers_in", "owned_storages",
    "prefault_before_first_snapshot", "tensor_bytes",
]
