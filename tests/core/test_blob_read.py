"""Reading a blob back (:meth:`snapkeep._core.tiers.blobs.BlobArea.read`): a local blob is mapped
and
hashed in place (no copy, no second read), and any other byte count or content is refused."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from snapkeep._core.errors import SnapshotCorruptError
from snapkeep._core.format.checksum import new_hasher
from snapkeep._core.storage import resolve_storage
from snapkeep._core.tiers.blobs import BlobArea

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/maps and /proc/self/io")


def _blob(tmp_path, data: bytes) -> tuple[BlobArea, str, str]:
    hasher = new_hasher()
    hasher.update(data)
    digest = str(hasher.hexdigest())
    path = tmp_path / digest
    path.write_bytes(data)
    storage, directory = resolve_storage(str(tmp_path))
    return BlobArea(storage=storage, directory=directory), digest, str(path)


def _mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


def _read_chars() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@linux_only
def test_a_local_blob_is_mapped_and_hashed_in_place(tmp_path):
    data = torch.arange(1 << 20, dtype=torch.int32).numpy().tobytes()  # 4 MiB
    area, digest, path = _blob(tmp_path, data)
    before = _read_chars()
    storage = area.read(digest, len(data))
    assert _read_chars() - before < len(data) // 8  # hashed where mapped, not read()
    assert path in _mapped_paths()
    tensor = torch.empty((0,), dtype=torch.uint8).set_(storage)
    assert tensor.numpy().tobytes() == data
    tensor[0] = 255  # copy-on-write: the blob itself never changes
    with open(path, "rb") as f:
        assert f.read(1) == data[:1]
    del storage, tensor
    gc.collect()
    assert path not in _mapped_paths()


@pytest.mark.parametrize("change", ["flip first", "flip last", "truncate", "append"])
def test_a_changed_blob_is_refused_and_nothing_stays_mapped(tmp_path, change):
    data = bytes(range(256)) * 4096
    area, digest, path = _blob(tmp_path, data)
    with open(path, "r+b") as f:
        if change.startswith("flip"):
            offset = 0 if change == "flip first" else len(data) - 1
            f.seek(offset)
            f.write(bytes([data[offset] ^ 0x10]))
        elif change == "truncate":
            f.truncate(len(data) - 1)
        else:
            f.seek(0, os.SEEK_END)
            f.write(b"x")
    with pytest.raises(SnapshotCorruptError, match="hash to|bytes, the snapshot records"):
        area.read(digest, len(data))
    gc.collect()
    if sys.platform.startswith("linux"):
        assert path not in _mapped_paths()


def test_a_missing_blob_is_refused(tmp_path):
    area, digest, path = _blob(tmp_path, b"abc")
    os.remove(path)
    with pytest.raises(SnapshotCorruptError, match="missing"):
        area.read(digest, 3)
