"""Overlapped staging of sharded snapshots (``ShardedSaver.save(..., overlap=...)``, the SHARDED
extension's ``overlap``): optimizer-owned local shards are copied after the call, validated on
the training thread, and a race drops the snapshot on every rank."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

from snapkeep import writing
from snapkeep._core.distributed import staging as sharded_staging
from snapkeep._core.distributed.sharded import ShardedJob, ShardedSaver, load_sharded
from snapkeep._core.distributed.sharded_store import ShardedStore
from snapkeep._core.storage import resolve_storage
from snapkeep.errors import StagingRaceError
from snapkeep.staging import StagingGuard, owned_storages
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext
from support.ranks import reports, run

WORKER = Path(__file__).with_name("sharded_overlap_worker.py")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)  # a 2 MiB weight: deferred; the bias is copied at once
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, optimizer)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _tree(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    moments = optimizer.state[model.weight]
    return {"weight": model.weight.detach(), "bias": model.bias.detach(),
            "exp_avg": moments["exp_avg"], "exp_avg_sq": moments["exp_avg_sq"]}


@pytest.fixture
def single(tmp_path):
    model, optimizer = _model()
    storage, directory = resolve_storage(str(tmp_path))
    store = ShardedStore(storage, directory, "snap_{step}")
    saver = ShardedSaver(store, None)
    guard = StagingGuard()
    guard.guard([optimizer])
    guard.track(saver)
    yield store, saver, model, optimizer
    guard.close()
    saver.close()


def test_the_copy_is_deferred_to_the_step_and_the_snapshot_holds_the_values_of_the_call(single):
    store, saver, model, optimizer = single
    at_call = {k: v.clone() for k, v in _tree(model, optimizer).items()}
    handle = saver.save(_tree(model, optimizer), ShardedJob(name="snap_1", step=1),
                        overlap=frozenset(owned_storages([optimizer])))
    assert not handle.staged.done()  # no verdict before a safe point
    _step(model, optimizer)  # the step pre-hook waits for the copy and validates it
    assert handle.staged.done() and handle.staged.exception() is None
    saver.wait()
    loaded = {k: torch.zeros_like(v) for k, v in at_call.items()}
    load_sharded(store, store.entries()[-1], loaded, groups=None)
    for key, value in at_call.items():
        assert torch.equal(loaded[key], value), key
        assert not torch.equal(_tree(model, optimizer)[key], value), key  # the step moved it


def test_an_in_place_write_before_the_verdict_drops_the_snapshot(single, tmp_path):
    store, saver, model, optimizer = single
    saver.save(_tree(model, optimizer), ShardedJob(name="snap_1", step=1),
               overlap=frozenset(owned_storages([optimizer])))
    with torch.no_grad():
        model.weight.mul_(2.0)  # not through the optimizer's step
    with pytest.raises(StagingRaceError, match=r"dropped on every rank.*'weight'.*version"):
        saver.wait()
    assert store.entries() == [] and not (tmp_path / "snap_1" / ".snapkeep-commit.json").exists()
    saver.save(_tree(model, optimizer), ShardedJob(name="snap_2", step=2))  # not overlapped
    saver.wait()
    assert [e.name for e in store.entries()] == ["snap_2"]


def test_without_overlap_everything_is_copied_in_the_call(single):
    store, saver, model, optimizer = single
    handle = saver.save(_tree(model, optimizer), ShardedJob(name="snap_1", step=1))
    assert handle.staged.done()
    with torch.no_grad():
        model.weight.mul_(2.0)
    saver.wait()
    loaded = {k: torch.zeros_like(v) for k, v in _tree(model, optimizer).items()}
    load_sharded(store, store.entries()[-1], loaded, groups=None)
    assert torch.equal(loaded["weight"] * 2, model.weight.detach())


def _gated_copies(monkeypatch) -> threading.Event:
    """Hold every background sharded copy until the returned event is set."""
    gate = threading.Event()
    copy = sharded_staging.ShardCopies.copy

    def gated(self):
        assert gate.wait(30)
        copy(self)

    monkeypatch.setattr(sharded_staging.ShardCopies, "copy", gated)
    return gate


def _manager(out_dir: str, overlap):
    model, optimizer = _model()
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=100, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    manager.extend(ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, overlap=overlap),
                   trigger=(1, "iteration"))
    manager.start_extensions()
    return manager, model, optimizer


def test_the_extension_warns_once_drops_the_raced_snapshot_and_copies_in_the_call_after(
        tmp_path, monkeypatch):
    gate = _gated_copies(monkeypatch)
    manager, model, optimizer = _manager(str(tmp_path), True)
    with manager.run_iteration():
        _step(model, optimizer)
    with torch.no_grad():
        model.weight.add_(1.0)  # after snapshot_iter_1's call, before its copy ran
    gate.set()
    with pytest.warns(RuntimeWarning, match="snapshot_iter_1.*dropped.*now off") as seen:
        for _ in range(3):
            with manager.run_iteration():
                _step(model, optimizer)
        manager.finalize()
    assert len([w for w in seen if issubclass(w.category, RuntimeWarning)]) == 1
    committed = sorted(p.name for p in tmp_path.iterdir()
                       if (p / ".snapkeep-commit.json").exists())
    assert committed == ["snapshot_iter_2", "snapshot_iter_3", "snapshot_iter_4"]


def test_strict_raises_the_race(tmp_path, monkeypatch):
    gate = _gated_copies(monkeypatch)
    manager, model, optimizer = _manager(str(tmp_path), "strict")
    with manager.run_iteration():
        _step(model, optimizer)
    with torch.no_grad():
        model.weight.add_(1.0)
    gate.set()
    with warnings.catch_warnings(), pytest.raises(StagingRaceError, match="snapshot_iter_1"):
        warnings.simplefilter("ignore")
        with manager.run_iteration():
            _step(model, optimizer)
    manager.finalize()  # the error was raised once, at the next snapshot: nothing left
    assert not any((p / ".snapkeep-commit.json").exists() for p in tmp_path.iterdir())


def test_fsdp2_ranks_defer_validate_and_drop_a_raced_snapshot_on_every_rank(tmp_path):
    out, rep = tmp_path / "out", tmp_path / "reports"
    rep.mkdir()
    run(WORKER, 2, [str(tmp_path / "init"), str(out), str(rep), "saver"], timeout_s=240)
    for report in reports(rep, "saver", 2):
        assert report["deferred_until_a_safe_point"] and report["validated_at_the_step"]
        assert report["snapshot_1_keys"] >= 6 and report["snapshot_1_mismatches"] == []
        assert report["moved_since"]  # the step changed what the snapshot holds
        assert "dropped on every rank" in report["race"] and "rank 1" in report["race"]
        assert report["committed"] == ["snap_1", "snap_3"] and not report["snap_2_marker"]


def test_fsdp2_overlapped_extension_snapshots_resume_exactly(tmp_path):
    out, rep = tmp_path / "out", tmp_path / "reports"
    rep.mkdir()
    run(WORKER, 2, [str(tmp_path / "init"), str(out), str(rep), "train"], timeout_s=240)
    for report in reports(rep, "train", 2):
        assert len(report["deferred_bytes"]) == 4 and min(report["deferred_bytes"]) > 0
    run(WORKER, 2, [str(tmp_path / "init2"), str(out), str(rep), "resume"], timeout_s=240)
    for rank, report in enumerate(reports(rep, "resume", 2)):
        assert report["loaded"] == "snapshot_iter_4"
        want = torch.load(rep / f"full_rank{rank}.pt", weights_only=True)
        got = torch.load(rep / f"resumed_rank{rank}.pt", weights_only=True)
        for part in ("params", "exp_avg"):
            assert want[part].keys() == got[part].keys()
            for key in want[part]:
                assert torch.equal(want[part][key], got[part][key]), (part, key)
