"""Resuming from a remote store downloads the snapshot once: verified and decoded from memory."""

from __future__ import annotations

import collections

import torch
from fsspec.implementations.memory import MemoryFileSystem

from snapkeep import writing
from snapkeep._core.load.loading import load_file
from snapkeep._core.store.files import SnapshotStore


class CountingMemoryFS(MemoryFileSystem):
    """An in-memory filesystem that counts whole-object reads per path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, global_store=False, **kwargs)
        self.reads: collections.Counter[str] = collections.Counter()

    def cat_file(self, path, *args, **kwargs):
        self.reads[self._strip_protocol(path)] += 1
        return super().cat_file(path, *args, **kwargs)

    def open(self, path, mode="rb", **kwargs):
        if "r" in mode:
            self.reads[self._strip_protocol(path)] += 1
        return super().open(path, mode, **kwargs)


def test_remote_autoload_downloads_each_snapshot_once():
    fs = CountingMemoryFS(skip_instance_cache=True)
    writer = writing.SimpleWriter(fs=fs, out_dir="/run")
    state = {"w": torch.arange(1000.0)}
    writer("snap_5", "", state)
    writer.finalize()
    storage, directory = writer.storage_for("")
    catalog = SnapshotStore(storage, directory, "snap_{step}")
    fs.reads.clear()

    found = catalog.load_newest(
        lambda entry, data: load_file(storage, entry.path, data=data))

    assert found is not None
    entry, loaded = found
    assert torch.equal(loaded["w"], state["w"])
    assert fs.reads[fs._strip_protocol(entry.path)] == 1, dict(fs.reads)
