"""Process writers stage into a shared-memory arena the worker maps once; when the state grows
the arena is replaced, and the worker must unmap the old one (or its memory stays allocated)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from snapkeep import writing
from snapkeep._core.save.shm import ARENA_PREFIX
from support.writer_gates import fast_start_method


def _worker_arenas(pid: int) -> set[str]:
    """Names of the shared-memory blocks mapped by ``pid`` (unlinked ones included)."""
    with open(f"/proc/{pid}/maps") as f:
        return {os.path.basename(token) for line in f for token in line.split()
                if "/" + ARENA_PREFIX in token}


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_worker_unmaps_an_arena_replaced_when_the_state_grows(tmp_path: Any) -> None:
    out = str(tmp_path)
    writer = writing.ProcessWriter(start_method=fast_start_method())
    state: dict[str, Any] = {"w": torch.ones(1024)}
    writer("s0", out, state).wait()  # Adam's state does not exist yet, say
    arena = writer._saver._slots[0].buffers.allocator
    first = arena.name
    pid = writer._saver.runner.pid
    assert _worker_arenas(pid) == {first}

    state["exp_avg"] = torch.full((1 << 16,), 2.0)  # the state grew past the arena
    writer("s1", out, state).wait()
    assert arena.name != first
    assert _worker_arenas(pid) == {arena.name}  # the replaced arena is no longer mapped

    writer("s2", out, state).wait()
    assert writer._saver.last_stage_stats.allocated_bytes == 0  # type: ignore[union-attr]
    writer.finalize()
    loaded = torch.load(os.path.join(out, "s2"), weights_only=True)
    assert torch.equal(loaded["exp_avg"], torch.full((1 << 16,), 2.0))
    assert not os.path.exists(f"/dev/shm/{arena.name}")  # finalize unlinked it
