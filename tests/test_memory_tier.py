"""The memory tier in one process: RAM commits every K iterations into a tmpfs-like directory
(tmp_path, never /dev/shm), a restart resumes from RAM without opening a storage snapshot and
persists the newer RAM step to storage first, a corrupt RAM copy falls through to storage, a
too-small filesystem is refused at start naming the size, a finished run removes its tier and a
dead job's tier is reclaimed. The node-RAM store itself (:class:`MemoryStore`) is checked
against the store contract's steps (kind, lock, sweep, entries, manifest, delete, retention)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from snapkeep import writing
from snapkeep._core.storage._temps import TEMP_MARKER, base36, temp_basename
from snapkeep._core.tiers.memory_store import (
    MemoryStore,
    describe_tiers,
    job_id,
    reclaim_stale,
    tier_dir,
    write_owner,
)
from snapkeep.errors import MemoryTierTooSmallError, SnapshotCorruptError, SnapshotSaveError
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

TEMPLATE = "snapshot_iter_{.iteration}"


def _manager(out: Path, root: Path, *, every: int = 2, storage_every: int = 3,
             model: torch.nn.Module | None = None) -> tuple[ExtensionsManager, torch.nn.Module]:
    manager, model, _ = _with_tier(out, root, every=every, storage_every=storage_every,
                                   model=model)
    return manager, model


def _with_tier(out: Path, root: Path, *, every: int = 2, storage_every: int = 3,
               model: torch.nn.Module | None = None) -> tuple[ExtensionsManager, torch.nn.Module,
                                                               Any]:
    torch.manual_seed(0)
    model = model if model is not None else torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=8, out_dir=str(out),
                                writer=writing.SimpleWriter(out_dir=str(out)))
    manager.extend(ext.snapshot(filename=TEMPLATE, autoload=True),
                   trigger=(storage_every, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=every, replicas=0, root=str(root)))
    manager.extend(tier)
    return manager, model, tier


def _step(manager: ExtensionsManager, model: torch.nn.Module) -> None:
    optimizer = manager.optimizers["main"]
    g = torch.Generator().manual_seed(manager.iteration)
    x = torch.randn(8, 4, generator=g)
    with manager.run_iteration():
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()


def _train(manager: ExtensionsManager, model: torch.nn.Module, until: int) -> None:
    manager.start_extensions()
    while manager.iteration < until:
        _step(manager, model)


def _killed_at(out: Path, root: Path, until: int, **kwargs: Any,
               ) -> tuple[ExtensionsManager, torch.nn.Module]:
    """A run trained to ``until`` whose process then "dies" (no finalize) after its last RAM
    snapshot was committed (the commit runs in the background: waited for here)."""
    manager, model, tier = _with_tier(out, root, **kwargs)
    _train(manager, model, until)
    tier.wait()
    return manager, model


class _StorageReads:
    """Snapshot data files that were under ``out`` when it was made, opened for reading (an
    audit hook on ``open``; hooks cannot be removed, so it records only while ``active``).
    Manifests and markers are not counted, nor what the persist-at-breakpoint write of the RAM
    step creates (it reads its own new manifest back for retention)."""

    hooks: list[_StorageReads] = []

    def __init__(self, out: Path) -> None:
        self.out = str(out)
        self.saved = {os.path.join(d, n) for d, _, names in os.walk(out) for n in names}
        self.reads: list[str] = []
        self.active = True
        if not _StorageReads.hooks:
            sys.addaudithook(_StorageReads._hook)
        _StorageReads.hooks.append(self)

    @staticmethod
    def _hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "open":
            return
        path, mode, flags = args
        if not isinstance(path, (str, bytes, os.PathLike)):
            return
        path = os.fsdecode(path)
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and flags & (os.O_WRONLY | os.O_RDWR))
        for recorder in _StorageReads.hooks:
            if recorder.active and path in recorder.saved and not writes \
                    and "snapshot_iter_" in path and "/.snapkeep/" not in path \
                    and not path.endswith(".snapkeep-commit.json"):
                recorder.reads.append(path)


def test_configuration_errors_name_the_argument() -> None:
    for kwargs, word in (({"every": 0}, "every"), ({"every": 2, "replicas": -1}, "replicas"),
                         ({"every": 2, "stride": 0}, "stride"),
                         ({"every": 2, "root": "s3://b/x"}, "root"),
                         ({"every": 2, "timeout_s": 0}, "timeout_s"),
                         ({"every": True}, "every")):
        with pytest.raises(ValueError, match=word):
            ext.MemoryTier(**kwargs)
    with pytest.raises(TypeError, match="MemoryTier"):
        ext.memory_tier(3)  # type: ignore[arg-type]


def test_restart_resumes_from_ram_reads_no_storage_and_persists_first(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model = _killed_at(out, root, 5)  # RAM at 2, 4; storage at 3; then it "dies"
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    job = job_id(str(out), TEMPLATE)
    assert [e.step for e in MemoryStore(str(root), job, 0).entries()] == [4]  # newest alone
    assert sorted(os.listdir(out)) == [".snapkeep", "snapshot_iter_3"]

    reads = _StorageReads(out)
    capfd.readouterr()
    resumed, model2, tier = _with_tier(out, root)
    resumed.start_extensions()
    reads.active = False
    assert resumed.iteration == 4
    said = [line for line in capfd.readouterr().err.splitlines() if "resuming" in line]
    assert said == [f"snapkeep: resuming from RAM step 4 (own copy; storage's newest: 3) in "
                    f"{tier_dir(str(root), job)}"]  # one line, as a storage resume says
    assert reads.reads == []
    assert tier.restored is not None and tier.restored.source == "own"
    assert tier.restored.storage_step == 3
    assert "snapshot_iter_4" in os.listdir(out)  # persisted at the breakpoint
    # bit-identical to an uninterrupted run of the same steps
    ref_manager, ref_model = _manager(tmp_path / "ref", tmp_path / "ref_shm")
    _train(ref_manager, ref_model, 8)
    ref_manager.finalize()
    while resumed.iteration < 8:
        _step(resumed, model2)
    resumed.finalize()
    for key, value in ref_model.state_dict().items():
        assert torch.equal(model2.state_dict()[key], value), key
    assert not torch.equal(expected["weight"], model2.state_dict()["weight"])
    # a finished run removes its tier
    assert not os.path.exists(tier_dir(str(root), job))
    assert not os.path.exists(tier_dir(str(tmp_path / "ref_shm"),
                                       job_id(str(tmp_path / "ref"), TEMPLATE)))


def test_retention_continues_the_killed_runs_snapshots_after_a_ram_resume(
        tmp_path: Path) -> None:
    """n_retains=2: the run killed at 5 left storage's step 3; resumed from RAM (step 4), the
    rerun continues that run's lineage, so its retention deletes step 3 as a storage resume
    would (before: step 3 belonged to another run and was kept for good)."""
    out, root = tmp_path / "out", tmp_path / "shm"

    def with_retention() -> tuple[ExtensionsManager, torch.nn.Module, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=12, out_dir=str(out),
                                    writer=writing.SimpleWriter(out_dir=str(out)))
        manager.extend(ext.snapshot(filename=TEMPLATE, autoload=True, n_retains=2),
                       trigger=(3, "iteration"))
        tier = ext.memory_tier(ext.MemoryTier(every=2, replicas=0, root=str(root)))
        manager.extend(tier)
        return manager, model, tier

    manager, model, tier = with_retention()
    _train(manager, model, 5)
    tier.wait()  # "killed" here: no finalize
    resumed, model2, tier2 = with_retention()
    _train(resumed, model2, 12)
    assert tier2.restored is not None and tier2.restored.step == 4
    resumed.finalize()
    assert sorted(n for n in os.listdir(out) if n.startswith("snapshot_")) == [
        "snapshot_iter_12", "snapshot_iter_9"]


def test_a_finished_run_removes_what_a_run_on_more_ranks_left(tmp_path: Path) -> None:
    """A job killed on 2 ranks (one root) and rerun on 1: the rerun resumes from storage (other
    world size) and, once finished, leaves nothing of rank 1 in RAM either."""
    out, root = tmp_path / "out", tmp_path / "shm"
    job = job_id(str(out), TEMPLATE)
    MemoryStore(str(root), job, 1).commit_state(4, {"w": torch.ones(3)}, torch.save)
    MemoryStore(str(root), job, 0, 1).commit_state(4, {"w": torch.ones(3)}, torch.save)
    write_owner(str(root), job, 1, world=2)
    write_owner(str(root), job, 0, world=2)
    manager, model = _manager(out, root)
    _train(manager, model, 8)
    manager.finalize()
    assert not os.path.exists(tier_dir(str(root), job))


def test_a_corrupt_ram_copy_falls_through_to_storage(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model = _killed_at(out, root, 5)
    store = MemoryStore(str(root), job_id(str(out), TEMPLATE), 0)
    path = store.entries()[-1].path
    with open(path, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed, _ = _manager(out, root)
    resumed.start_extensions()
    assert resumed.iteration == 3  # storage's newest, not the corrupt RAM step 4
    resumed.finalize()


def test_the_ram_snapshot_holds_the_state_of_the_call_and_is_written_in_the_background(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The call stages a consistent copy and returns before serialising it (the loop pays for
    the copy only); what the loop does to its tensors after the call is not in the snapshot."""
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model, tier = _with_tier(out, root, every=100, storage_every=100)
    _train(manager, model, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    serialising, release = threading.Event(), threading.Event()
    save = torch.save

    def gated(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        serialising.set()
        release.wait(10)  # the training thread is never held this long (checked below)
        save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", gated)
    began = time.monotonic()
    tier(manager)
    returned_s = time.monotonic() - began
    assert serialising.wait(10) and not release.is_set() and returned_s < 5
    with torch.no_grad():  # the loop goes on: in place, while the snapshot is serialised
        for param in model.parameters():
            param.add_(1000.0)
        manager.optimizers["main"].state[model.weight]["momentum_buffer"].mul_(-1.0)
    release.set()
    tier.wait()
    monkeypatch.undo()
    held = MemoryStore(str(root), job_id(str(out), TEMPLATE), 0).newest_verified()
    assert held is not None and held.step == 1
    state = torch.load(held.path, weights_only=True)
    saved = state["models"]["main"]
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key
    momentum = state["optimizers"]["main"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, -manager.optimizers["main"].state[model.weight][
        "momentum_buffer"])
    manager.finalize()


def test_a_trigger_waits_for_the_ram_snapshot_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """At most one RAM snapshot in flight: a trigger while the previous one is still being
    serialised waits for it (logged at debug), then stages its own."""
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model, tier = _with_tier(out, root, every=100, storage_every=100)
    _train(manager, model, 1)
    release = threading.Event()
    save = torch.save

    def gated(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        release.wait(10)
        save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", gated)
    tier(manager)  # step 1, held in flight
    _step(manager, model)
    second = threading.Thread(target=tier, args=(manager,))
    with caplog.at_level("DEBUG", logger="snapkeep._core.tiers.memory_tier"):
        second.start()
        second.join(0.5)
        assert second.is_alive()  # waiting for step 1
        release.set()
        second.join(10)
    assert not second.is_alive()
    assert "waits for the RAM snapshot of step 1" in caplog.text
    tier.wait()
    monkeypatch.undo()
    held = MemoryStore(str(root), job_id(str(out), TEMPLATE), 0).newest_verified()
    assert held is not None and held.step == 2
    manager.finalize()


def _tmpfs_full(self: MemoryStore, step: int, state: Any, savefun: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device (test)", self.directory)


def test_a_background_failure_is_raised_once_at_the_next_trigger_and_at_finalize(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model, tier = _with_tier(out, root, every=100, storage_every=100)
    _train(manager, model, 1)
    store = MemoryStore(str(root), job_id(str(out), TEMPLATE), 0)
    monkeypatch.setattr(MemoryStore, "commit_state", _tmpfs_full)
    tier(manager)  # returns: the commit fails in the background
    tier.wait()  # waits only; the failure is kept for the next trigger
    monkeypatch.undo()
    with pytest.raises(SnapshotSaveError, match=r"step 1 failed in the background: OSError") \
            as info:
        tier(manager)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert store.newest_verified() is None  # that trigger took no snapshot
    tier(manager)  # raised once: the next trigger commits
    tier.wait()
    held = store.newest_verified()
    assert held is not None and held.step == 1
    _step(manager, model)
    monkeypatch.setattr(MemoryStore, "commit_state", _tmpfs_full)
    tier(manager)
    with pytest.raises(SnapshotSaveError, match=r"step 2 failed in the background") as info:
        manager.finalize()
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    held = store.newest_verified()
    assert held is not None and held.step == 1  # the older RAM snapshot is intact


def test_ram_older_than_storage_is_not_used(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model = _killed_at(out, root, 6, every=4, storage_every=5)  # RAM 4, storage 5
    resumed, _ = _manager(out, root, every=4, storage_every=5)
    resumed.start_extensions()
    assert resumed.iteration == 5
    resumed.finalize()


def test_a_too_small_filesystem_is_refused_at_start_naming_the_size(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with torch.device("meta"):  # a state larger than the free space, allocating nothing
        big = torch.nn.Linear(1, 1)
        big.weight = torch.nn.Parameter(torch.empty(free // 4 + 1, 1))
    manager, _ = _manager(tmp_path / "out", tmp_path / "shm", model=big)
    with pytest.raises(MemoryTierTooSmallError, match=r"needs [0-9.]+ MiB") as info:
        manager.start_extensions()
    assert "--shm-size" in str(info.value)


def test_a_dead_jobs_tier_is_reclaimed_and_a_live_one_kept(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    old = time.time() - 7200
    for job, pid in (("dead", 2**22 + 12345), ("live", os.getpid())):
        directory = Path(tier_dir(str(root), job))
        (directory / "rank0").mkdir(parents=True)
        (directory / "owner-rank0.json").write_text(json.dumps(
            {"pid": pid, "host": os.uname().nodename, "time": old, "rank": 0}))
    recent = Path(tier_dir(str(root), "recent"))
    recent.mkdir()
    (recent / "owner-rank0.json").write_text(json.dumps(
        {"pid": 2**22 + 12345, "host": os.uname().nodename, "time": time.time(), "rank": 0}))
    removed = reclaim_stale(str(root), keep="mine", stale_after_s=3600)
    assert removed == [tier_dir(str(root), "dead")]
    assert sorted(os.listdir(root)) == ["snapkeep-live", "snapkeep-recent"]


def test_snapkeep_ls_memory_shows_what_each_tier_holds(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model = _killed_at(out, root, 5)
    tiers = describe_tiers(str(root))
    assert [(h["rank"], h["source"], h["step"]) for h in tiers[0]["held"]] == [(0, 0, 4)]
    from click.testing import CliRunner

    from snapkeep.cli import cli
    result = CliRunner().invoke(cli, ["ls", "--memory", str(root)])
    assert result.exit_code == 0, result.output
    assert "ram_iter_4" in result.output and f"pid {os.getpid()}" in result.output
    missing = CliRunner().invoke(cli, ["ls", "--memory", str(tmp_path / "no-such-root")])
    assert missing.exit_code == 2 and "is not a directory" in missing.output  # as plain ls


# -- the store contract's steps, for the node-RAM kind ------------------------------------------


def test_memory_store_follows_the_store_contract(tmp_path: Path) -> None:
    store = MemoryStore(str(tmp_path), "job", 0)
    store.check_kind()
    lock = store.lock()
    try:
        second = subprocess.run(  # a second trainer (another process) is refused
            [sys.executable, "-c", "import sys; from snapkeep._core.tiers.memory_store import "
             "MemoryStore; from snapkeep.errors import StoreLockedError\n"
             f"try: MemoryStore({str(tmp_path)!r}, 'job', 0).lock()\n"
             "except StoreLockedError: sys.exit(3)"],
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), timeout=60)
        assert second.returncode == 3
    finally:
        if lock is not None:
            lock.release()
    for step in (1, 2, 3):
        held = store.commit_state(step, {"w": torch.full((3,), float(step))}, torch.save)
    assert [e.step for e in store.entries()] == [3]  # retention: the newest step alone
    assert store.manifest(store.entries()[-1]) is not None
    assert store.newest_verified() == held
    # a crashed writer's temp is swept; a foreign file is not
    head, tail = temp_basename("ram_iter_4").rsplit(TEMP_MARKER, 1)
    host, _, token = tail.split(".")  # a temp of a writer (this host) whose pid is gone
    Path(store.directory, f"{head}{TEMP_MARKER}{host}.{base36(2**22 + 12345)}.{token}") \
        .write_bytes(b"x")
    Path(store.directory, "notes.txt").write_bytes(b"mine")
    store.sweep()
    assert sorted(os.listdir(store.directory)) == [".snapkeep", "notes.txt", "ram_iter_3"]
    # corruption is SnapshotCorruptError; a peer copy damaged in transit is never committed
    peer = MemoryStore(str(tmp_path), "job", 1, source=0)
    data = Path(held.path).read_bytes()
    damaged = data[:40] + bytes([data[40] ^ 0xFF]) + data[41:]
    with pytest.raises(SnapshotCorruptError, match="checksum"):
        peer.commit_bytes(3, damaged, held.checksum)
    assert peer.entries() == []
    assert peer.commit_bytes(3, data, held.checksum).checksum == held.checksum
    Path(held.path).write_bytes(damaged)
    assert store.newest_verified() is None
    with pytest.raises(SnapshotCorruptError):
        store.read(held)
    assert store.delete(store.entries()[-1])
    assert store.entries() == []


def test_the_inventory_reads_manifests_only_and_a_copy_is_verified_where_it_is_read(
        tmp_path: Path) -> None:
    """At start a rank lists its copies from their manifests (no snapshot byte hashed); the
    copy used is verified once, while it is loaded (own) or by its receiver (peer)."""
    store = MemoryStore(str(tmp_path), "job", 0)
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    held = store.commit_state(3, state, torch.save)
    assert store.newest_listed() == held
    assert torch.equal(store.load(held)["w"], state["w"])  # one pass: hashed while loaded
    data = bytearray(Path(held.path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit inside the tensor's bytes, same size
    Path(held.path).write_bytes(bytes(data))
    assert store.newest_listed() == held  # listed: its bytes are not read at start
    with pytest.raises(SnapshotCorruptError):
        store.load(held)  # but never used
    with store.mapped(held) as mapped:  # sent unhashed: the receiver checks it
        assert MemoryStore.digest(mapped) != held.checksum
    with pytest.raises(SnapshotCorruptError):
        store.read(held)
    Path(held.path).write_bytes(bytes(data[:100]))  # truncated: seen from its size alone
    assert store.newest_listed() is None


def test_an_own_ram_copy_corrupt_inside_a_tensor_falls_through_to_storage(
        tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    _killed_at(out, root, 5)  # RAM step 4 committed, storage step 3
    path = MemoryStore(str(root), job_id(str(out), TEMPLATE), 0).entries()[-1].path
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    resumed, _ = _manager(out, root)
    resumed.start_extensions()
    assert resumed.iteration == 3  # storage's newest, not the corrupt RAM step 4
    resumed.finalize()


def test_defaults_name_the_tier_by_the_training_under_dev_shm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The name is the training's (uid, out_dir, template), never the launch's: torchrun
    --standalone draws a new TORCHELASTIC_RUN_ID at every launch."""
    assert ext.MemoryTier(every=5).root == "/dev/shm"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    a, b = job_id("/runs/a", TEMPLATE), job_id("/runs/b", TEMPLATE)
    assert a != b and a == job_id("/runs/a", TEMPLATE) and len(a) == 16
    assert a != job_id("/runs/a", "other_{.iteration}")
    for launch in ("none", "job/42", "8b3c0f6e-1d2a"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", launch)
        assert job_id("/runs/a", TEMPLATE) == a
    assert tier_dir("/dev/shm", a) == f"/dev/shm/snapkeep-{a}"


# -- SHARDED snapshots (one process: plain DCP files; FSDP2 on gloo in tests/distributed) ------


def _sharded(out: Path, root: Path, *, dtype: torch.dtype = torch.float32,
             ) -> tuple[ExtensionsManager, torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=8, out_dir=str(out),
                                writer=writing.SimpleWriter(out_dir=str(out)))
    snapshot = ext.snapshot(filename=TEMPLATE, snapshot_mode=ext.SnapshotMode.SHARDED,
                            autoload=True)
    manager.extend(snapshot, trigger=(3, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=2, replicas=0, root=str(root)))
    manager.extend(tier)
    return manager, model, tier, snapshot


def _sharded_step(manager: ExtensionsManager, model: torch.nn.Module) -> None:
    optimizer = manager.optimizers["main"]
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(manager.iteration))
    with manager.run_iteration():
        optimizer.zero_grad()
        model(x.to(model.weight.dtype)).pow(2).sum().backward()
        optimizer.step()


def _sharded_killed_at_5(out: Path, root: Path) -> None:
    manager, model, tier, snapshot = _sharded(out, root)
    manager.start_extensions()
    while manager.iteration < 5:  # RAM at 2, 4; storage at 3; then the process "dies"
        _sharded_step(manager, model)
    tier.wait()
    snapshot.wait()


def test_sharded_restart_resumes_from_ram_reads_no_storage_and_persists_first(
        tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    _sharded_killed_at_5(out, root)
    reads = _StorageReads(out)
    resumed, model, tier, _ = _sharded(out, root)
    resumed.start_extensions()
    reads.active = False
    assert resumed.iteration == 4 and tier.restored.source == "own"
    assert reads.reads == []
    assert (out / "snapshot_iter_4" / ".snapkeep-commit.json").exists()  # a sharded snapshot
    while resumed.iteration < 8:
        _sharded_step(resumed, model)
    resumed.finalize()
    ref, ref_model, _, _ = _sharded(tmp_path / "ref", tmp_path / "ref_shm")
    ref.start_extensions()
    while ref.iteration < 8:
        _sharded_step(ref, ref_model)
    ref.finalize()
    for key, value in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key  # Adam's state restored too
    assert os.listdir(root) == []


def test_a_sharded_ram_snapshot_unlike_the_live_state_falls_back_to_storage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    _sharded_killed_at_5(out, root)
    resumed, model, tier, snapshot = _sharded(out, root, dtype=torch.float64)
    with caplog.at_level("WARNING"):
        resumed.start_extensions()
    assert tier.restored is None
    assert resumed.iteration == 3 and snapshot.loaded_entry.name == "snapshot_iter_3"
    assert "does not match its live state" in caplog.text
    assert "models.main.weight: saved torch.float32 [3, 4], live torch.float64 [3, 4]" \
        in caplog.text
    resumed.finalize()


def test_a_root_that_is_a_file_or_a_typo_on_disk_is_said_naming_root(tmp_path, caplog):
    """``root=`` a regular file: ValueError naming root (was a bare FileExistsError from
    makedirs); a root that did not exist and is created on a disk filesystem: a warning that
    the "RAM" copies go to disk (a typo in the path was silent)."""
    import logging

    from snapkeep._core.tiers.memory_store import check_space, filesystem_type

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=f"MemoryTier root {str(afile)!r} is not a directory"):
        check_space(str(afile), 1)
    assert afile.read_text() == "x"
    typo = tmp_path / "dev" / "shmm"
    with caplog.at_level(logging.WARNING, logger="snapkeep"):
        check_space(str(typo), 1)
    kind = filesystem_type(str(tmp_path))
    said = [r.getMessage() for r in caplog.records if "did not exist" in r.getMessage()]
    assert said == ([] if kind in ("tmpfs", "ramfs") else [
        f"memory tier: root {str(typo)!r} did not exist and was created on a {kind} filesystem, "
        "not a tmpfs: the tier's copies go to that disk, not to RAM. Check the path, or pass "
        "root= a tmpfs such as '/dev/shm'"])
    assert filesystem_type("/dev/shm") in ("tmpfs", None)
