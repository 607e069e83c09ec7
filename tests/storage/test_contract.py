"""The storage contract: the same tests on the local filesystem, memory:// and a real S3-API
server (moto, over HTTP): every writer, snapshot + autoload, retention (exact listings),
corruption detection, crash-safe commit, small and multipart objects, concurrent listing."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch

import snapkeep
from snapkeep import writing
from snapkeep._core.storage import TEMP_MARKER
from snapkeep._core.store.files import SnapshotStore
from snapkeep.store import ppe_template
from snapkeep.training import ExtensionsManager, extensions
from support.storage_backends import PART_BYTES, Backend

TEMPLATE = "snap_iter_{.iteration}"
WAIT_S = 30.0

WRITERS = [
    pytest.param(writing.SimpleWriter, id="simple"),
    pytest.param(writing.ThreadWriter, id="thread"),
    pytest.param(writing.ProcessWriter, id="process"),
    pytest.param(writing.ThreadQueueWriter, id="thread-queue"),
    pytest.param(writing.ProcessQueueWriter, id="process-queue"),
]
PROCESS_WRITERS = (writing.ProcessWriter, writing.ProcessQueueWriter)


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)


def _run(backend: Backend, writer: Any, model: torch.nn.Module, **snapshot_kwargs: Any,
         ) -> tuple[ExtensionsManager, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 100, iters_per_epoch=10, writer=writer)
    snapshot_kwargs.setdefault("autoload", True)
    ext = extensions.snapshot(filename=TEMPLATE, **snapshot_kwargs)
    manager.extend(ext, trigger=(1, "iteration"))
    return manager, ext


def _train(manager: ExtensionsManager, model: torch.nn.Module, iterations: int) -> None:
    """Parameters equal the step number after each iteration."""
    for _ in range(iterations):
        with manager.run_iteration():
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(manager.iteration + 1))


def _params_equal(model: torch.nn.Module, value: float) -> bool:
    return all(bool((p == value).all()) for p in model.parameters())


def _resume(backend: Backend, **snapshot_kwargs: Any) -> tuple[ExtensionsManager, Any, Any]:
    model = _model()
    writer = writing.SimpleWriter(**backend.writer_kwargs())
    manager, ext = _run(backend, writer, model, **snapshot_kwargs)
    return manager, ext, model


def _skip_process_on_memory(backend: Backend, writer_cls: type) -> None:
    if backend.name == "memory" and writer_cls in PROCESS_WRITERS:
        pytest.skip("memory:// lives in one process (process writers refuse it; tested below)")


# -- each writer: snapshot, retention, autoload ----------------------------------------------------
@pytest.mark.parametrize("writer_cls", WRITERS)
def test_each_writer_snapshots_retains_and_autoloads(backend: Backend, writer_cls: type) -> None:
    _skip_process_on_memory(backend, writer_cls)
    model = _model()
    writer = writer_cls(**backend.writer_kwargs())
    manager, _ = _run(backend, writer, model, n_retains=2)
    _train(manager, model, 3)
    manager.finalize()

    assert backend.raw_names() == [".snapkeep/", "snap_iter_2", "snap_iter_3"]
    # local storages also hold the store's lock file there (see snapkeep._core.store.lock)
    manifests = [n for n in backend.raw_names(".snapkeep") if not n.endswith(".lock")]
    assert manifests == ["snap_iter_2.json", "snap_iter_3.json"]
    assert backend.pending_uploads() == []

    manager, ext, resumed = _resume(backend)
    assert not _params_equal(resumed, 3.0)  # differs before the load
    manager.start_extensions()
    assert ext.loaded_entry.name == "snap_iter_3"
    assert manager.iteration == 3
    assert _params_equal(resumed, 3.0)
    manager.finalize()


def test_process_writers_refuse_memory_filesystems() -> None:
    for cls in PROCESS_WRITERS:
        with pytest.raises(ValueError, match=r"memory://.*ThreadWriter"):
            cls(out_dir="memory://snapkeep-tests/refused")
        writer = cls()  # no out_dir yet: refused when the manager's out_dir arrives
        with pytest.raises(ValueError, match="cannot be shared with"):
            writer.initialize("memory://snapkeep-tests/refused")
        writer.finalize()


# -- corruption ------------------------------------------------------------------------------------
def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip(data: bytes) -> bytes:
    at = len(data) // 3
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


@pytest.mark.parametrize(("damage", "reason"), [(_truncate, "truncated"),
                                                (_flip, "does not match the recorded")],
                         ids=["truncated", "byte-flipped"])
def test_damaged_newest_is_detected_and_previous_loaded(
        backend: Backend, damage: Any, reason: str, capfd: pytest.CaptureFixture[str]) -> None:
    model = _model()
    manager, _ = _run(backend, writing.SimpleWriter(**backend.writer_kwargs()), model)
    _train(manager, model, 2)
    manager.finalize()
    newest = backend.read("snap_iter_2")
    backend.overwrite("snap_iter_2", damage(newest))
    assert backend.read("snap_iter_2") != newest

    manager, ext, resumed = _resume(backend)
    capfd.readouterr()
    manager.start_extensions()
    assert re.search(rf"^snapkeep: skipped snap_iter_2 \(step 2\): .*{reason}",
                     capfd.readouterr().err, re.MULTILINE)
    assert ext.loaded_entry.name == "snap_iter_1"
    assert manager.iteration == 1 and _params_equal(resumed, 1.0)
    assert backend.raw_names() == [".snapkeep/", "snap_iter_1", "snap_iter_2"]  # kept
    manager.finalize()


# -- crash-safe commit -----------------------------------------------------------------------------
class Boom(Exception):
    """The savefun failed mid-write."""


def _failing_savefun(obj: Any, f: Any) -> None:
    for _ in range(3):  # 12 MiB: on S3, parts are already uploaded when it fails
        f.write(b"\xab" * (4 << 20))
    raise Boom("savefun failed after 12 MiB")


@pytest.mark.parametrize("writer_cls", [writing.SimpleWriter, writing.ThreadWriter],
                         ids=["simple", "thread"])
def test_savefun_failing_mid_write_leaves_nothing_and_previous_intact(
    backend: Backend, writer_cls: type,
) -> None:
    writer = writer_cls(**backend.writer_kwargs())
    writer("snap_iter_1", "", {"w": torch.arange(10.0)}, step=1)
    writer.wait()
    before = backend.read("snap_iter_1")

    for name in ("snap_iter_1", "snap_iter_2"):  # overwriting an existing name, and a new one
        if writer_cls is writing.SimpleWriter:
            with pytest.raises(Exception) as info:
                writer(name, "", {"w": torch.zeros(10)}, savefun=_failing_savefun)
        else:
            writer(name, "", {"w": torch.zeros(10)}, savefun=_failing_savefun)
            with pytest.raises(snapkeep.SnapshotSaveError) as info:
                writer.wait(WAIT_S)
        chain = [info.value, info.value.__cause__, info.value.__context__]
        assert any(isinstance(e, Boom) for e in chain), chain
    writer.finalize()  # the failures were reported already: nothing raised twice

    assert backend.raw_names() == [".snapkeep/", "snap_iter_1"]
    assert not [n for n in backend.raw_names(".snapkeep") if TEMP_MARKER in n]
    assert backend.pending_uploads() == []
    assert backend.read("snap_iter_1") == before
    storage, path = backend.storage()
    catalog = SnapshotStore(storage, path, ppe_template(TEMPLATE))
    [entry] = catalog.entries()
    assert catalog.verify(entry) is not None


# -- object sizes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("size_bytes", [1 << 10, 2 * PART_BYTES + 12345], ids=["small", "large"])
def test_small_and_large_objects_commit_whole(backend: Backend, size_bytes: int) -> None:
    payload = bytes(range(256)) * (size_bytes // 256) + b"\x07" * (size_bytes % 256)
    writer = writing.SimpleWriter(**backend.writer_kwargs())
    writer("blob", "", payload, savefun=lambda obj, f: f.write(obj))
    writer.finalize()
    assert backend.read("blob") == payload
    if backend.name == "s3":  # one PUT for a small object, a completed multipart upload else
        storage, _ = backend.storage()
        etag = storage.fs.info(backend.path("blob"), refresh=True)["ETag"]
        assert ("-" in etag) == (size_bytes > PART_BYTES), etag
    assert backend.pending_uploads() == []


# -- concurrent listing ----------------------------------------------------------------------------
def test_listing_while_a_writer_writes_never_shows_a_partial(backend: Backend) -> None:
    half_written, release = threading.Event(), threading.Event()

    def slow_savefun(obj: Any, f: Any) -> None:
        f.write(b"\x01" * (PART_BYTES + (1 << 20)))  # S3: the first part is uploaded
        half_written.set()
        if not release.wait(WAIT_S):
            raise TimeoutError("the test never released the save")
        f.write(b"\x02" * (1 << 20))

    writer = writing.ThreadWriter(**backend.writer_kwargs())
    writer("snap_iter_1", "", {"w": torch.ones(3)}, step=1)
    writer.wait(WAIT_S)
    storage, path = backend.storage()
    catalog = SnapshotStore(storage, path, ppe_template(TEMPLATE))
    try:
        writer("snap_iter_2", "", {"w": torch.ones(3)}, savefun=slow_savefun, step=2)
        assert half_written.wait(WAIT_S)
        assert storage.list_names(path) == ["snap_iter_1"]
        assert [e.name for e in catalog.entries()] == ["snap_iter_1"]
        raw = [n for n in backend.raw_names() if n != ".snapkeep/"]
        if backend.name == "local":  # the temp file exists, under a reserved name only
            assert raw[1:] == ["snap_iter_1"] and TEMP_MARKER in raw[0]
        else:
            assert raw == ["snap_iter_1"]
        if backend.name == "s3":  # parts are on the server, invisible until completed
            assert len(backend.pending_uploads()) == 1
    finally:
        release.set()
    writer.wait(WAIT_S)
    writer.finalize()
    assert [e.name for e in catalog.entries()] == ["snap_iter_1", "snap_iter_2"]
    assert len(backend.read("snap_iter_2")) == PART_BYTES + (2 << 20)
    assert backend.pending_uploads() == []
