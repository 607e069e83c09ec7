"""The sharded commit (``ShardedSaver``) records each file's checksum as DCP writes it: no
file of the snapshot (data files, ``.metadata``) is read back before the marker (a second pass
over every byte the save wrote; issue 34: time to durable), and the recorded checksums and
sizes are those of the files on disk. DCP's plans are cached from one save to the next: a
state whose structure changed between saves is still saved whole. Single process (DCP without
a process group); the multi-rank commit runs in ``test_sharded.py``."""

from __future__ import annotations

import gc
import os

import torch
from torch.distributed.checkpoint.planner import SavePlanner

from snapkeep._core.distributed.sharded import ShardedJob, ShardedSaver, load_sharded
from snapkeep._core.distributed.sharded_store import ShardedStore
from snapkeep._core.format.checksum import digest_file
from snapkeep._core.storage import resolve_storage


def _store_counting_reads(tmp_path) -> tuple[ShardedStore, list[str]]:
    storage, directory = resolve_storage(str(tmp_path / "out"))
    opened: list[str] = []
    open_read = storage.open_read

    def counting(path: str, **kwargs):  # this storage object's reads, recorded
        opened.append(os.path.basename(path))
        return open_read(path, **kwargs)

    storage.open_read = counting  # type: ignore[method-assign]
    return ShardedStore(storage, directory, "snap_{step}"), opened


def test_the_commit_reads_no_data_file_back_and_records_what_is_on_disk(tmp_path):
    store, opened = _store_counting_reads(tmp_path)
    state = {"models": {"main": {"w": torch.arange(1 << 16, dtype=torch.float32),
                                 "b": torch.ones(3)}}, "objects": {"x": b"abc"}}
    saver = ShardedSaver(store, None)
    try:
        saver.save(state, ShardedJob(name="snap_1", step=1)).committed.result(timeout=120)
        manifest = saver.save(state, ShardedJob(name="snap_2", step=2)).committed.result(
            timeout=120)
        assert manifest is not None
        assert opened == []  # before: each data file, every save; then .metadata
        phases = saver.last_commit_phases_s
    finally:
        saver.close()
    directory = tmp_path / "out" / "snap_2"
    on_disk = sorted(n for n in os.listdir(directory) if not n.startswith(".snapkeep"))
    assert sorted(manifest.files) == on_disk == [".metadata", "__0_0.distcp"]
    for name, record in manifest.files.items():
        assert digest_file(str(directory / name)) == (record.checksum, record.size_bytes), name
    assert store.verify_part(store.entries()[-1], 0, 1) == manifest
    assert set(phases) == {"prepare", "plan", "write", "dcp_finish",
                           "metadata_and_directory_fsync", "marker", "agree_committed"}
    assert all(v >= 0 for v in phases.values())


def test_a_state_whose_structure_changes_between_saves_is_saved_whole(tmp_path):
    """DCP's plan cache (on in the saver) must not reuse the first save's plan for a state with
    another key or shape: each snapshot loads back to exactly its own state."""
    store, _ = _store_counting_reads(tmp_path)
    states = [{"models": {"main": {"w": torch.arange(6.0)}}},
              {"models": {"main": {"w": torch.arange(6.0) + 1, "v": torch.ones(2)}}},
              {"models": {"main": {"w": torch.arange(4.0) * 2, "v": torch.ones(2) * 3}}},
              {"models": {"main": {"w": torch.arange(4.0) * 5, "v": torch.ones(2) * 7}}}]
    saver = ShardedSaver(store, None)
    try:
        for i, state in enumerate(states):
            saver.save(state, ShardedJob(name=f"snap_{i}", step=i)).committed.result(
                timeout=120)
    finally:
        saver.close()
    key = saver._plans_key
    caches = (SavePlanner._cached_save_plan, SavePlanner._cached_global_plan)
    assert all(key in cache for cache in caches)  # the plans were cached under its own key
    del saver
    gc.collect()
    assert not any(key in cache for cache in caches)  # and dropped with it (no drift)
    entries = {e.name: e for e in store.entries()}
    for i, state in enumerate(states):
        target = {"models": {"main": {k: torch.zeros_like(v)
                                      for k, v in state["models"]["main"].items()}}}
        load_sharded(store, entries[f"snap_{i}"], target, groups=None)
        for key, value in state["models"]["main"].items():
            assert torch.equal(target["models"]["main"][key], value), (i, key)
