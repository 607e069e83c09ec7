"""ppe/pfio-style ``fs=`` objects: adapted to fsspec, committed by temp name + rename (never a
rename of the old file away), listed without temps, picklable; a wrong object is named."""

from __future__ import annotations

import os
import pickle
import stat
from typing import Any

import pytest
import torch

from snapkeep import writing
from snapkeep._core.storage import TEMP_MARKER, PfioFileSystem, RenameCommit, resolve_storage
from snapkeep._core.store.files import SnapshotStore
from snapkeep.training import ExtensionsManager, extensions


class FileStat:
    """pfio-like stat result."""

    def __init__(self, st: os.stat_result) -> None:
        self.size = st.st_size
        self.mode = st.st_mode
        self.last_modified = st.st_mtime

    def isdir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class RootedPfio:
    """A pfio-style filesystem rooted at a local directory (paths are relative to the root, for
    every operation); it records the renames it performs."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.renames: list[tuple[str, str]] = []

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path)

    def open(self, path: str, mode: str = "rb") -> Any:
        return open(self._p(path), mode)  # noqa: SIM115 (the caller closes it)

    def list(self, path: str = "") -> Any:
        for entry in os.scandir(self._p(path)):
            yield entry.name + ("/" if entry.is_dir() else "")

    def stat(self, path: str) -> FileStat:
        return FileStat(os.stat(self._p(path)))

    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        os.makedirs(self._p(path), mode, exist_ok)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._p(path))

    def rename(self, src: str, dst: str) -> None:
        self.renames.append((src, dst))
        os.replace(self._p(src), self._p(dst))

    def remove(self, path: str, recursive: bool = False) -> None:
        os.remove(self._p(path))


def _listing(root: Any, sub: str = "run") -> list[str]:
    return sorted(os.listdir(os.path.join(root, sub)))


def test_pfio_objects_commit_by_temp_and_rename(tmp_path: Any) -> None:
    fs = RootedPfio(str(tmp_path))
    storage, path = resolve_storage("run", fs)
    assert isinstance(storage.fs, PfioFileSystem) and isinstance(storage.strategy, RenameCommit)

    model = torch.nn.Linear(4, 3)
    writer = writing.ThreadWriter(fs=fs, out_dir="run")
    manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 100,
                                iters_per_epoch=10, writer=writer)
    manager.extend(extensions.snapshot(filename="snap_iter_{.iteration}", n_retains=2),
                   trigger=(1, "iteration"))
    for _ in range(3):
        with manager.run_iteration(), torch.no_grad():
            model.weight.fill_(float(manager.iteration + 1))
    manager.finalize()

    assert _listing(tmp_path) == [".snapkeep", "snap_iter_2", "snap_iter_3"]
    assert _listing(tmp_path, "run/.snapkeep") == ["snap_iter_2.json", "snap_iter_3.json"]
    # every commit is one rename of a reserved temp name onto the final name (data, manifest)
    finals = [dst for _, dst in fs.renames]
    assert finals == [f"run/{d}snap_iter_{i}{ext}" for i in (1, 2, 3)
                      for d, ext in (("", ""), (".snapkeep/", ".json"))]
    for src, dst in fs.renames:
        assert os.path.dirname(src) == os.path.dirname(dst) and TEMP_MARKER in src

    model2 = torch.nn.Linear(4, 3)
    manager = ExtensionsManager(model2, torch.optim.SGD(model2.parameters(), lr=0.1), 100,
                                iters_per_epoch=10, writer=writing.SimpleWriter(fs=fs,
                                                                                out_dir="run"))
    ext = extensions.snapshot(filename="snap_iter_{.iteration}", autoload=True)
    manager.extend(ext, trigger=(1, "iteration"))
    manager.start_extensions()
    assert ext.loaded_entry.name == "snap_iter_3" and bool((model2.weight == 3.0).all())


def test_pfio_failed_write_leaves_no_temp_and_keeps_the_previous(tmp_path: Any) -> None:
    fs = RootedPfio(str(tmp_path))
    storage, path = resolve_storage("run", fs)
    storage.makedirs(path)
    storage.write_bytes("run/snap", b"old")
    seen: dict[str, Any] = {}

    def failing(f: Any) -> None:
        f.write(b"new partial")
        seen["raw"] = _listing(tmp_path)
        seen["listed"] = storage.list_names(path)
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        storage.write("run/snap", failing)
    assert len(seen["raw"]) == 2 and TEMP_MARKER in seen["raw"][0]  # the temp existed ...
    assert seen["listed"] == ["snap"]  # ... and was never listed
    assert _listing(tmp_path) == ["snap"]
    assert (tmp_path / "run" / "snap").read_bytes() == b"old"
    assert SnapshotStore(storage, path, "snap").entries()[0].name == "snap"


def test_pfio_filesystem_pickles_with_its_object(tmp_path: Any) -> None:
    fs = RootedPfio(str(tmp_path))
    storage, path = resolve_storage("run", fs)
    storage.makedirs(path)
    storage.write_bytes("run/a", b"1")
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.list_names(path) == ["a"] and copy.read_bytes("run/a") == b"1"
    assert isinstance(copy.strategy, RenameCommit)


def test_pfio_filesystem_is_not_shared_through_fsspec_instance_cache(tmp_path: Any) -> None:
    a, b = RootedPfio(str(tmp_path / "a")), RootedPfio(str(tmp_path / "b"))
    assert PfioFileSystem(a).obj is a and PfioFileSystem(b).obj is b


def test_an_object_that_is_not_a_filesystem_is_named() -> None:
    class Half:
        def open(self, path: str, mode: str) -> None: ...
        def exists(self, path: str) -> bool: ...

    with pytest.raises(TypeError, match=r"Half.*lacks list, stat, makedirs, rename, remove"):
        resolve_storage("run", Half())


def test_ppe_posix_filesystem_with_absolute_paths(tmp_path: Any) -> None:
    ppe_writing = pytest.importorskip("pytorch_pfn_extras.writing._writer_base")
    fs = ppe_writing._PosixFileSystem()
    out = str(tmp_path / "run")
    writer = writing.SimpleWriter(fs=fs, out_dir=out)
    writer("snap_iter_1", "", {"w": torch.ones(2)}, step=1)
    writer("snap_iter_1", "", {"w": torch.full((2,), 2.0)}, step=1)  # overwrite by rename
    writer.finalize()
    assert sorted(os.listdir(out)) == [".snapkeep", "snap_iter_1"]
    assert torch.load(os.path.join(out, "snap_iter_1"))["w"].tolist() == [2.0, 2.0]
