"""The door x guarantee matrix: every front door runs the same scenarios on the same engine.

A door is a fixture (:class:`Door`): how a user of it trains ``steps`` (resuming first), saving a
snapshot at every step with a ``val_loss`` metric, under a retention policy. A scenario is a test
taking a door. A new door gets its row by adding one :class:`Door` subclass to ``DOORS``.

Scenarios: junk and foreign files (skipped on load, never counted or deleted by retention), a
misspelled ``KeepBest`` metric (refused before anything is deleted), the lock, a first run and a
resume said on stderr, fallback past a corrupt newest snapshot (said on stderr), exit without
close. The read-only doors (``load_latest``, ``snapkeep verify``) read what the training doors
wrote, in the fallback and junk scenarios.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from framework_doors import HFDoor, LightningDoor

import snapkeep
from snapkeep.cli import cli
from snapkeep.errors import StoreLockedError
from snapkeep.retention import KeepBest, KeepLatest, RetentionPolicy
from snapkeep.training import ExtensionsManager, extensions
from snapkeep.writing import ThreadWriter
from support import killing

X = torch.linspace(-1, 1, 24).reshape(6, 4)


def val_loss(step: int) -> float:
    return 1.0 / (1 + step)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    optimizer.zero_grad()
    model(X[step % 6]).pow(2).sum().backward()
    optimizer.step()


class Door:
    """One front door, driven as its users drive it."""

    name = ""
    sharded = False  # snapshots are DCP directories

    def snapshot_name(self, step: int) -> str:
        raise NotImplementedError

    def train(self, directory: pathlib.Path, stop: int, *,
              keep: RetentionPolicy | None = None) -> torch.nn.Module:
        """Resume from ``directory`` if it holds a snapshot, then train up to step ``stop``
        saving a snapshot at every step; returns the model."""
        raise NotImplementedError

    #: Python code opening the door on ``DIR`` and keeping it open (in another process).
    hold_code = ""


class CheckpointerDoor(Door):
    name = "checkpointer"

    def snapshot_name(self, step: int) -> str:
        return f"ckpt_{step}"

    def train(self, directory: pathlib.Path, stop: int, *,
              keep: RetentionPolicy | None = None) -> torch.nn.Module:
        model, optimizer = _model()
        with snapkeep.Checkpointer(directory, keep=keep) as ckpt:
            state = {"model": model, "optimizer": optimizer}
            start = ckpt.load(into=state) or 0
            for step in range(start + 1, stop + 1):
                _step(model, optimizer, step)
                ckpt.save(step, state, metrics={"val_loss": val_loss(step)})
        return model

    hold_code = "import snapkeep\nheld = snapkeep.Checkpointer(DIR)\n"


class ShardedCheckpointerDoor(CheckpointerDoor):
    """The Checkpointer's DCP kind (one process: no process group needed)."""

    name = "checkpointer-sharded"
    sharded = True
    hold_code = "import snapkeep\nheld = snapkeep.Checkpointer(DIR, sharded=True)\n"

    def train(self, directory: pathlib.Path, stop: int, *,
              keep: RetentionPolicy | None = None) -> torch.nn.Module:
        model, optimizer = _model()
        with snapkeep.Checkpointer(directory, keep=keep, sharded=True) as ckpt:
            state = {"model": model, "optimizer": optimizer}
            start = ckpt.load(into=state) or 0
            for step in range(start + 1, stop + 1):
                _step(model, optimizer, step)
                ckpt.save(step, state, metrics={"val_loss": val_loss(step)})
        return model


class ExtensionDoor(Door):
    name = "extension"

    def snapshot_name(self, step: int) -> str:
        return f"snapshot_iter_{step}"

    def _manager(self, directory: pathlib.Path, stop: int,
                 keep: RetentionPolicy | None) -> tuple[ExtensionsManager, torch.nn.Module]:
        model, optimizer = _model()
        manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=stop,
                                    writer=ThreadWriter(out_dir=str(directory)))
        manager.extend(extensions.snapshot(autoload=True, retention=keep),
                       trigger=(1, "iteration"))
        return manager, model

    def train(self, directory: pathlib.Path, stop: int, *,
              keep: RetentionPolicy | None = None) -> torch.nn.Module:
        manager, model = self._manager(directory, stop, keep)
        optimizer = manager.optimizers["main"]
        try:
            while not manager.stop_trigger:
                with manager.run_iteration(step_optimizers=["main"]):
                    step = manager.iteration + 1
                    snapkeep.report({"val_loss": val_loss(step)})
                    model(X[step % 6]).pow(2).sum().backward()
            assert optimizer is manager.optimizers["main"]
        finally:
            manager.finalize()
        return model

    hold_code = (
        "import torch\nfrom snapkeep.training import ExtensionsManager, extensions\n"
        "from snapkeep.writing import ThreadWriter\n"
        "model = torch.nn.Linear(4, 2)\n"
        "manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), "
        "max_epochs=1, iters_per_epoch=10, writer=ThreadWriter(out_dir=DIR))\n"
        "manager.extend(extensions.snapshot(autoload=True), trigger=(1, 'iteration'))\n"
        "manager.start_extensions()\n")


DOORS = [CheckpointerDoor(), ShardedCheckpointerDoor(), ExtensionDoor(), LightningDoor(), HFDoor()]


@pytest.fixture(params=DOORS, ids=lambda d: d.name)
def door(request: pytest.FixtureRequest) -> Door:
    return request.param


def _snapshots(directory: pathlib.Path, door: Door) -> list[str]:
    prefix = door.snapshot_name(0)[:-1]
    return sorted((n for n in os.listdir(directory) if n.startswith(prefix)),
                  key=lambda n: int(n[len(prefix):]))


def _plant_junk(directory: pathlib.Path, door: Door) -> list[str]:
    """Junk named like snapshots: random bytes and an empty file (a directory of random bytes
    and an empty directory for sharded doors)."""
    junk = [door.snapshot_name(999), door.snapshot_name(800)]
    if door.sharded:  # a marker of random bytes beside a shard; an empty marker
        for name in junk:
            (directory / name).mkdir()
        (directory / junk[0] / ".snapkeep-commit.json").write_bytes(os.urandom(512))
        (directory / junk[0] / "__0_0.distcp").write_bytes(os.urandom(4096))
        (directory / junk[1] / ".snapkeep-commit.json").write_bytes(b"")
        return junk
    (directory / junk[0]).write_bytes(os.urandom(4096))
    (directory / junk[1]).write_bytes(b"")
    return junk


def _corrupt(path: pathlib.Path) -> None:
    """Flip one byte in the middle of a snapshot (its largest file for a directory)."""
    if path.is_dir():
        path = max((p for p in path.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_junk_files_are_skipped_never_counted_nor_deleted(door: Door, tmp_path: pathlib.Path,
                                                          capfd: Any) -> None:
    """Junk named like snapshots beside real ones, keep=3: the rerun resumes from the newest
    real one, retention keeps three real snapshots and leaves the junk alone; with the newest
    corrupted there is still one to fall back to. (Before: the Checkpointer counted the junk
    as its own: after two saves only one real snapshot was left.)"""
    door.train(tmp_path, 3, keep=KeepLatest(3))
    junk = _plant_junk(tmp_path, door)
    capfd.readouterr()
    door.train(tmp_path, 5, keep=KeepLatest(3))
    err = capfd.readouterr().err
    assert f"snapkeep: resuming from {door.snapshot_name(3)} (step 3) in {tmp_path}" in err
    assert f"snapkeep: skipped {door.snapshot_name(999)} (step 999)" in err
    real = [door.snapshot_name(s) for s in (3, 4, 5)]
    assert _snapshots(tmp_path, door) == real + junk[::-1]  # by step: 3, 4, 5, 800, 999
    _corrupt(tmp_path / door.snapshot_name(5))
    model = door.train(tmp_path, 5, keep=KeepLatest(3))  # falls back to 4, retrains step 5
    err = capfd.readouterr().err
    assert f"snapkeep: resuming from {door.snapshot_name(4)} (step 4) in {tmp_path}" in err
    reference = door.train(tmp_path / "straight", 5)
    assert torch.equal(model.weight, reference.weight)
    assert (tmp_path / junk[0]).exists() and (tmp_path / junk[1]).exists()


def test_a_misspelled_keep_best_metric_is_refused_before_anything_is_deleted(
        door: Door, tmp_path: pathlib.Path) -> None:
    """``KeepBest(1, 'val_los')`` while the snapshots record ``val_loss``: ValueError naming the
    metric before retention would delete anything. (Before, the Checkpointer logged a
    traceback after each commit and kept every snapshot.)"""
    door.train(tmp_path, 2)
    before = _snapshots(tmp_path, door)
    with pytest.raises(ValueError, match="val_los"):
        door.train(tmp_path, 6, keep=KeepBest(1, "val_los"))
    after = _snapshots(tmp_path, door)
    assert set(before) <= set(after)  # nothing of the earlier run deleted


def test_a_second_trainer_and_a_prune_are_refused_while_one_runs(
        door: Door, tmp_path: pathlib.Path) -> None:
    """A live trainer (another process) holds the directory: a second trainer gets
    StoreLockedError and ``snapkeep prune --yes`` refuses naming it, deleting nothing (before:
    prune deleted snapshots under the live trainer)."""
    door.train(tmp_path, 3)
    code = f"DIR = {str(tmp_path)!r}\n{door.hold_code}print('READY', flush=True)\n" \
           "import sys\nsys.stdin.read()\n"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=killing.env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "READY"
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            door.train(tmp_path, 4)
        if not door.sharded:  # (snapkeep prune deletes single files only)
            result = CliRunner().invoke(cli, ["prune", str(tmp_path), "--keep-latest", "1",
                                              "--yes"])
            assert result.exit_code == 1 and f"pid {holder.pid}" in result.output, result.output
        assert _snapshots(tmp_path, door) == [door.snapshot_name(s) for s in (1, 2, 3)]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    if door.sharded:
        return
    result = CliRunner().invoke(cli, ["prune", str(tmp_path), "--keep-latest", "1", "--yes"])
    assert result.exit_code == 0, result.output
    assert _snapshots(tmp_path, door) == [door.snapshot_name(3)]
    door.train(tmp_path, 4)
    assert _snapshots(tmp_path, door) == [door.snapshot_name(3), door.snapshot_name(4)]


def test_a_first_run_and_a_resume_are_said_on_stderr(door: Door, tmp_path: pathlib.Path,
                                                     capfd: Any) -> None:
    door.train(tmp_path, 2)
    err = capfd.readouterr().err
    assert f"in {tmp_path}, starting fresh" in err and "snapkeep: no snapshot of" in err
    door.train(tmp_path, 3)
    assert capfd.readouterr().err.splitlines()[0] == (
        f"snapkeep: resuming from {door.snapshot_name(2)} (step 2) in {tmp_path}")
    result = CliRunner().invoke(cli, ["verify", str(tmp_path)])  # no -t needed (before: exit 1,
    assert result.exit_code == 0, result.output  # "no snapshots matching" for a Checkpointer)


def test_the_reading_doors_agree_with_the_training_door(door: Door,
                                                        tmp_path: pathlib.Path) -> None:
    """``load_latest`` and ``snapkeep verify`` (without ``-t``: the template is found from the
    manifests) see the same newest valid snapshot as the training door, junk beside it."""
    door.train(tmp_path, 3)
    _plant_junk(tmp_path, door)
    template = door.snapshot_name(0)[:-1] + "{.iteration}"
    with pytest.warns(RuntimeWarning, match="skipping (sharded )?snapshot"):
        state = snapkeep.load_latest(tmp_path, template=template)
    assert state is not None and state.get("step", 3) == 3
    result = CliRunner().invoke(cli, ["verify", str(tmp_path)])
    assert door.snapshot_name(3) in result.output, result.output
    assert door.snapshot_name(999) in result.output  # the junk is named as not valid
