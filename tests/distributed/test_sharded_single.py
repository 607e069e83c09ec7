"""SHARDED snapshots in one process (no process group: plain DCP files, the same commit
protocol): the marker makes a directory a snapshot; retention and the start-up sweep delete
whole directories; agreement helpers without a group."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from snapkeep import writing
from snapkeep._core.distributed.agreement import agree_on_resume, exchange_outcomes
from snapkeep._core.storage._temps import TEMP_MARKER, base36, temp_basename
from snapkeep.errors import NoCommonSnapshotError, RankFailedError
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

MARKER = ".snapkeep-commit.json"


def _train(out_dir: str, iterations: int, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=100, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    snapshot = ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, autoload=True, **kwargs)
    manager.extend(snapshot, trigger=(1, "iteration"))
    manager.start_extensions()
    while manager.iteration < iterations:
        with manager.run_iteration(step_optimizers=["main"]):
            model(torch.ones(2, 4)).sum().backward()
    manager.finalize()
    return manager, model, snapshot


def test_retention_deletes_whole_directories_and_keeps_the_newest(tmp_path):
    _train(str(tmp_path), 4, n_retains=2)
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snapshot_iter_3", "snapshot_iter_4"]
    assert sorted(os.listdir(tmp_path / "snapshot_iter_4")) == [
        ".metadata", MARKER, ".snapkeep-in-progress", "__0_0.distcp"]
    marker = json.loads((tmp_path / "snapshot_iter_4" / MARKER).read_text())
    assert marker["format"] == "snapkeep.sharded/1" and marker["step"] == 4


def test_a_directory_without_its_marker_is_never_loaded_and_is_swept(tmp_path):
    _, trained, _ = _train(str(tmp_path), 3)
    (tmp_path / "snapshot_iter_3" / MARKER).unlink()  # as if killed before the commit
    manager, model, snapshot = _train(str(tmp_path), 2, seed=1)
    assert snapshot.loaded_entry.name == "snapshot_iter_2"
    assert not (tmp_path / "snapshot_iter_3").exists()  # swept at start-up by rank 0
    assert manager.iteration == 2


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_file_falls_back_and_none_valid_is_an_error(tmp_path):
    _train(str(tmp_path), 2)
    _corrupt(tmp_path / "snapshot_iter_2" / "__0_0.distcp")
    _, _, snapshot = _train(str(tmp_path), 1, seed=1)
    assert snapshot.loaded_entry.name == "snapshot_iter_1"
    _corrupt(tmp_path / "snapshot_iter_1" / "__0_0.distcp")
    with pytest.raises(NoCommonSnapshotError, match="checksum"):
        _train(str(tmp_path), 1, seed=1)
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snapshot_iter_1",
                                            "snapshot_iter_2"]  # kept


def test_sharded_rejects_savefun_and_bad_timeouts():
    with pytest.raises(TypeError, match="savefun cannot be given"):
        ext.snapshot(torch.save, snapshot_mode=ext.SnapshotMode.SHARDED)
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
        ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, timeout_s=-1)
    with pytest.raises(ValueError, match="needs a string filename template"):
        ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, filename=lambda m: "x")


@pytest.mark.parametrize(("listing", "bad", "chosen"), [
    ([], set(), None),
    ([((1,), "s1"), ((2,), "s2")], set(), "s2"),
    ([((1,), "s1"), ((2,), "s2")], {"s2"}, "s1"),
])
def test_agree_on_resume_without_a_group(listing, bad, chosen):
    def check(name):
        return "corrupt" if name in bad else None

    assert agree_on_resume(None, listing, check, what="t") == chosen


def test_agree_on_resume_names_steps_and_reasons_when_nothing_is_readable():
    with pytest.raises(NoCommonSnapshotError, match=r"s2 \(rank 0: broken\), s1 \(rank 0: "):
        agree_on_resume(None, [((1,), "s1"), ((2,), "s2")], lambda n: "broken", what="t")


def test_exchange_outcomes_raises_naming_the_rank_and_chains_the_cause():
    cause = OSError(28, "disk full")
    with pytest.raises(RankFailedError, match=r"save failed on rank\(s\) \[0\]") as info:
        exchange_outcomes(None, cause, what="save")
    assert info.value.__cause__ is cause
    assert info.value.failed == {0: "OSError: [Errno 28] disk full"}
    assert exchange_outcomes(None, None, what="save") == [None]


def test_snapshot_on_error_commits_the_failing_iteration(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    manager = ExtensionsManager(model, {}, 1, iters_per_epoch=100, out_dir=str(tmp_path),
                                writer=writing.SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, snapshot_on_error=True),
                   trigger=(100, "iteration"))
    with pytest.raises(RuntimeError, match="boom"):
        for _ in range(5):
            with manager.run_iteration():
                if manager.iteration == 3:
                    raise RuntimeError("boom")
    # mid-iteration state: under the on-error name, never a clean snapshot's (the lock: .snapkeep)
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snapshot_iter_3.on-error"]
    # committed before on_error returned
    assert (tmp_path / "snapshot_iter_3.on-error" / MARKER).exists()


def test_keep_best_with_a_metric_never_recorded_stops_the_run_before_deleting(tmp_path):
    """As for single files (issue 17 item 4): the trainer gets the ValueError at the save whose
    retention would delete a snapshot, before anything is written; nothing is deleted."""
    from snapkeep import reporting
    from snapkeep.retention import KeepBest

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=100, out_dir=str(tmp_path),
                                writer=writing.SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED,
                                retention=KeepBest(1, "val/loss")), trigger=(1, "iteration"))
    manager.start_extensions()
    with manager.run_iteration(step_optimizers=["main"]):  # nothing to delete yet: saved
        reporting.report({"loss": 0.5})
        model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(ValueError) as info:
        with manager.run_iteration(step_optimizers=["main"]):
            reporting.report({"loss": 0.4})
            model(torch.ones(2, 4)).sum().backward()
    manager.finalize()
    assert str(info.value).startswith(
        "KeepBest metric 'val/loss' is recorded by none of the 2 snapshot manifest(s); the "
        "metrics they record: 'loss'. Nothing was deleted.")
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snapshot_iter_1"]
    assert (tmp_path / "snapshot_iter_1" / MARKER).is_file()


def test_an_optimizer_is_saved_with_the_module_it_steps(tmp_path) -> None:
    """DCP saves an optimizer with its module: the one whose parameters it steps (one function,
    snapkeep.distributed.optimizer_module, for the SHARDED extension and the Checkpointer)."""
    import snapkeep
    from snapkeep.distributed import optimizer_module

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    assert optimizer_module(optimizer, {"a": first, "b": second}) is second
    assert optimizer_module(optimizer, {"a": first}) is None
    with snapkeep.Checkpointer(tmp_path / "ckpt", sharded=True) as ckpt:
        with pytest.raises(ValueError, match=r"state\['opt'\] optimizes no parameter of the "
                                             r"modules in state \['model'\]"):
            ckpt.save(1, {"model": first, "opt": optimizer})


@pytest.mark.parametrize("left", ["empty", "mark-temp", "user-file"])
def test_a_save_writes_again_only_a_directory_of_its_own(tmp_path, left) -> None:
    """A directory at the next snapshot's name: one a save killed before its in-progress mark
    left (empty, or only the mark's temp file, which the start-up sweep removes) is written and
    committed; a user's directory (a file of theirs in it) is refused naming it, untouched."""
    _train(str(tmp_path), 2)
    squatter = tmp_path / "snapshot_iter_3"
    squatter.mkdir()
    if left == "mark-temp":  # the temp of a writer that is gone (pid of an ended process)
        ended = subprocess.Popen(["true"])
        ended.wait()
        host, _, token = temp_basename(".snapkeep-in-progress").rsplit(TEMP_MARKER, 1)[1] \
            .split(".")
        (squatter / f"..snapkeep-in-progress{TEMP_MARKER}{host}.{base36(ended.pid)}.{token}"
         ).write_bytes(b"")
    elif left == "user-file":
        (squatter / "notes.txt").write_text("the user's")
    if left != "user-file":
        _train(str(tmp_path), 3)
        assert (squatter / MARKER).is_file()
        return
    with pytest.raises(RankFailedError, match="snapshot_iter_3 exists and is not a snapkeep "
                       "snapshot directory") as raised:
        _train(str(tmp_path), 3)
    assert "step 3" in str(raised.value)
    assert sorted(os.listdir(squatter)) == ["notes.txt"]
