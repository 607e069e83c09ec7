"""A run makes a directory per snapshot (HF ``checkpoint-N``, sharded snapshots): the storage
must not remember every one (issue 34, no drift over a thousand saves). Measured with
tracemalloc: the Python memory the storage module still holds after 2,000 more directories."""

from __future__ import annotations

import tracemalloc

import fsspec
import pytest

from snapkeep._core.storage import Storage, resolve_storage


def _held_by_storage_after(storage: Storage, base: str, count: int) -> int:
    for i in range(50):  # warm-up: the structures' first allocations
        storage.makedirs(storage.join(base, f"warm-{i}"))
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(count):
            storage.makedirs(storage.join(base, f"checkpoint-{i}"))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    only = [tracemalloc.Filter(True, "*snapkeep/_core/storage/*")]
    return sum(d.size_diff for d in after.filter_traces(only).compare_to(
        before.filter_traces(only), "filename"))


def test_local_storage_does_not_grow_with_the_directories_it_makes(tmp_path):
    storage, directory = resolve_storage(str(tmp_path / "out"))
    held = _held_by_storage_after(storage, directory, 2000)
    assert held < 20_000, held  # before: every path kept (~200 KB for 2,000)


@pytest.mark.parametrize("protocol", ["memory"])
def test_an_object_store_remembers_only_the_latest_directories(protocol):
    fs = fsspec.filesystem(protocol)
    storage = Storage(fs)
    held = _held_by_storage_after(storage, "/drift-bound", 2000)
    assert held < 20_000, held
    fs.rm("/drift-bound", recursive=True)
