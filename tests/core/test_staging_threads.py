"""The staging copy's thread count, the immutable-leaf fast path, and the one persistent
background-staging thread."""

from __future__ import annotations

import os
import random
import threading

import torch

from snapkeep._core.save import host_memory
from snapkeep._core.save.host_memory import HeapAllocator, copy_threads
from snapkeep._core.save.staging import BufferSet


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def test_copy_threads_borrow_this_ranks_share_of_the_cpus_when_torch_uses_fewer(
        monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert copy_threads() == max(1, min(host_memory.MAX_COPY_THREADS, _cpus()))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(_cpus()))  # one CPU per local rank: no helper
    assert copy_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not-a-number")
    assert copy_threads() == max(1, min(host_memory.MAX_COPY_THREADS, _cpus()))


def test_copy_threads_never_fewer_than_torchs(monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert copy_threads() == 64


def test_a_multi_chunk_copy_is_exact_with_helpers(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "COPY_CHUNK_BYTES", 4096)
    monkeypatch.setattr(host_memory, "copy_threads", lambda: 3)
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    host_memory.copy_host([(dst.data_ptr(), src.data_ptr(), src.nbytes)])
    assert torch.equal(src, dst)


def test_immutable_leaves_are_shared_and_tensors_in_tuples_still_staged() -> None:
    rng = random.Random(3).getstate()  # (version, 625 ints, None)
    t = torch.arange(10.0)
    tree = {"rng": rng, "pair": (1, t), "name": "x", "n": 3, "f": 0.5, "none": None}
    staged, _ = BufferSet(HeapAllocator()).stage(tree)
    assert staged["rng"] == random.Random(3).getstate()
    assert staged["rng"][1] is rng[1]  # the 625 ints: shared, not walked and copied
    assert staged["pair"][0] == 1 and torch.equal(staged["pair"][1], t)
    assert staged["pair"][1].data_ptr() != t.data_ptr()  # the tensor in the tuple was copied
    t.add_(1)
    assert torch.equal(staged["pair"][1], torch.arange(10.0))
    assert (staged["name"], staged["n"], staged["f"], staged["none"]) == ("x", 3, 0.5, None)


def test_background_staging_reuses_one_thread() -> None:
    from snapkeep._core.save.overlap import DeferredCopy, PendingVerdict
    from snapkeep._core.save.staging import StageStats
    from snapkeep._core.save.ticket import SaveHandle

    seen: list[int] = []
    stats = StageStats(tensor_bytes=0, allocated_bytes=0, num_storages=0)
    for _ in range(2):
        verdict = PendingVerdict(
            SaveHandle(path="p", step=1),
            DeferredCopy(copies=[], members=[], stats=stats,
                         before_copy=lambda: seen.append(threading.get_ident())),
            on_race=None)
        verdict.start()
        assert verdict.copied.result(timeout=10) == stats
    assert len(seen) == 2 and seen[0] == seen[1] != threading.get_ident()
