"""One trainer owns a snapshot directory (docs/guarantees.md), whatever template, Lightning
``filename``, door or spelling of the path names its files: a second trainer and ``snapkeep
prune`` are refused while it lives, and nothing of it is deleted. Each case was reproduced on
971f8e4, where the lock was keyed by one template's text. Real processes, real files."""

from __future__ import annotations

import os
import pathlib
import selectors
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
from click.testing import CliRunner

import snapkeep
from snapkeep.cli import cli
from snapkeep.errors import StoreLockedError

WAIT_S = 120


def _files(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file())


@pytest.fixture
def hold(tmp_path: pathlib.Path) -> Iterator[object]:
    """``hold(code)``: run ``code`` (which prints nothing) in another process, then keep it
    alive (holding whatever it opened) until the test ends; returns its pid."""
    procs: list[subprocess.Popen[str]] = []

    def start(code: str) -> int:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code) + "\nprint('READY', flush=True)\n"
             "import sys\nsys.stdin.readline()\n"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            line = proc.stdout.readline().strip() if sel.select(timeout=WAIT_S) else ""
        if line != "READY":
            proc.kill()
            _, err = proc.communicate(timeout=WAIT_S)
            raise AssertionError(f"the holder did not start: {line!r} {err}")
        return proc.pid

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)


CHECKPOINTER_IN_SUB = """
    import torch, snapkeep
    ckpt = snapkeep.Checkpointer({directory!r}, template="snap/iter_{{step}}")
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        ckpt.save(step, {{"model": model}})
    ckpt.wait()
"""


def test_a_checkpointer_with_a_sub_directory_template_owns_that_directory(
        tmp_path: pathlib.Path, hold: object) -> None:
    """Live ``Checkpointer(D, "snap/iter_{step}")``: ``snapkeep prune D/snap --yes`` and a
    second ``Checkpointer(D/snap, "iter_{step}")`` are refused, under every spelling of the
    path (``D/./snap``, a symlink to D, a relative path). (971f8e4: prune deleted its snapshots
    and the second Checkpointer opened beside it.)"""
    pid = hold(CHECKPOINTER_IN_SUB.format(directory=str(tmp_path)))  # type: ignore[operator]
    snap = tmp_path / "snap"
    assert _files(snap) == ["iter_1", "iter_2"]
    result = CliRunner().invoke(cli, ["prune", str(snap), "--keep-latest", "1", "--yes"])
    assert result.exit_code == 1 and f"pid {pid}" in result.output, result.output
    (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(tmp_path)
    spellings = [str(snap), f"{tmp_path}/./snap", str(tmp_path.parent / f"{tmp_path.name}-link"
                                                         / "snap"),
                 os.path.relpath(snap)]
    for spelling in spellings:
        with pytest.raises(StoreLockedError, match=f"pid {pid}"):
            snapkeep.Checkpointer(spelling, template="iter_{step}")
    with pytest.raises(StoreLockedError, match=f"pid {pid}"):  # another template, same place
        snapkeep.Checkpointer(snap, template="other_{step}")
    assert _files(snap) == ["iter_1", "iter_2"]
    os.unlink(tmp_path.parent / f"{tmp_path.name}-link")


def test_two_checkpointers_of_one_process_on_one_directory_are_refused(
        tmp_path: pathlib.Path) -> None:
    """In one process too: the second spelling of the first one's directory is refused."""
    with snapkeep.Checkpointer(tmp_path, template="snap/iter_{step}"):
        with pytest.raises(StoreLockedError, match="another open Checkpointer"):
            snapkeep.Checkpointer(tmp_path / "snap", template="iter_{step}")


LIGHTNING_HOLDER = """
    import torch
    from snapkeep.lightning import SnapkeepCheckpointIO
    io = SnapkeepCheckpointIO()  # ModelCheckpoint's default filename: no template
    io.open({directory!r})
    for epoch, step in ((0, 2), (1, 4)):
        state = {{"global_step": step, "epoch": epoch, "state_dict": {{"w": torch.ones(2)}},
                 "pytorch-lightning_version": "2.5.0"}}
        io.save_checkpoint(state, {directory!r} + f"/epoch={{epoch}}-step={{step}}.ckpt")
    io.wait()
"""


@pytest.fixture
def lightning_holder(tmp_path: pathlib.Path, hold: object) -> int:
    pytest.importorskip("lightning")
    pid: int = hold(LIGHTNING_HOLDER.format(directory=str(tmp_path)))  # type: ignore[operator]
    assert _files(tmp_path) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    return pid


def test_a_second_lightning_trainer_with_another_filename_is_refused(
        tmp_path: pathlib.Path, lightning_holder: int) -> None:
    """A second Trainer on the same ``dirpath`` with ``ModelCheckpoint(filename="{step}")`` and
    ``SnapkeepCheckpointIO(keep=1)`` beside a live one (default filename) is refused before it
    trains; the live one's checkpoints stay. (971f8e4: it ran, and its retention deleted the
    live trainer's ``epoch=0-step=2.ckpt``.)"""
    import lightning.pytorch as pl

    from snapkeep.lightning import ModelCheckpoint, SnapkeepCheckpointIO

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            return self.net(torch.ones(1, 2)).sum()

        def train_dataloader(self) -> object:
            return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)

        def configure_optimizers(self) -> object:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    io = SnapkeepCheckpointIO(keep=1)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}",
                                                    every_n_train_steps=1)],
                         plugins=[io], default_root_dir=tmp_path)
    try:
        with pytest.raises(StoreLockedError, match=f"pid {lightning_holder}"):
            trainer.fit(Tiny())
    finally:
        io.close()
    assert _files(tmp_path) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]


@pytest.mark.parametrize("template", ["epoch={.epoch}-step={.iteration}.ckpt", "*.ckpt", None])
def test_prune_of_a_live_lightning_directory_is_refused(
        tmp_path: pathlib.Path, lightning_holder: int, template: str | None) -> None:
    """``snapkeep prune D -t 'epoch={.epoch}-step={.iteration}.ckpt' --keep-latest 1 --yes``
    (or ``-t '*.ckpt'``, or no ``-t``) beside a live Lightning trainer: refused naming it,
    nothing deleted (docs/lightning.md's promise; 971f8e4: exit 0, its checkpoints deleted)."""
    flags = ["-t", template] if template is not None else []
    result = CliRunner().invoke(cli, ["prune", str(tmp_path), *flags, "--keep-latest", "1",
                                      "--yes"])
    assert result.exit_code == 1 and f"pid {lightning_holder}" in result.output, result.output
    assert _files(tmp_path) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]


def test_a_lightning_resume_skips_a_checkpointer_snapshot_naming_it(
        tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A Checkpointer's ``ckpt_100`` in a Lightning ``dirpath``: ``ckpt_path="last"`` skips it,
    naming it, and starts fresh (971f8e4: ``resuming from ckpt_100``, then ``KeyError:
    'pytorch-lightning_version'``)."""
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from snapkeep.lightning import ModelCheckpoint, SnapkeepCheckpointIO

    with snapkeep.Checkpointer(tmp_path) as ckpt:
        ckpt.save(100, {"model": torch.nn.Linear(2, 1)})

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            return self.net(torch.ones(1, 2)).sum()

        def train_dataloader(self) -> object:
            return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)

        def configure_optimizers(self) -> object:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    io = SnapkeepCheckpointIO()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path)],
                         plugins=[io], default_root_dir=tmp_path)
    capfd.readouterr()
    try:
        trainer.fit(Tiny(), ckpt_path="last")
    finally:
        io.close()
    err = capfd.readouterr().err
    assert "starting fresh" in err and "snapkeep: skipped ckpt_100 (step 100): a snapshot of " \
        "the checkpointer door, not of this lightning door's run" in err, err
    assert trainer.global_step == 2  # trained from the start
    assert "ckpt_100" in _files(tmp_path)  # another door's snapshot: left alone


def test_a_ppe_resume_skips_a_checkpointer_snapshot_of_the_same_name(
        tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The engine's rule, at every door: a Checkpointer's ``snapshot_iter_5`` (its template set
    to ppe's names) in a ppe out_dir is skipped by the snapshot extension's autoload, named,
    and the run starts fresh; its retention never deletes it."""
    from snapkeep.training import ExtensionsManager, extensions
    from snapkeep.writing import SimpleWriter

    with snapkeep.Checkpointer(tmp_path, template="snapshot_iter_{step}") as ckpt:
        ckpt.save(5, {"model": torch.nn.Linear(2, 1)})
    model = torch.nn.Linear(2, 2)
    manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                                iters_per_epoch=2, writer=SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(extensions.snapshot(autoload=True, n_retains=1), trigger=(1, "iteration"))
    capfd.readouterr()
    manager.start_extensions()
    assert manager.iteration == 0
    err = capfd.readouterr().err
    assert "starting fresh" in err and "snapkeep: skipped snapshot_iter_5 (step 5): a snapshot " \
        "of the checkpointer door, not of this ppe door's run" in err, err
    while not manager.stop_trigger:
        with manager.run_iteration():
            pass
    manager.finalize()
    assert _files(tmp_path) == ["snapshot_iter_2", "snapshot_iter_5"]
