"""Verified resume: a damaged newest snapshot is detected by its checksum and skipped with a
warning naming it; the newest valid one loads; "latest" is the step in the name, never mtime;
mismatching keys/shapes are listed and nothing is deleted."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

import snapkeep
from snapkeep.training import extensions
from support.integration import (
    assert_params,
    listing,
    make_model,
    make_run,
    snapshots,
    train,
)


def _three_snapshots(out) -> list[str]:
    manager, _, model = make_run(out, autoload=False)
    train(manager, model, 3)
    manager.finalize()
    assert snapshots(out) == ["snapshot_iter_1", "snapshot_iter_2", "snapshot_iter_3"]
    return listing(out)


def _truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _zero(path: str) -> None:
    open(path, "wb").close()


def _flip(path: str) -> None:
    # a byte inside the tensor data: torch.load would read it without complaint
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 3)
        byte = f.read(1)
        f.seek(size // 3)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(_truncate, "truncated"), (_zero, "truncated"), (_flip, "does not match the recorded")],
    ids=["truncated", "zero-length", "byte-flipped"],
)
def test_damaged_newest_is_skipped_and_previous_loaded(tmp_path, damage, reason, capfd):
    before = _three_snapshots(tmp_path)
    newest = tmp_path / "snapshot_iter_3"
    damage(str(newest))
    capfd.readouterr()

    manager, ext, model = make_run(tmp_path)
    assert manager.iteration == 2
    lines = capfd.readouterr().err.splitlines()  # the resume notice: outcome, then each skip
    assert lines[0] == f"snapkeep: resuming from snapshot_iter_2 (step 2) in {tmp_path}"
    assert len(lines) == 2 and re.fullmatch(
        rf"snapkeep: skipped snapshot_iter_3 \(step 3\): .*{reason}.*", lines[1]), lines
    assert ext.loaded_entry.name == "snapshot_iter_2"
    assert_params(model, 2)
    assert listing(tmp_path) == before  # nothing deleted, the damaged file kept for inspection


def test_all_invalid_raises_and_deletes_nothing(tmp_path):
    before = _three_snapshots(tmp_path)
    for name in snapshots(tmp_path):
        _truncate(str(tmp_path / name))

    manager, _, _ = make_run(tmp_path, n_retains=1)
    with pytest.raises(snapkeep.NoValidSnapshotError, match="3 snapshot file"):
        manager.start_extensions()
    assert listing(tmp_path) == before


def test_snapshot_without_manifest_loads_with_a_warning(tmp_path):
    _three_snapshots(tmp_path)
    shutil.rmtree(tmp_path / ".snapkeep")
    manager, _, model = make_run(tmp_path)
    with pytest.warns(RuntimeWarning, match="snapshot_iter_3 .*no checksum manifest"):
        assert manager.iteration == 3
    assert_params(model, 3)


def test_plain_torch_save_file_loads_with_a_warning(tmp_path):
    """A ppe-written snapshot: a plain torch.save of the manager's state, no manifest."""
    manager, _, model = make_run(tmp_path, autoload=False)
    train(manager, model, 4)
    state = manager.state_dict()
    manager.finalize()
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    torch.save(state, tmp_path / "snapshot_iter_4")

    manager, _, model = make_run(tmp_path)
    with pytest.warns(RuntimeWarning, match="no checksum manifest"):
        assert manager.iteration == 4
    assert_params(model, 4)


def _set_mtime(path, seconds: float) -> None:
    os.utime(path, (seconds, seconds))


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "after-copytree"])
def test_latest_is_the_highest_step_not_the_newest_mtime(tmp_path, copy):
    writer = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path / "run"))
    for step in (999, 1000):
        model = make_model()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        manager = snapkeep.training.ExtensionsManager(
            model, torch.optim.SGD(model.parameters(), lr=0.1), 1, iters_per_epoch=1,
            writer=writer)
        manager.iteration = step
        writer(f"snapshot_iter_{step}", manager.out, manager.state_dict())
    writer.finalize()
    run = tmp_path / "run"
    _set_mtime(run / "snapshot_iter_999", 1_000_000)
    _set_mtime(run / "snapshot_iter_1000", 1_000_000)
    if copy:
        shutil.copytree(run, tmp_path / "copy")
        run = tmp_path / "copy"
        # a copy tool that does not keep mtimes writes 999 last
        _set_mtime(run / "snapshot_iter_1000", 2_000_000)
        _set_mtime(run / "snapshot_iter_999", 3_000_000)

    manager, ext, model = make_run(run)
    assert manager.iteration == 1000
    assert ext.loaded_entry.name == "snapshot_iter_1000"
    assert_params(model, 1000)


def test_shape_and_key_mismatch_is_listed_and_nothing_deleted(tmp_path):
    before = _three_snapshots(tmp_path)
    wider = make_model(out_features=5)  # weight (5, 4), bias (5,) against (3, 4), (3,)
    manager, _, _ = make_run(tmp_path, model=wider, n_retains=1)
    with pytest.raises(snapkeep.StateMismatchError) as info:
        manager.start_extensions()
    message = str(info.value)
    assert "snapshot_iter_3" in message
    assert "shape of weight: snapshot (3, 4), target (5, 4)" in message
    assert "shape of bias: snapshot (3,), target (5,)" in message
    assert "models['main']" in message
    assert listing(tmp_path) == before


def test_mismatch_lists_the_first_ten(tmp_path):
    class Many(torch.nn.Module):
        def __init__(self, width: int, prefix: str) -> None:
            super().__init__()
            for i in range(12):
                self.register_buffer(f"{prefix}{i:02d}", torch.zeros(width))

    writer = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    saved = Many(2, "a")
    manager = snapkeep.training.ExtensionsManager(
        saved, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 1,
        iters_per_epoch=1, writer=writer)
    manager.extend(extensions.snapshot_object(saved, "model_{.iteration}"),
                   trigger=(1, "iteration"))
    with manager.run_iteration():
        pass
    manager.finalize()
    before = listing(tmp_path)

    target = Many(3, "b")
    manager = snapkeep.training.ExtensionsManager(
        target, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 1,
        iters_per_epoch=1, writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(extensions.snapshot_object(target, "model_{.iteration}", autoload=True,
                                              n_retains=1))
    with pytest.raises(snapkeep.StateMismatchError) as info:
        manager.start_extensions()
    message = str(info.value)
    assert message.count("missing b") + message.count("unexpected a") == 10
    assert "24 mismatch(es)" in message and "(and 14 more)" in message
    assert listing(tmp_path) == before
