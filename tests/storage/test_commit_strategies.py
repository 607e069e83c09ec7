"""Commit strategies: which backend gets which, the injection seam, and a backend whose upload
fails after N bytes inside ``torch.save`` (which hides the cause behind a RuntimeError)."""

from __future__ import annotations

from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import snapkeep
from snapkeep._core.storage import (
    ObjectPutCommit,
    PfioFileSystem,
    RenameCommit,
    ReplaceCommit,
    Storage,
    Target,
    WriteResult,
    commit_strategy_for,
)


class _Pfio:
    def open(self, path: str, mode: str) -> Any: ...
    def list(self, path: str) -> Any: ...
    def stat(self, path: str) -> Any: ...
    def makedirs(self, path: str, exist_ok: bool = False) -> None: ...
    def exists(self, path: str) -> bool: ...
    def rename(self, src: str, dst: str) -> None: ...
    def remove(self, path: str) -> None: ...


def _s3(**options: Any) -> Any:
    s3fs = pytest.importorskip("s3fs")
    return s3fs.S3FileSystem(key="k", secret="s", skip_instance_cache=True, **options)


@pytest.mark.parametrize(("make_fs", "strategy", "spill_bytes"), [
    (lambda: fsspec.filesystem("file"), ReplaceCommit, None),
    (lambda: fsspec.filesystem("memory"), ObjectPutCommit, None),
    (lambda: _s3(), ObjectPutCommit, 50 << 20),
    (lambda: _s3(default_block_size=8 << 20), ObjectPutCommit, 8 << 20),
    (lambda: _s3(default_block_size=1 << 20), ObjectPutCommit, 5 << 20),  # S3's minimum part
    (lambda: PfioFileSystem(_Pfio()), RenameCommit, None),
], ids=["local", "memory", "s3", "s3-8MiB-blocks", "s3-tiny-blocks", "pfio"])
def test_each_backend_gets_its_commit_strategy(make_fs: Any, strategy: type,
                                               spill_bytes: int | None) -> None:
    chosen = commit_strategy_for(make_fs())
    assert type(chosen) is strategy
    assert getattr(chosen, "spill_bytes", None) == spill_bytes


def test_storage_delegates_every_commit_to_an_injected_strategy() -> None:
    calls: list[Target] = []

    class Recording:
        real_directories = False

        def write(self, fs: Any, target: Target, write_fn: Any) -> WriteResult:
            calls.append(target)
            return WriteResult(path=target.path, size_bytes=0, checksum="")

    storage = Storage(fsspec.filesystem("memory"), Recording())
    storage.write_bytes("/strategy-seam/a", b"x", tag="tg")
    [target] = calls
    assert target.path == "/strategy-seam/a" and target.url == "memory:///strategy-seam/a"
    assert target.temp_path.startswith("/strategy-seam/.a.snapkeep-tmp.")  # beside it, marked
    assert storage.list_names("/strategy-seam") == []  # the strategy wrote nothing


class _FlakyFile:
    """An upload that loses its connection after ``limit`` bytes; commit/discard recorded."""

    def __init__(self, limit: int) -> None:
        self.limit, self.sent = limit, 0
        self.committed = self.discarded = self.closed = False

    def write(self, data: Any) -> int:
        n = len(memoryview(data))
        if self.sent + n > self.limit:
            raise ConnectionResetError(104, "Connection reset by peer")
        self.sent += n
        return n

    def close(self) -> None:
        self.closed = True

    def commit(self) -> None:
        self.committed = True

    def discard(self) -> None:
        self.discarded = True


class _FlakyFS(MemoryFileSystem):  # type: ignore[misc]
    protocol = "flaky"
    cachable = False

    def __init__(self, limit: int) -> None:
        super().__init__(global_store=False)
        self.limit = limit
        self.uploads: list[_FlakyFile] = []

    def _open(self, path: str, mode: str = "rb", autocommit: bool = True, **kwargs: Any) -> Any:
        if "w" in mode and not autocommit:
            self.uploads.append(_FlakyFile(self.limit))
            return self.uploads[-1]
        return super()._open(path, mode, autocommit=autocommit, **kwargs)


def test_upload_dropped_inside_torch_save_surfaces_its_real_cause() -> None:
    fs = _FlakyFS(limit=3 << 20)
    storage = Storage(fs, ObjectPutCommit(spill_bytes=1 << 20))
    state = {f"w{i}": torch.zeros(1 << 18) for i in range(8)}  # 8 tensors of 1 MiB

    with pytest.raises(snapkeep.SnapshotStorageError) as info:
        storage.write("/flaky/snap", lambda f: torch.save(state, f))
    assert isinstance(info.value.__cause__, ConnectionResetError)  # not torch's RuntimeError
    assert "flaky:///flaky/snap" in str(info.value) and "reachable" in str(info.value)
    assert info.value.size_bytes is not None and 2 << 20 < info.value.size_bytes <= 3 << 20
    [upload] = fs.uploads
    assert upload.discarded and not upload.committed
    assert upload.closed  # marked closed: a finalizer cannot complete the discarded upload
    assert storage.list_names("/flaky") == []


def test_small_file_is_one_put_and_never_opens_an_upload() -> None:
    fs = _FlakyFS(limit=0)
    storage = Storage(fs, ObjectPutCommit(spill_bytes=1 << 20))
    result = storage.write_bytes("/flaky/small", b"abc")
    assert fs.uploads == [] and storage.read_bytes("/flaky/small") == b"abc"
    assert result.size_bytes == 3
