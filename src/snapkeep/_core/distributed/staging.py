"""Consistent CPU copies of a state tree holding DTensors and tensors, into reused buffers.

After :meth:`Stager.stage` returns, the training may modify every parameter and optimizer state
in place: the staged tree holds copies. A DTensor is staged as a DTensor of the same mesh,
placements, global shape and stride whose local shard is a CPU buffer (what DCP writes); no
collective is involved. Buffers are kept per tree path and reused while shape and dtype stay
the same, and so is each staged DTensor while its buffer, mesh, placements, shape and stride
stay the same (``DTensor.from_local`` costs ~30 us a tensor: 3 of the 4 ms a 96-DTensor state
took to stage), so steady-state snapshots allocate nothing.

Overlapped (``deferred``: the storages guarded optimizers own, see
:mod:`snapkeep._core.save.overlap`): the large CPU local shards of those storages get their
buffer at the call but are copied later (:class:`ShardCopies`, on the background staging
thread), the rest is copied at the call. Each deferred tensor's version counter is recorded at
the call on the tensor in-place writes move: for a DTensor the DTensor itself (an in-place op on
a DTensor, ``optimizer.step()`` included, bumps the DTensor's counter and those of the
parameters it was detached from, never its local shard's: measured on torch 2.13, FSDP2 + Adam).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from snapkeep._core.errors import StagingRaceError
from snapkeep._core.save.overlap import MIN_DEFERRED_BYTES, Ident, first_moved, storage_ident

logger = logging.getLogger(__name__)


class ShardCopies:
    """The background half of an overlapped sharded staging (what
    :class:`~snapkeep._core.save.overlap.PendingVerdict` runs and checks): :meth:`copy` on any
    thread, :meth:`moved` on the training thread at a safe point after it.

    Args:
        copies: ``(buffer, source)`` pairs: CPU tensors of one shape and dtype.
        members: ``(tree path, tensor, version counter at the call)`` of each deferred value.
    """

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]],
                 members: list[tuple[str, torch.Tensor, int]]) -> None:
        self._copies = copies
        self.members = members

    @property
    def nbytes(self) -> int:
        """Bytes the background copy moves."""
        return sum(dst.numel() * dst.element_size() for dst, _ in self._copies)

    def copy(self) -> None:
        """Copy every source into its buffer (:attr:`nbytes` bytes)."""
        for dst, src in self._copies:
            dst.copy_(src)

    def moved(self) -> StagingRaceError | None:
        """The error naming the first deferred value whose version counter moved since the
        call, or None. Sound only on the thread that writes the tensors, after the copy."""
        return first_moved(self.members)


class Stager:
    """Copies state trees into reused CPU buffers (one set of buffers: stage the next tree only
    after the previous staged tree is no longer used)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # the staged DTensor of each path and its buffer, reused
        self._dtensors: dict[str, tuple[DTensor, torch.Tensor]] = {}
        self.staged_bytes = 0
        self._deferred: frozenset[Ident] = frozenset()
        self._min_bytes = MIN_DEFERRED_BYTES
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._members: list[tuple[str, torch.Tensor, int]] = []

    def stage(self, tree: Any, deferred: frozenset[Ident] = frozenset(), *,
              min_bytes: int = MIN_DEFERRED_BYTES) -> tuple[Any, ShardCopies | None]:
        """A copy of ``tree`` (nested dicts/lists/tuples) with every tensor's data on the CPU in
        a buffer of this stager; other leaves are kept as they are (they must be immutable or
        already copies, e.g. pickled ``bytes``). Returns ``(staged tree, deferred copies)``.

        CPU tensors (DTensor local shards included) of the storages ``deferred`` names (device,
        address, bytes: see :func:`~snapkeep._core.save.overlap.owned_storages`) of at least
        ``min_bytes`` get their buffer now and are copied by the returned :class:`ShardCopies`
        (None when nothing is deferred): read the staged tree only after that copy."""
        self.staged_bytes = 0
        self._deferred, self._min_bytes = deferred, min_bytes
        self._later, self._members = [], []
        try:
            with torch.no_grad():  # copies into buffers never join an autograd graph
                staged = self._stage(tree, "")
            later, members = self._later, self._members
        finally:
            self._deferred, self._later, self._members = frozenset(), [], []
        return staged, (ShardCopies(later, members) if later else None)

    def _stage(self, value: Any, path: str) -> Any:
        if isinstance(value, DTensor):
            # its local shard (what ``to_local()`` returns, without that call's autograd
            # Function: ~15 us, a third of a DTensor's staging)
            buffer = self._copy(value._local_tensor, path, versioned=value)
            reused = self._dtensors.get(path)
            if reused is not None and reused[1] is buffer \
                    and reused[0].device_mesh is value.device_mesh \
                    and reused[0].placements == value.placements \
                    and reused[0].shape == value.shape and reused[0].stride() == value.stride():
                return reused[0]
            staged = DTensor.from_local(buffer, value.device_mesh, value.placements,
                                        run_check=False, shape=value.shape,
                                        stride=value.stride())
            self._dtensors[path] = (staged, buffer)
            return staged
        if isinstance(value, torch.Tensor):
            return self._copy(value, path, versioned=value)
        if isinstance(value, Mapping):
            return {k: self._stage(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self._stage(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._stage(v, f"{path}.{i}") for i, v in enumerate(value))
        return value

    def _defers(self, source: torch.Tensor, versioned: torch.Tensor) -> bool:
        if not self._deferred or type(source) not in (torch.Tensor, torch.nn.Parameter) \
                or type(versioned) not in (torch.Tensor, torch.nn.Parameter, DTensor) \
                or source.layout != torch.strided:
            return False
        return source.device.type == "cpu" \
            and source.untyped_storage().nbytes() >= self._min_bytes \
            and storage_ident(source) in self._deferred

    def _copy(self, source: torch.Tensor, path: str, *, versioned: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu",
                                 pin_memory=source.is_cuda and torch.cuda.is_available())
            self._buffers[path] = buffer
        if self._defers(source, versioned):  # copied on another thread: no autograd there
            self._later.append((buffer, source.detach()))
            self._members.append((path.lstrip("."), versioned, versioned._version))
        else:
            buffer.copy_(source)
        self.staged_bytes += buffer.numel() * buffer.element_size()
        return buffer
