"""The store contract (``snapkeep._core.store.contract``), run for each kind x storage: single files
and sharded (DCP) directories, on the local filesystem, ``memory://`` and a real S3-API server
(moto over HTTP). Each test is a guarantee of ``docs/guarantees.md`` or a fault measured in issue
17, asserted the same way for every kind:

- resume: the newest valid snapshot, by step; ``load_latest`` and ``verify`` pick the same one;
- on-error: the mid-iteration snapshot gets the on-error name, never replaces the clean one of
  its step, and is never resumed;
- two trainers: the second one on the same out_dir and template is refused (local storages; the
  lock is shared by both kinds);
- foreign files and directories (a complete DCP checkpoint snapkeep did not write) survive
  training, retention and the start-up sweep; snapkeep's own crashed work is swept;
- junk files (random bytes, an object store's XML error body) are corrupt: skipped, the next
  older snapshot loads; misnamed copies (``cp snapshot_iter_2 snapshot_iter_9``) too;
- hostile metadata (a pickle calling ``os.system``) is unsafe: refused, nothing executed, no
  fallback, and the message says unsafe;
- mixed kinds under one template: refused at start, naming both;
- listings: at most one listing of out_dir per snapshot, none between snapshots.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import snapkeep
from snapkeep import writing
from snapkeep.errors import SnapshotError, StoreLockedError, UnsafeSnapshotError
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext
from support.storage_backends import Backend

TEMPLATE = "snapshot_iter_{.iteration}"
KINDS = ["file", "sharded"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _snapshot(kind: str, **kwargs: Any) -> Any:
    if kind == "sharded":
        return ext.snapshot(filename=TEMPLATE, snapshot_mode=ext.SnapshotMode.SHARDED, **kwargs)
    return ext.snapshot(filename=TEMPLATE, **kwargs)


def _manager(backend: Backend, kind: str, *, fs: Any = None, trigger: Any = (1, "iteration"),
             **kwargs: Any) -> tuple[ExtensionsManager, torch.nn.Module, Any]:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer_kwargs = backend.writer_kwargs() if fs is None else {"out_dir": backend.out_dir,
                                                                "fs": fs}
    manager = ExtensionsManager(model, optimizer, 100, iters_per_epoch=10,
                                out_dir=backend.out_dir,
                                writer=writing.SimpleWriter(**writer_kwargs))
    kwargs.setdefault("autoload", True)
    snapshot = _snapshot(kind, **kwargs)
    manager.extend(snapshot, trigger=trigger)
    return manager, model, snapshot


def _train(manager: ExtensionsManager, model: torch.nn.Module, until: int) -> None:
    """Parameters equal the iteration number after each iteration."""
    while manager.iteration < until:
        with manager.run_iteration():
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(manager.iteration + 1))


def _run(backend: Backend, kind: str, until: int, **kwargs: Any) -> tuple[Any, Any, Any]:
    manager, model, snapshot = _manager(backend, kind, **kwargs)
    manager.start_extensions()
    _train(manager, model, until)
    manager.finalize()
    return manager, model, snapshot


def _resumed_step(backend: Backend, kind: str) -> tuple[int, float]:
    """(iteration, parameter value) of a fresh trainer after autoload."""
    manager, model, _ = _manager(backend, kind)
    manager.start_extensions()
    try:
        return manager.iteration, float(next(model.parameters()).flatten()[0])
    finally:
        manager.finalize()


def _names(backend: Backend) -> list[str]:
    return sorted(n.rstrip("/") for n in backend.raw_names())


def _latest_step(backend: Backend) -> int:
    state = snapkeep.load_latest(backend.out_dir, template=TEMPLATE,
                                 storage_options=backend.storage_options or None)
    if "_start_iteration" in state:
        return int(state["_start_iteration"])
    # sharded: the manager's state, saved by each rank as torch.save bytes
    manager_state = torch.load(io.BytesIO(state["rank_objects"]["rank0"]["manager"]),
                               weights_only=True)
    return int(manager_state["_start_iteration"])


def _copy(backend: Backend, src: str, dst: str) -> None:
    storage, _ = backend.storage()
    storage.fs.copy(backend.path(src), backend.path(dst), recursive=True)


def _put(backend: Backend, name: str, data: bytes) -> None:
    storage, _ = backend.storage()
    path = backend.path(name)
    storage.makedirs(storage.dirname(path))
    storage.fs.pipe_file(path, data)


# -- resume ----------------------------------------------------------------------------------


def test_resume_load_latest_and_verify_agree_on_the_newest(backend: Backend, kind: str) -> None:
    _run(backend, kind, 3)
    assert [n for n in _names(backend) if n.startswith("snapshot_")] == [
        "snapshot_iter_1", "snapshot_iter_2", "snapshot_iter_3"]
    assert _resumed_step(backend, kind) == (3, 3.0)
    assert _latest_step(backend) == 3
    from click.testing import CliRunner

    from snapkeep.cli import cli
    options = [f"--storage-option={k}={json.dumps(v) if not isinstance(v, str) else v}"
               for k, v in backend.storage_options.items()
               if k in ("key", "secret", "endpoint_url")]
    result = CliRunner().invoke(cli, ["verify", backend.out_dir, *options])
    assert result.exit_code == 0, result.output
    assert "autoload would resume from snapshot_iter_3" in result.output


# -- on-error ----------------------------------------------------------------------------------


def test_on_error_snapshot_never_replaces_the_clean_one_nor_is_resumed(
        backend: Backend, kind: str) -> None:
    manager, model, _ = _manager(backend, kind, snapshot_on_error=True)
    manager.start_extensions()
    _train(manager, model, 2)  # snapshot_iter_2 holds the clean state (2.0)
    with pytest.raises(RuntimeError, match="boom"):
        with manager.run_iteration():  # the body of the 3rd iteration: iteration still 2
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(99.0)  # mid-iteration state
            raise RuntimeError("boom")
    names = [n for n in _names(backend) if n.startswith("snapshot_")]
    assert names == ["snapshot_iter_1", "snapshot_iter_2", "snapshot_iter_2.on-error"]
    assert _resumed_step(backend, kind) == (2, 2.0)  # the clean state, not the 99s
    assert _latest_step(backend) == 2


# -- two trainers ----------------------------------------------------------------------------

_HOLD_LOCK = """
import sys
from snapkeep.store import open_store, ppe_template
lock = open_store(sys.argv[1], ppe_template(sys.argv[2])).lock()
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def lock_holder(tmp_path: Any) -> Iterator[Any]:
    """Starts a process holding the store lock of a directory; stopped at the end."""
    processes: list[subprocess.Popen[str]] = []

    def hold(directory: str) -> None:
        process = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, directory, TEMPLATE],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        processes.append(process)
        assert process.stdout is not None and process.stdout.readline().strip() == "locked"

    yield hold
    for process in processes:
        process.communicate(timeout=30)  # closing stdin lets it exit


def test_a_second_trainer_on_the_same_directory_is_refused(
        backend: Backend, kind: str, lock_holder: Any) -> None:
    if backend.name != "local":
        pytest.skip("object stores have no lock (docs/guarantees.md says so)")
    os.makedirs(backend.out_dir)
    lock_holder(backend.out_dir)
    manager, model, _ = _manager(backend, kind)
    with pytest.raises(StoreLockedError, match="pid"):
        manager.start_extensions()
    assert [n for n in _names(backend) if n.startswith("snapshot_")] == []


# -- foreign and own leftovers ---------------------------------------------------------------


def _foreign_dcp_checkpoint(backend: Backend, name: str) -> None:
    """A complete DCP checkpoint written by someone else (no snapkeep marker) named ``name``."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp, no_dist=True)
        storage, _ = backend.storage()
        for file in os.listdir(tmp):
            with open(os.path.join(tmp, file), "rb") as f:
                _put(backend, f"{name}/{file}", f.read())


def test_foreign_files_and_directories_survive_and_own_crashed_work_is_swept(
        backend: Backend, kind: str) -> None:
    storage, _ = backend.storage()
    _put(backend, "notes.txt", b"mine")
    _put(backend, "snapshot_iter_7.bak", b"mine too")
    foreign_dir = "snapshot_iter_50" if kind == "sharded" else "someone_elses_dcp"
    _foreign_dcp_checkpoint(backend, foreign_dir)
    if kind == "sharded":  # snapkeep's own crashed save: the in-progress mark, no marker
        _put(backend, "snapshot_iter_60/.snapkeep-in-progress", b"")
        _put(backend, "snapshot_iter_60/__0_0.distcp", b"partial")
    _run(backend, kind, 3, n_retains=1)
    names = _names(backend)
    assert {"notes.txt", "snapshot_iter_7.bak", foreign_dir, "snapshot_iter_3"} <= set(names)
    assert "snapshot_iter_60" not in names and "snapshot_iter_1" not in names
    assert storage.exists(storage.join(backend.path(foreign_dir), ".metadata"))
    assert _resumed_step(backend, kind) == (3, 3.0)  # the foreign one is never resumed


# -- junk, misnamed and hostile files ----------------------------------------------------------

JUNK = {
    "random": os.urandom(4096),
    "xml": b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
           b"<Message>Please reduce your request rate.</Message></Error>",
}


def _plant(backend: Backend, kind: str, name: str, data: bytes) -> None:
    """A snapshot named ``name`` whose content (the file, or the sharded ``.metadata`` with a
    marker that matches it) is ``data``."""
    if kind == "file":
        _put(backend, name, data)
        return
    from snapkeep._core.format.checksum import digest_stream

    _copy(backend, "snapshot_iter_2", name)
    storage, _ = backend.storage()
    _put(backend, f"{name}/.metadata", data)
    marker_path = f"{name}/.snapkeep-commit.json"
    marker = json.loads(backend.read(marker_path))
    digest, size = digest_stream(io.BytesIO(data))
    marker["files"][".metadata"].update(checksum=digest, size_bytes=size)
    marker["name"] = name
    _put(backend, marker_path, json.dumps(marker).encode())


@pytest.mark.parametrize("junk", sorted(JUNK))
def test_junk_is_corrupt_and_the_next_older_snapshot_loads(
        backend: Backend, kind: str, junk: str) -> None:
    _run(backend, kind, 2)
    _plant(backend, kind, "snapshot_iter_9", JUNK[junk])
    with pytest.warns(RuntimeWarning, match=r"snapshot_iter_9|corrupt") as warned:
        assert _latest_step(backend) == 2
    assert not any("weights_only=False" in str(w.message) for w in warned)
    assert _resumed_step(backend, kind) == (2, 2.0)


def test_a_misnamed_copy_is_skipped_by_every_reader(backend: Backend, kind: str) -> None:
    _run(backend, kind, 3)
    _copy(backend, "snapshot_iter_2", "snapshot_iter_9")  # cp snapshot_iter_2 snapshot_iter_9
    assert _resumed_step(backend, kind) == (3, 3.0)
    with pytest.warns(RuntimeWarning, match="snapshot_iter_9"):
        assert _latest_step(backend) == 3


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch snapkeep-contract-pwned",))


def test_hostile_metadata_is_refused_as_unsafe_and_nothing_runs(
        backend: Backend, kind: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(backend, kind, 2)
    monkeypatch.chdir(tmp_path)
    if kind == "file":
        buffer = io.BytesIO()
        torch.save({"x": _Boom()}, buffer)
        hostile = buffer.getvalue()
    else:
        storage, _ = backend.storage()
        metadata = pickle.loads(backend.read("snapshot_iter_2/.metadata"))  # noqa: S301 (ours)
        metadata.planner_data = _Boom()
        hostile = pickle.dumps(metadata)
    _plant(backend, kind, "snapshot_iter_9", hostile)
    for read in (lambda: _latest_step(backend), lambda: _resumed_step(backend, kind)):
        with pytest.raises(UnsafeSnapshotError, match=r"unsafe.*weights_only=False"):
            read()
    assert not (tmp_path / "snapkeep-contract-pwned").exists()


# -- one kind per template -------------------------------------------------------------------


def test_mixed_kinds_under_one_template_are_refused_at_start(backend: Backend, kind: str) -> None:
    other = "sharded" if kind == "file" else "file"
    _run(backend, other, 1)
    manager, model, _ = _manager(backend, kind)
    with pytest.raises((ValueError, SnapshotError),
                       match=r"single-file snapshots.*sharded|sharded.*single-file"):
        manager.start_extensions()
    assert [n for n in _names(backend) if n.startswith("snapshot_")] == ["snapshot_iter_1"]


# -- listings --------------------------------------------------------------------------------


class CountingFileSystem(MemoryFileSystem):
    """``memory://`` that counts listings per path (what object stores bill and throttle)."""

    protocol = "countingmem"
    listings: dict[str, int] = {}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        key = "/" + str(path).split("://", 1)[-1].strip("/")
        CountingFileSystem.listings[key] = CountingFileSystem.listings.get(key, 0) + 1
        return super().ls(path, detail=detail, **kwargs)


def test_a_start_up_lists_out_dir_once_and_no_snapshot_lists_it(kind: str) -> None:
    fsspec.register_implementation(CountingFileSystem.protocol, CountingFileSystem,
                                   clobber=True)
    run = f"/counting-{kind}-{os.getpid()}"
    backend = Backend("memory", f"countingmem://{run}", {})
    try:
        manager, model, _ = _manager(backend, kind, n_retains=2, trigger=(2, "iteration"))
        manager.start_extensions()
        counts, total = [], 0
        for _ in range(6):
            CountingFileSystem.listings.clear()
            _train(manager, model, manager.iteration + 1)
            counts.append(CountingFileSystem.listings.get(run, 0))
            total += counts[-1]
        CountingFileSystem.listings.clear()
        manager.finalize()  # the sharded kind commits (and retains) on a background thread
        total += CountingFileSystem.listings.get(run, 0)
        assert total == 0, counts  # 3 snapshots (iterations 2, 4, 6) with retention: none
        # a restart on those snapshots: the store's start-up (kind check, sweep, autoload)
        # lists out_dir once and keeps it up to date through its saves and deletes
        manager, model, _ = _manager(backend, kind, n_retains=2, trigger=(2, "iteration"))
        CountingFileSystem.listings.clear()
        manager.start_extensions()
        assert manager.iteration == 6
        assert CountingFileSystem.listings.get(run, 0) == 1
        CountingFileSystem.listings.clear()
        _train(manager, model, 10)
        manager.finalize()
        assert CountingFileSystem.listings.get(run, 0) == 0  # two more snapshots, no listing
        assert [n for n in _names(backend) if n.startswith("snapshot_")] == [
            "snapshot_iter_10", "snapshot_iter_8"]  # retention kept the newest two
    finally:
        storage, path = backend.storage()
        if storage.fs.exists(path):
            storage.fs.rm(path, recursive=True)


@pytest.mark.parametrize("storage", ["local", "memory"])
def test_a_single_file_start_up_lists_out_dir_once_and_never_between_snapshots(
        storage: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kind check, temp sweep, orphan sweep and autoload share one listing of out_dir (and one
    of its manifest directory); commits and retention's deletes keep it up to date, so no
    snapshot lists again. Counted at fsspec's ``ls``, through which every listing goes."""
    from fsspec.implementations.local import LocalFileSystem

    listings: dict[str, int] = {}
    for cls in (LocalFileSystem, MemoryFileSystem):
        def ls(self: Any, path: str, detail: bool = True, _ls: Any = cls.ls, **kw: Any) -> Any:
            key = "/" + str(path).split("://", 1)[-1].strip("/")
            listings[key] = listings.get(key, 0) + 1
            return _ls(self, path, detail=detail, **kw)
        monkeypatch.setattr(cls, "ls", ls)
    run = f"listings-{os.getpid()}-{storage}"
    backend = Backend("local", str(tmp_path / run), {}) if storage == "local" \
        else Backend("memory", f"memory://snapkeep-tests/{run}", {})
    out = "/" + backend.out_dir.split("://", 1)[-1].strip("/")
    manifests = out + "/.snapkeep"
    try:
        for start in (0, 6):  # a fresh run, then a restart that autoloads and keeps going
            manager, model, _ = _manager(backend, "file", n_retains=2)
            listings.clear()
            manager.start_extensions()
            assert manager.iteration == start
            assert (listings.get(out, 0), listings.get(manifests, 0)) == (1, 1), listings
            per_snapshot = []
            for _ in range(6):
                listings.clear()
                _train(manager, model, manager.iteration + 1)
                per_snapshot.append(listings.get(out, 0) + listings.get(manifests, 0))
            listings.clear()
            manager.finalize()
            assert per_snapshot == [0] * 6 and listings.get(out, 0) == 0, per_snapshot
            names = [n for n in _names(backend) if n.startswith("snapshot_")]
            assert names == [f"snapshot_iter_{start + 5}", f"snapshot_iter_{start + 6}"]
            assert sorted(n for n in backend.raw_names(".snapkeep") if n.endswith(".json")) \
                == [f"{n}.json" for n in names]  # retention deleted the manifests with them
    finally:
        storage_, path = backend.storage()
        if storage_.fs.exists(path):
            storage_.fs.rm(path, recursive=True)


def test_convert_reads_a_sharded_directory_safely(tmp_path: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``snapkeep convert DIR out.pt`` of a DCP directory: its metadata through the allow-list
    (hostile: refused as unsafe, nothing runs, nothing written); junk metadata: corrupt."""
    from click.testing import CliRunner

    from snapkeep.cli import cli

    backend = Backend("local", str(tmp_path / "run"), {})
    _run(backend, "sharded", 2)
    monkeypatch.chdir(tmp_path)
    metadata = pickle.loads(backend.read("snapshot_iter_2/.metadata"))  # noqa: S301 (ours)
    good = CliRunner().invoke(cli, ["convert", backend.path("snapshot_iter_2"), "good.pt"])
    assert good.exit_code == 0, good.output
    assert "models" in torch.load(tmp_path / "good.pt", weights_only=True)
    metadata.planner_data = _Boom()
    _put(backend, "snapshot_iter_2/.metadata", pickle.dumps(metadata))
    bad = CliRunner().invoke(cli, ["convert", backend.path("snapshot_iter_2"), "bad.pt"])
    assert bad.exit_code == 1 and "unsafe" in bad.output and "--unsafe" in bad.output
    assert not (tmp_path / "snapkeep-contract-pwned").exists()
    assert not (tmp_path / "bad.pt").exists()
    _put(backend, "snapshot_iter_2/.metadata", JUNK["xml"])
    junk = CliRunner().invoke(cli, ["convert", backend.path("snapshot_iter_2"), "junk.pt"])
    assert junk.exit_code == 1 and "corrupt" in junk.output and "unsafe" not in junk.output


def test_both_kinds_implement_the_store_protocol(backend: Backend) -> None:
    from snapkeep.distributed import ShardedStore
    from snapkeep.store import SnapshotStore, StoreKind, ppe_template

    storage, path = backend.storage()
    for store in (SnapshotStore(storage, path, ppe_template(TEMPLATE)),
                  ShardedStore(storage, path, ppe_template(TEMPLATE))):
        assert isinstance(store, StoreKind), type(store).__name__
        store.check_kind()
        assert store.entries() == [] and store.sweep() == []
