"""Peer-to-peer transfers of the memory tier's copies over snapkeep's process groups (the only
place the tier talks to torch.distributed): pairwise exchanges, and one snapshot's bytes sent
from their pages and received into an anonymous memory file, checked before they are loaded.
"""

from __future__ import annotations

import io
import mmap
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from snapkeep._core.errors import SnapshotCorruptError


def pairwise(group: Any, send: list[torch.Tensor], recv: list[torch.Tensor], dst: int,
             src: int) -> None:
    """Send ``send`` to rank ``dst`` while receiving ``recv`` from rank ``src`` (one batch of
    point-to-point operations on ``group``, waited for)."""
    ops = [dist.P2POp(dist.isend, t, dst, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, src, group) for t in recv]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def send_bytes(payload: Any, dst: int, group: Any) -> None:
    """Send ``payload`` (bytes, or a mapped file: sent from its pages, no copy) to ``dst``;
    an empty payload says "no copy"."""
    size = len(payload)
    dist.send(torch.tensor([size], dtype=torch.int64), dst, group=group)
    if size:
        with warnings.catch_warnings():  # only read: no copy of a read-only buffer
            warnings.filterwarnings("ignore", message=".*not writable.*")
            tensor = torch.frombuffer(payload, dtype=torch.uint8)
        dist.send(tensor, dst, group=group)
        del tensor


def recv_verified(src: int, group: Any, checksum: str, *,
                  check: Callable[[Any, str], None]) -> Any:
    """The state sent by ``src`` (``torch.load``'d, ``weights_only``, CPU), its bytes checked
    by ``check(bytes, checksum)`` first. The bytes land once in an anonymous memory file
    (``memfd_create``, where the system has it), are hashed in place and loaded mapped: no copy
    of them is made after the transfer.

    Raises:
        SnapshotCorruptError: nothing was sent, or ``check`` refused the bytes.
    """
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    n = int(size[0])
    if n == 0:
        raise SnapshotCorruptError("the holder has no copy of this step")
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        out = torch.empty(n, dtype=torch.uint8)
        dist.recv(out, src, group=group)
        data = out.numpy().tobytes()
        del out
        check(data, checksum)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    fd = os.memfd_create("snapkeep-peer-copy")
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n) as buf:
            out = torch.frombuffer(buf, dtype=torch.uint8)
            dist.recv(out, src, group=group)
            del out
            check(buf, checksum)
        return torch.load(f"/proc/self/fd/{fd}", map_location="cpu", weights_only=True,
                          mmap=True)
    finally:
        os.close(fd)
