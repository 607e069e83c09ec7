"""The Lightning door (issue 26): a real ``Trainer`` fit on CPU through
``SnapkeepCheckpointIO`` + snapkeep's ``ModelCheckpoint``, killed (SIGKILL mid-save and at a
random step) and rerun with ``ckpt_path="last"``, ends bit-identical to an uninterrupted run;
a flipped byte in the newest checkpoint falls back with a warning where stock Lightning loads
or raises; a commit held back shows ``last`` never names an uncommitted file and the top-k
removal waits for the commit. The 50-trial version is ``tools/lightning_crash_trials.py``.

Lightning restarts a plain DataLoader mid-epoch from the start of its order, so exactness is
tested at the boundary it supports: snapshots at epoch ends (the worker's ModelCheckpoint);
the kills land anywhere, mid-epoch and mid-save included."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from snapkeep.errors import StoreLockedError  # noqa: E402
from snapkeep.lightning import ALIAS_FORMAT, ModelCheckpoint, SnapkeepCheckpointIO  # noqa: E402
from snapkeep.writing import ThreadWriter  # noqa: E402
from support import killing, zygote  # noqa: E402
from support.killing import BOUND_S, assert_identical, env  # noqa: E402
from support.writer_gates import EventGate  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import lightning_worker  # noqa: E402

WORKER = HERE / "lightning_worker.py"


def _run(out: pathlib.Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The worker run to its end (or its own SIGKILL), forked by the session's zygote that
    imported Lightning once (tests/support/zygote.py): a process of its own, without its
    ~6 s import."""
    return zygote.run(zygote.frameworks(env()), str(WORKER), [str(out), *extra],
                      cwd=os.getcwd(), env=env(), timeout=BOUND_S)


def _final(out: pathlib.Path) -> Any:
    return torch.load(out / "final.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(6 * BOUND_S)
def test_killed_mid_save_then_at_a_random_step_then_rerun_ends_bit_identical(
        tmp_path: pathlib.Path) -> None:
    rng = random.Random(os.environ.get("SNAPKEEP_TEST_SEED", "26"))
    threads = torch.get_num_threads()  # the uninterrupted run, here, as the workers run
    torch.set_num_threads(1)
    try:
        assert lightning_worker.main([str(tmp_path / "ref")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "run"
    # 1. mid-save: the k-th save SIGKILLs the process half-way through its temp file
    k = rng.randint(2, 5)
    mid_save = _run(out, "--kill-in-save", str(k))
    assert mid_save.returncode == -signal.SIGKILL, mid_save.stderr
    assert any(".snapkeep-tmp." in n for n in os.listdir(out / "ckpts"))  # killed in the write
    # 2. the rerun resumes from the newest committed snapshot (step 8 (k-1)); it is killed in
    # turn at a random later step (mid-epoch, or with a save in flight)
    resumed = 8 * (k - 1)
    killing.kill_after(WORKER, out, rng.randint(resumed + 1, 47), [], args=[str(out)])
    # 3. the last rerun runs to the end, bit-identical to the uninterrupted run
    rerun = _run(out)
    assert rerun.returncode == 0, rerun.stderr
    assert "Restored all states from the checkpoint at " in rerun.stderr
    assert_identical(_final(tmp_path / "ref"), _final(out))


@pytest.mark.slow
@pytest.mark.timeout(3 * BOUND_S)
def test_sigterm_commits_a_snapshot_of_the_step_before_the_process_exits(
        tmp_path: pathlib.Path) -> None:
    proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step ") and int(line.split()[1]) >= 12:
                os.kill(proc.pid, signal.SIGTERM)
                break
        # snapkeep's preemption (ModelCheckpoint(preemption=True), the default): the snapshot
        # of the next step committed, then exit 143 (test_lightning_preemption.py)
        assert proc.wait(timeout=BOUND_S) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    ckpts = tmp_path / "ckpts"
    io = SnapkeepCheckpointIO()
    try:
        newest = io.entries(str(ckpts))[-1]
        assert newest.step is not None and newest.step >= 12 and newest.step % 8 != 0
        assert json.loads((ckpts / "last.ckpt").read_bytes())["target"] == newest.name
        assert not (tmp_path / "final.pt").exists()  # it left fit by the exception
        assert io.load_checkpoint(str(ckpts / "last.ckpt"))["global_step"] == newest.step
    finally:
        io.close()


def _flip_middle_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_with_a_warning(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    epochs = ["--epochs", "3"]
    assert lightning_worker.main([str(tmp_path / "ref"), *epochs]) == 0
    reference = _final(tmp_path / "ref")

    # snapkeep: the newest snapshot (step 24) is corrupt; the rerun says so on stderr (the
    # engine session's resume notice, as the Checkpointer's), naming it and the snapshot it
    # loads instead (step 16), trains the last epoch again and ends identical
    out = tmp_path / "snapkeep"
    assert lightning_worker.main([str(out), *epochs]) == 0
    newest = out / "ckpts" / "epoch=2-step=24.ckpt"
    _flip_middle_byte(newest)
    os.remove(out / "final.pt")
    capfd.readouterr()
    assert lightning_worker.main([str(out), *epochs]) == 0
    err = capfd.readouterr().err
    assert f"snapkeep: resuming from epoch=1-step=16.ckpt (step 16) in {out / 'ckpts'}" in err
    assert "snapkeep: skipped epoch=2-step=24.ckpt (step 24): " in err and "checksum" in err
    assert_identical(reference, _final(out))

    # stock Lightning (TorchCheckpointIO, its ModelCheckpoint): the same flip in the file it
    # resumes from (last.ckpt, the newest by mtime) is either loaded as is -- torch.load checks
    # no checksum -- or raises; it never falls back to the previous checkpoint
    stock = tmp_path / "stock"
    assert lightning_worker.main([str(stock), *epochs, "--stock"]) == 0
    _flip_middle_byte(stock / "ckpts" / "last.ckpt")
    os.remove(stock / "final.pt")
    try:
        lightning_worker.main([str(stock), *epochs, "--stock"])
    except Exception as e:  # noqa: BLE001  (stock raised: the run cannot resume)
        assert not (stock / "final.pt").exists(), e
    else:  # loaded the damaged weights silently: ends different from the reference
        with pytest.raises(AssertionError):
            assert_identical(reference, _final(stock))


class _HoldSecondCommit(pl.Callback):
    """At the start of epoch 2, with the snapshot of epoch 1 held in its write: check what is on
    disk, then let the commit through and check again."""

    def __init__(self, gate: EventGate, io: SnapkeepCheckpointIO, ckpts: pathlib.Path) -> None:
        self.gate, self.io, self.ckpts = gate, io, ckpts
        self.checked = False

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch != 2:
            return
        self.gate.wait_entered()  # epoch 0's save (let through before fit)
        self.gate.wait_entered()  # epoch 1's save, held
        files = sorted(n for n in os.listdir(self.ckpts) if ".snapkeep-tmp." not in n)
        # the held snapshot is not there under its name; top-k has not removed the old one;
        # last still names the committed one
        assert files == [".snapkeep", "epoch=0-step=8.ckpt", "last.ckpt"], files
        assert self._last_target() == "epoch=0-step=8.ckpt"
        self.gate.open()
        self.io.wait(30)
        files = sorted(os.listdir(self.ckpts))
        assert files == [".snapkeep", "epoch=1-step=16.ckpt", "last.ckpt"], files
        assert self._last_target() == "epoch=1-step=16.ckpt"
        self.checked = True

    def _last_target(self) -> str:
        record = json.loads((self.ckpts / "last.ckpt").read_bytes())
        assert record["format"] == ALIAS_FORMAT
        return str(record["target"])


def test_last_never_names_an_uncommitted_file_and_removal_waits_for_the_commit(
        tmp_path: pathlib.Path) -> None:
    gate = EventGate()
    io = SnapkeepCheckpointIO(ThreadWriter(savefun=gate.savefun))
    ckpts = tmp_path / "ckpts"
    hold = _HoldSecondCommit(gate, io, ckpts)
    try:
        gate.release()  # epoch 0's save goes through
        torch.manual_seed(0)
        trainer = pl.Trainer(
            max_epochs=3, accelerator="cpu", enable_progress_bar=False, logger=False,
            enable_model_summary=False, plugins=[io], default_root_dir=tmp_path,
            callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True), hold])
        trainer.fit(lightning_worker.make_module(), lightning_worker.loader())
    finally:
        gate.close()
        io.close()
    assert hold.checked
    assert sorted(os.listdir(ckpts)) == [".snapkeep", "epoch=2-step=24.ckpt", "last.ckpt"]
    # the last reference costs no second write: the alias record is a few dozen bytes
    assert (ckpts / "last.ckpt").stat().st_size < 200
    # and "last" loads the snapshot it names, verified
    loaded = SnapkeepCheckpointIO().load_checkpoint(ckpts / "last.ckpt")
    assert loaded["global_step"] == 24


class _GatedTorchIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO whose second and later saves wait for ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.saves = 0

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self.saves += 1
        if self.saves > 1 and not self.gate.wait(30):
            raise TimeoutError("gate never opened")
        super().save_checkpoint(checkpoint, path, storage_options)


class _SeeStockWindow(pl.Callback):
    def __init__(self, io: _GatedTorchIO, ckpts: pathlib.Path) -> None:
        self.io, self.ckpts = io, ckpts
        self.seen: list[str] | None = None
        self.last_resolves = True

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 2:  # epoch 1's save is held in the async thread
            self.seen = sorted(os.listdir(self.ckpts))
            self.last_resolves = os.path.exists(self.ckpts / "last.ckpt")
            self.io.gate.set()


def test_stock_async_io_points_last_at_an_unwritten_file_and_deletes_the_old_one_first(
        tmp_path: pathlib.Path) -> None:
    """The contrast: Lightning's AsyncCheckpointIO with its ModelCheckpoint, the same hold."""
    gated = _GatedTorchIO()
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()  # else the link of epoch 0 fails at once: its directory does not exist yet
    see = _SeeStockWindow(gated, ckpts)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", enable_progress_bar=False, logger=False,
        enable_model_summary=False, plugins=[AsyncCheckpointIO(gated)],
        default_root_dir=tmp_path,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=ckpts, save_last="link"), see])
    try:
        trainer.fit(lightning_worker.make_module(), lightning_worker.loader())
    finally:
        gated.gate.set()
    # while epoch 1's save was in flight: epoch 0's checkpoint was already deleted and last.ckpt
    # was a link to the file not yet written -- no durable checkpoint at all in that window
    assert see.seen == ["last.ckpt"], see.seen
    assert not see.last_resolves


def test_a_second_trainer_on_the_directory_is_refused(tmp_path: pathlib.Path) -> None:
    first, second = SnapkeepCheckpointIO(), SnapkeepCheckpointIO()
    first.open(str(tmp_path))
    try:
        with pytest.raises(StoreLockedError, match="another SnapkeepCheckpointIO"):
            second.save_checkpoint({"global_step": 1, "w": torch.ones(2)},
                                   str(tmp_path / "x.ckpt"))
        assert not (tmp_path / "x.ckpt").exists()
        first.teardown()  # released: the second one may take it
        second.open(str(tmp_path))
    finally:
        first.close()
        second.close()


def test_fabric_saves_and_loads_through_it(tmp_path: pathlib.Path) -> None:
    from lightning.fabric import Fabric

    io = SnapkeepCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = torch.nn.Linear(4, 2)
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "global_step": 7})
    io.wait()
    assert (tmp_path / ".snapkeep" / "fabric.ckpt.json").exists()
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    fabric.load(path, {"model": model})
    assert torch.equal(model.weight, before)
    io.close()


def test_on_an_object_store_the_alias_the_removal_and_the_fallback_work(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"memory://lightning-{tmp_path.name}"
    io = SnapkeepCheckpointIO()
    try:
        for step in (8, 16):
            io.save_checkpoint({"global_step": step, "w": torch.full((1000,), float(step))},
                               f"{root}/epoch={step // 8 - 1}-step={step}.ckpt")
        io.link(f"{root}/epoch=1-step=16.ckpt", f"{root}/last.ckpt")
        io.wait()
        assert json.loads(fs.cat(f"{root}/last.ckpt"))["target"] == "epoch=1-step=16.ckpt"
        newest = f"{root}/epoch=1-step=16.ckpt"
        data = bytearray(fs.cat(newest))
        data[len(data) // 2] ^= 0xFF
        fs.pipe(newest, bytes(data))
        capfd.readouterr()
        loaded = io.load_checkpoint(f"{root}/last.ckpt")
        err = capfd.readouterr().err
        assert "snapkeep: resuming from epoch=0-step=8.ckpt (step 8)" in err
        assert "snapkeep: skipped epoch=1-step=16.ckpt (step 16)" in err
        assert loaded["global_step"] == 8 and torch.equal(loaded["w"], torch.full((1000,), 8.0))
        io.remove_checkpoint(f"{root}/epoch=0-step=8.ckpt")
        io.wait()
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
            ".snapkeep", "epoch=1-step=16.ckpt", "last.ckpt"]
    finally:
        io.close()
        fs.rm(root, recursive=True)


# -- adoption, references and what the user reads (issue 32) --------------------------------------
def _fit(ckpts: pathlib.Path, epochs: int, *, stock: bool, save_top_k: int = 1,
         io: SnapkeepCheckpointIO | None = None) -> Any:
    """``epochs`` epochs of the worker's module, resumed with ``ckpt_path="last"``: stock
    Lightning (its ``ModelCheckpoint``, ``TorchCheckpointIO``) or the documented two-line
    change (snapkeep's ``ModelCheckpoint`` and ``SnapkeepCheckpointIO``)."""
    torch.manual_seed(0)
    kind = pl.callbacks.ModelCheckpoint if stock else ModelCheckpoint
    plugins = [] if stock else [io or SnapkeepCheckpointIO()]
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", enable_progress_bar=False, logger=False,
        enable_model_summary=False, plugins=plugins, default_root_dir=ckpts.parent,
        callbacks=[kind(dirpath=ckpts, save_last=True, save_top_k=save_top_k)])
    try:
        trainer.fit(lightning_worker.make_module(), lightning_worker.loader(), ckpt_path="last")
    finally:
        for plugin in plugins:
            plugin.close()
    return trainer


def _steps(out: str) -> list[int]:
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]


@pytest.mark.parametrize("save_top_k", [1, 0])
def test_a_run_trained_with_stock_lightning_resumes_from_its_checkpoints_never_overwritten(
        tmp_path: pathlib.Path, capfd: Any, save_top_k: int) -> None:
    """Adoption: 2 epochs with stock Lightning (``save_last=True``), then the two-line change
    with ``ckpt_path="last"``: it resumes from step 16 (unverified, said on stderr), trains the
    8 steps of epoch 3, and the stock ``last.ckpt`` (with ``save_top_k=0`` the run's only
    checkpoint) is kept as it was. (971f8e4: "starting fresh", 24 steps, and with
    ``save_top_k=0`` the stock ``last.ckpt`` overwritten by the fresh run's.)"""
    ckpts = tmp_path / "ckpts"
    _fit(ckpts, 2, stock=True, save_top_k=save_top_k)
    stock_last = (ckpts / "last.ckpt").read_bytes()
    capfd.readouterr()
    trainer = _fit(ckpts, 3, stock=False, save_top_k=save_top_k)
    out, err = capfd.readouterr()
    assert "starting fresh" not in err
    assert f"snapkeep: resuming from last.ckpt (step 16) in {ckpts}" in err \
        or f"snapkeep: resuming from epoch=1-step=16.ckpt (step 16) in {ckpts}" in err, err
    assert "has no snapkeep manifest" in err and "unverified" in err
    assert _steps(out) == list(range(17, 25))
    assert trainer.global_step == 24
    assert (ckpts / "last.ckpt").read_bytes() == stock_last  # never overwritten
    # the next run resumes from snapkeep's own snapshot of step 24 (last-v1.ckpt names it)
    capfd.readouterr()
    _fit(ckpts, 4, stock=False, save_top_k=save_top_k)
    out, err = capfd.readouterr()
    assert _steps(out) == list(range(25, 33)), err
    assert "(step 24)" in err and "unverified" not in err
    assert (ckpts / "last.ckpt").read_bytes() == stock_last


def test_a_fallback_is_named_in_lightnings_restored_line_and_a_first_run_gives_no_hint(
        tmp_path: pathlib.Path, capfd: Any, caplog: Any) -> None:
    """What the user reads: a first run says "starting fresh" without Lightning's hint to set
    ``save_last=True`` (it is set); after a fallback past a corrupt snapshot Lightning's
    ``Restored all states from the checkpoint at`` names the file really loaded.
    (971f8e4: the hint, and ``Restored ... at .../epoch=1-step=16.ckpt`` while snapkeep loaded
    ``epoch=0-step=8.ckpt``.)"""
    import logging

    ckpts = tmp_path / "ckpts"
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    with warnings_recorded() as seen:
        _fit(ckpts, 2, stock=False, save_top_k=-1)
    assert not [w for w in seen if "save_last=True" in str(w.message)]
    assert "starting fresh" in capfd.readouterr().err
    _flip_middle_byte(ckpts / "epoch=1-step=16.ckpt")
    caplog.clear()
    _fit(ckpts, 3, stock=False, save_top_k=-1)
    err = capfd.readouterr().err
    assert "snapkeep: resuming from epoch=0-step=8.ckpt (step 8)" in err
    restored = [r.getMessage() for r in caplog.records if "Restored all states" in r.getMessage()]
    assert restored and all(m.endswith("epoch=0-step=8.ckpt") for m in restored), restored


def warnings_recorded() -> Any:
    import warnings

    return warnings.catch_warnings(record=True)


def _alias(ckpts: pathlib.Path, target: str, step: Any) -> None:
    (ckpts / "last.ckpt").write_text(json.dumps({"format": ALIAS_FORMAT, "target": target,
                                                 "step": step}))


def test_an_alias_resolves_only_to_a_verified_file_of_its_directory(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    """References are checked like files: an alias naming a symlink out of the directory, a
    snapshot of another step, or nested 2,040 deep is refused (said on stderr) and the newest
    snapshot that verifies is loaded instead. (971f8e4: the outside file loaded unverified;
    the step never compared; ``RecursionError``.)"""
    ckpts, outside = tmp_path / "ckpts", tmp_path / "outside"
    outside.mkdir()
    torch.save({"global_step": 999, "evil": torch.ones(1)}, outside / "evil.ckpt")
    io = SnapkeepCheckpointIO()
    try:
        for step in (8, 16):
            io.save_checkpoint({"global_step": step, "w": torch.full((4,), float(step))},
                               str(ckpts / f"epoch={step // 8 - 1}-step={step}.ckpt"))
        io.wait()
        os.symlink(outside / "evil.ckpt", ckpts / "link.ckpt")
        cases = {"symlink": ("link.ckpt", 999), "other step": ("epoch=0-step=8.ckpt", 16)}
        for why, (target, step) in cases.items():
            _alias(ckpts, target, step)
            capfd.readouterr()
            loaded = io.load_checkpoint(str(ckpts / "last.ckpt"))
            err = capfd.readouterr().err
            assert loaded["global_step"] == 16 and "evil" not in loaded, why
            assert "last.ckpt: alias refused" in err, (why, err)
        nested = b'{"a":' * 2040 + b"1" + b"}" * 2040
        assert len(nested) <= 4096 * 4
        (ckpts / "last.ckpt").write_bytes(nested[:4096])
        loaded = io.load_checkpoint(str(ckpts / "last.ckpt"))  # no RecursionError
        assert loaded["global_step"] == 16
        _alias(ckpts, "epoch=0-step=8.ckpt", 8)  # a valid alias still resolves
        assert io.load_checkpoint(str(ckpts / "last.ckpt"))["global_step"] == 8
    finally:
        io.close()


def test_memory_and_incremental_are_refused_unless_of_their_accepted_values() -> None:
    """``memory=`` and ``incremental=`` take the Checkpointer's values; anything else is named
    with them, before anything is created."""
    with pytest.raises(TypeError, match=r"memory must be a snapkeep\.MemoryTier\(every=.*got 5"):
        SnapkeepCheckpointIO(memory=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="incremental must be True or False, got 'yes'"):
        SnapkeepCheckpointIO(incremental="yes")  # type: ignore[arg-type]


def test_ckpt_path_last_resumes_from_ram_when_storage_holds_no_checkpoint_yet(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    """RAM every step, checkpoints every 100: after 2 steps storage holds nothing and RAM step
    2. ``ckpt_path="last"`` resumes from RAM (said on stderr; before: Lightning found no last
    checkpoint and the run started fresh), ending as an uninterrupted run."""
    from framework_doors import train_lightning

    from snapkeep import MemoryTier

    memory = MemoryTier(every=1, replicas=0, root=str(tmp_path / "shm"))
    out = tmp_path / "run"
    train_lightning(out, 2, every=100, memory=memory)
    assert not [p for p in out.iterdir() if p.name.startswith("ckpt_")]
    capfd.readouterr()
    resumed = train_lightning(out, 4, every=100, memory=memory)
    err = capfd.readouterr().err
    assert "snapkeep: resuming from RAM step 2 (own copy; storage's newest: None) in " in err, err
    straight = train_lightning(tmp_path / "straight", 4, every=100)
    assert torch.equal(resumed.weight, straight.weight)
