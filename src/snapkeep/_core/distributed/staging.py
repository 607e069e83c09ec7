"""Consistent CPU copies of a state tree holding DTensors and tensors, into reused buffers.

After :meth:`Stager.stage` returns, the training may modify every parameter and optimizer state
in place: the staged tree holds copies. A DTensor is staged as a DTensor of the same mesh,
placements, global shape and stride whose local shard is a CPU buffer (what DCP writes); no
collective is involved. Buffers are kept per tree path and reused while shape and dtype stay
the same, so steady-state snapshots allocate nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


class Stager:
    """Copies state trees into reused CPU buffers (one set of buffers: stage the next tree only
    after the previous staged tree is no longer used)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.staged_bytes = 0

    def stage(self, tree: Any) -> Any:
        """A copy of ``tree`` (nested dicts/lists/tuples) with every tensor's data on the CPU in
        a buffer of this stager; other leaves are kept as they are (they must be immutable or
        already copies, e.g. pickled ``bytes``)."""
        self.staged_bytes = 0
        return self._stage(tree, "")

    def _stage(self, value: Any, path: str) -> Any:
        if isinstance(value, DTensor):
            local = self._copy(value.to_local(), path)
            return DTensor.from_local(local, value.device_mesh, value.placements,
                                      run_check=False, shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._copy(value, path)
        if isinstance(value, Mapping):
            return {k: self._stage(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self._stage(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._stage(v, f"{path}.{i}") for i, v in enumerate(value))
        return value

    def _copy(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        source = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu",
                                 pin_memory=source.is_cuda and torch.cuda.is_available())
            self._buffers[path] = buffer
        buffer.copy_(source)
        self.staged_bytes += buffer.numel() * buffer.element_size()
        return buffer
