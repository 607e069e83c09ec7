"""The Hugging Face Trainer door (``snapkeep.hf``): real Trainer runs of a tiny GPT-2 built in code
(CPU, no hub download), killed with SIGKILL mid-save and rerun; rotation scenarios of
transformers #39476 and of a reused ``output_dir``."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hf_worker  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from snapkeep import hf  # noqa: E402
from snapkeep.errors import SnapshotCorruptError  # noqa: E402
from support import zygote  # noqa: E402
from support.killing import assert_identical  # noqa: E402

WORKER = pathlib.Path(hf_worker.__file__)
BOUND_S = 120


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")


def _run(out: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The worker run to its end, forked by the session's zygote that imported transformers
    once (tests/support/zygote.py): a process of its own, without its ~5 s import."""
    return zygote.run(zygote.frameworks(_env()), str(WORKER), [str(out), *args],
                      cwd=os.getcwd(), env=_env(), timeout=BOUND_S)


def _run_ok(out: pathlib.Path, *args: str) -> str:
    done = _run(out, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _kill_mid_save(out: pathlib.Path, step: int, stage: str, *args: str) -> None:
    """Run the worker until it holds inside the save of checkpoint-``step`` at ``stage``, then
    SIGKILL it (its own pid only)."""
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out), "--hold-at", str(step),
                             "--hold-stage", stage, *args], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        holding = out / f"holding-{step}"
        deadline = time.monotonic() + BOUND_S
        while not holding.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert holding.exists(), f"the worker ended ({proc.poll()}) before holding"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=BOUND_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    holding.unlink()


def _final(out: pathlib.Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def test_kill_mid_save_stock_resumes_the_broken_directory_latest_verified_the_complete_one(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    reference = tmp_path / "reference"
    _run_ok(reference, "--callback")
    killed = tmp_path / "killed"
    _kill_mid_save(killed, 6, "optimizer", "--callback")  # optimizer.pt half written

    broken = killed / "checkpoint-6"
    assert get_last_checkpoint(str(killed)) == str(broken)  # stock: by number, not content
    assert not (broken / "trainer_state.json").exists()
    assert not (broken / hf.MARKER_NAME).exists()
    capfd.readouterr()
    assert hf.latest_verified(killed) == str(killed / "checkpoint-4")
    err = capfd.readouterr().err  # the engine session's resume notice, as every door's
    assert err.startswith(f"snapkeep: resuming from checkpoint-4 (step 4) in {killed}\n"), err
    assert "snapkeep: skipped checkpoint-6 (step 6): " in err and "no commit marker" in err

    out = _run_ok(killed, "--callback", "--resume", "verified")
    assert f"resumed-from {killed / 'checkpoint-4'}" in out
    differs = _final(reference)
    assert_identical(_final(killed), differs)
    assert hf.latest_verified(killed) == str(killed / "checkpoint-8")  # 6 was re-saved, committed
    hf.verify_checkpoint(broken)


def test_kill_after_the_trainer_finished_before_the_marker_is_not_resumed(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    """Every file the Trainer writes is there (trainer_state.json last), the marker is not: the
    directory is not committed (its files may not be durable), so the one before is resumed."""
    _kill_mid_save(tmp_path, 4, "state", "--callback")
    assert (tmp_path / "checkpoint-4" / "trainer_state.json").exists()
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    capfd.readouterr()
    assert hf.latest_verified(tmp_path) == str(tmp_path / "checkpoint-2")
    assert "snapkeep: skipped checkpoint-4 (step 4)" in capfd.readouterr().err
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "checkpoint-2",
                                            "checkpoint-4"]  # nothing removed


def _train(out: pathlib.Path, *args: str) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_worker.main([str(out), *args])


def test_a_new_best_between_save_steps_is_saved_and_kept(tmp_path: pathlib.Path) -> None:
    """transformers #39476: save_steps 2, eval_steps 3, save_total_limit 1. The best evaluation
    (step 3; ``greater_is_better`` makes the first one best) has no checkpoint in the stock
    Trainer; with the callback it is saved, named best and kept by rotation."""
    common = ["--save-steps", "2", "--eval-steps", "3", "--save-total-limit", "1",
              "--greater-is-better"]
    stock = _train(tmp_path / "stock", *common)
    assert stock.state.best_global_step == 3  # type: ignore[attr-defined]
    assert stock.state.best_model_checkpoint is None  # type: ignore[attr-defined]
    assert sorted(os.listdir(tmp_path / "stock")) == ["checkpoint-8", "final.pt"]

    ours = _train(tmp_path / "ours", *common, "--callback")
    assert ours.state.best_model_checkpoint == str(  # type: ignore[attr-defined]
        tmp_path / "ours" / "checkpoint-3")
    assert sorted(os.listdir(tmp_path / "ours")) == [".snapkeep", "checkpoint-3", "checkpoint-8",
                                                     "final.pt"]
    hf.verify_checkpoint(tmp_path / "ours" / "checkpoint-3")


@pytest.mark.parametrize("door", ["callback", "owned"])
def test_a_stale_checkpoint_in_a_reused_output_dir_keeps_the_new_runs_and_the_best(
        tmp_path: pathlib.Path, door: str) -> None:
    """A checkpoint-700 left by an earlier run (its mtime ahead: written on another node, or
    synced): the stock rotation (by mtime; by number when mtimes lie within a second) protects
    it as "most recent" and deletes every new checkpoint but the best. With the callback (or
    the owned save) the new run keeps its newest two and the best, the stale directory is not
    touched, and load_best_model_at_end loads the best."""
    common = ["--save-steps", "2", "--eval-steps", "2", "--save-total-limit", "2",
              "--greater-is-better", "--load-best", "--stale", "700"]
    _train(tmp_path / "stock", *common)
    assert sorted(os.listdir(tmp_path / "stock")) == ["checkpoint-2", "checkpoint-700",
                                                      "final.pt"]

    ours = tmp_path / door
    trainer = _train(ours, *common, f"--{door}")
    assert sorted(os.listdir(ours)) == [".snapkeep", "checkpoint-2", "checkpoint-6",
                                        "checkpoint-700", "checkpoint-8", "final.pt"]
    assert trainer.state.best_model_checkpoint == str(ours / "checkpoint-2")  # type: ignore
    best = torch.load(ours / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert best["state"]  # a complete checkpoint; the model loaded at the end is its weights
    from safetensors.torch import load_file

    weights = load_file(ours / "checkpoint-2" / "model.safetensors")
    final = _final(ours)
    assert torch.equal(final["transformer.wte.weight"], weights["transformer.wte.weight"])
    assert not torch.equal(final["transformer.wte.weight"],
                           load_file(ours / "checkpoint-8" / "model.safetensors")
                           ["transformer.wte.weight"])
    assert os.listdir(ours / "checkpoint-700") == ["config.json"]


def test_a_flipped_byte_falls_back_with_a_warning(tmp_path: pathlib.Path, capfd: Any) -> None:
    for step in (2, 4):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * 4)
        (ckpt / "sub").mkdir()
        (ckpt / "sub" / "a.bin").write_bytes(b"x" * 10)
        marker = hf.commit_checkpoint(ckpt, run_id="r")
        assert set(marker.files) == {"model.safetensors", "sub/a.bin"}
    assert hf.latest_verified(tmp_path) == str(tmp_path / "checkpoint-4")
    path = tmp_path / "checkpoint-4" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptError, match="model.safetensors.*checksum"):
        hf.verify_checkpoint(tmp_path / "checkpoint-4")
    capfd.readouterr()
    assert hf.latest_verified(tmp_path) == str(tmp_path / "checkpoint-2")
    err = capfd.readouterr().err
    assert f"snapkeep: resuming from checkpoint-2 (step 2) in {tmp_path}" in err
    assert "snapkeep: skipped checkpoint-4 (step 4): " in err and "checksum" in err
    (tmp_path / "checkpoint-2" / "sub" / "a.bin").unlink()
    assert hf.latest_verified(tmp_path) is None
    lines = capfd.readouterr().err.splitlines()
    assert lines[0] == f"snapkeep: no snapshot of 'checkpoint-{{step}}' in {tmp_path}, " \
        "starting fresh"
    assert [line.count("missing") for line in lines[1:]] == [0, 1]


@pytest.mark.parametrize("body", [
    b"not json", b"[]", json.dumps({"format": "other"}).encode(),
    json.dumps({"format": hf.MARKER_FORMAT, "step": 1, "algorithm": "xxh3_128",
                "files": {"../x": {"size_bytes": 1, "checksum": "0" * 32}}}).encode(),
    json.dumps({"format": hf.MARKER_FORMAT, "step": 1, "algorithm": "xxh3_128",
                "files": {"x": {"size_bytes": True, "checksum": "0" * 32}}}).encode(),
    json.dumps({"format": hf.MARKER_FORMAT, "step": -1, "algorithm": "xxh3_128",
                "files": {}}).encode(),
])
def test_a_bad_marker_is_refused_by_name(tmp_path: pathlib.Path, body: bytes) -> None:
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    (ckpt / hf.MARKER_NAME).write_bytes(body)
    with pytest.raises(SnapshotCorruptError, match=hf.MARKER_NAME):
        hf.verify_checkpoint(ckpt)


def test_a_fifo_marker_never_blocks(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    os.mkfifo(ckpt / hf.MARKER_NAME)
    with pytest.raises(SnapshotCorruptError, match="FIFO"):
        hf.read_marker(ckpt)


def test_importing_snapkeep_does_not_import_transformers() -> None:
    code = "import sys, snapkeep; print('transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=BOUND_S)
    assert done.stdout.strip() == "False", done.stderr


def test_the_owned_async_save_killed_mid_save_resumes_bit_identical(
        tmp_path: pathlib.Path) -> None:
    """hf.SnapkeepTrainer writes checkpoint-N in the Trainer's layout on a background thread;
    killed while the save of checkpoint-6 is in flight (weights written, the rest not), the
    rerun resumes checkpoint-4 and ends bit-identical to an uninterrupted stock run."""
    _run_ok(tmp_path / "reference")  # the stock Trainer, in a worker as the killed runs (the
    # test process's thread count would change the float sums)
    killed = tmp_path / "killed"
    _kill_mid_save(killed, 6, "model", "--owned", "--save-total-limit", "2")
    assert get_last_checkpoint(str(killed)) == str(killed / "checkpoint-6")
    assert sorted(os.listdir(killed / "checkpoint-6")) == [
        "config.json", "generation_config.json", "model.safetensors", "training_args.bin"]
    out = _run_ok(killed, "--owned", "--save-total-limit", "2", "--resume", "verified")
    assert f"resumed-from {killed / 'checkpoint-4'}" in out
    assert_identical(_final(killed), _final(tmp_path / "reference"))
    assert sorted(os.listdir(killed)) == [".snapkeep", "checkpoint-6", "checkpoint-8", "final.pt"]
    for step in (6, 8):
        hf.verify_checkpoint(killed / f"checkpoint-{step}")


@pytest.mark.slow
def test_killed_mid_save_with_the_memory_tier_resumes_from_ram_bit_identical(
        tmp_path: pathlib.Path) -> None:
    """``SnapkeepTrainer(memory=MemoryTier(every=1))``, checkpoints every 2 steps: SIGKILL while
    checkpoint-6 is being written (storage's newest committed: 4; RAM: the newest step kept
    before the kill, 5 to 8: training goes on while the write holds, until step 8's save). The
    rerun with ``resume_from_checkpoint=True`` resumes from RAM (said on stderr), writes that
    step as a committed checkpoint first, and ends bit-identical to an
    uninterrupted stock run (dropout included); storage then holding step 8, the tier is
    removed. (Before: no memory tier in the HF door; the rerun resumed from checkpoint-4.)"""
    _run_ok(tmp_path / "reference")
    killed, root = tmp_path / "killed", tmp_path / "shm"
    _kill_mid_save(killed, 6, "model", "--owned", "--memory", str(root))
    held = {int(p.name.rsplit("_", 1)[1])
            for p in root.glob("snapkeep-*/rank0/ram_iter_*")}
    # the training thread goes on while checkpoint-6's background write holds: each step end
    # keeps its step in RAM (the newest one staying until the next is committed), up to step
    # 8, whose save waits for the write in flight (one at a time); the kill lands anywhere there
    assert held and held <= {5, 6, 7, 8}, held
    step = max(held)
    done = _run(killed, "--owned", "--memory", str(root), "--resume", "latest")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"snapkeep: resuming from RAM step {step} (own copy; storage's newest: 4) in " \
        in done.stderr, done.stderr[-3000:]
    assert "resumed-from True" in done.stdout
    hf.verify_checkpoint(killed / f"checkpoint-{step}")  # written from RAM, committed
    assert_identical(_final(killed), _final(tmp_path / "reference"))
    assert list(root.glob("snapkeep-*/rank0/ram_iter_*")) == []


class _FailingAt4(hf.SnapkeepTrainer):
    """The owned save with a background write that fails at step 4 (a full disk, say)."""

    def _snapkeep_write(self, output_dir: str, step: int, *rest: object) -> None:
        if step == 4:
            raise OSError(28, "No space left on device (injected)")
        super()._snapkeep_write(output_dir, step, *rest)  # type: ignore[arg-type]


def test_a_failed_background_save_is_raised_once_at_the_next_save(
        tmp_path: pathlib.Path) -> None:
    from snapkeep.errors import SnapshotSaveError

    model = hf_worker.GPT2LMHeadModel(hf_worker.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=hf_worker.SEQ))
    args = hf_worker.TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, save_steps=2, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
    trainer = _FailingAt4(model=model, args=args, train_dataset=hf_worker.Tokens(64, 64, 1))
    with pytest.raises(SnapshotSaveError, match="background save") as caught:
        trainer.train()
    assert isinstance(caught.value.__cause__, OSError)
    assert trainer.state.global_step == 6  # raised by the save of step 6, which did not run
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "checkpoint-2"]
    hf.verify_checkpoint(tmp_path / "checkpoint-2")
    trainer.wait_for_checkpoint()  # raised once: nothing left to raise


def test_preemption_commits_the_step_says_preempted_exits_143_and_the_rerun_is_identical(
        tmp_path: pathlib.Path) -> None:
    """``SnapkeepCallback(preemption=True)`` with the owned save: a real SIGTERM to this
    process after step 3 is agreed at that step's end, checkpoint-3 is saved and committed,
    the status says ``preempted`` and ``train()`` raises ``SystemExit(143)``; the rerun from it
    (``latest_verified``) ends bit-identical to an uninterrupted run."""
    import framework_doors
    from transformers import TrainerCallback

    import snapkeep

    class SignalAt3(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded by snapkeep's handler

    with pytest.raises(SystemExit) as exited:
        framework_doors.train_hf(tmp_path, 8, every=100, preemption=True,
                                 callbacks=(SignalAt3(),))
    assert exited.value.code == 143
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "checkpoint-3"]
    hf.verify_checkpoint(tmp_path / "checkpoint-3")
    status = snapkeep.session.run_status(str(tmp_path))
    assert status is not None and status.state == "preempted" and status.step == 3
    assert status.snapshots == ("checkpoint-3",) and status.reason == "signal SIGTERM"
    resumed = framework_doors.train_hf(tmp_path, 8, every=100)
    reference = framework_doors.train_hf(tmp_path / "straight", 8, every=100)
    assert torch.equal(resumed.weight, reference.weight)
    assert torch.equal(resumed.bias, reference.bias)



# -- adoption, copies and a user's directory (issue 32) -------------------------------------------
def test_an_output_dir_of_the_stock_trainer_is_resumed_unverified_never_a_fresh_start(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    """Adoption: the stock Trainer (checkpoint-2, checkpoint-4, no markers) killed while saving
    checkpoint-6, then the callback and ``latest_verified``: checkpoint-4 is resumed
    (unverified, said on stderr; the half-written checkpoint-6 skipped), and the run ends as
    the uninterrupted one. (971f8e4: both skipped, "starting
    fresh", 8 steps trained from scratch over the user's run.)"""
    threads = torch.get_num_threads()  # the killed worker runs on one thread (_env): so do
    torch.set_num_threads(1)           # the in-process runs, or their sums round differently
    try:
        _adopt_stock_checkpoints(tmp_path, capfd)
    finally:
        torch.set_num_threads(threads)


def _adopt_stock_checkpoints(tmp_path: pathlib.Path, capfd: Any) -> None:
    reference = tmp_path / "reference"
    _train(reference, "--callback")
    out = tmp_path / "out"
    _kill_mid_save(out, 6, "model")  # the stock Trainer, killed while it saves checkpoint-6
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    capfd.readouterr()
    trainer: Any = _train(out, "--callback", "--resume", "verified")
    captured = capfd.readouterr()
    assert f"resumed-from {out / 'checkpoint-4'}" in captured.out
    assert f"snapkeep: resuming from checkpoint-4 (step 4) in {out}" in captured.err
    assert "checkpoint-4 has no commit marker" in captured.err and "unverified" in captured.err
    assert "snapkeep: skipped checkpoint-6 (step 6): " in captured.err  # half written
    assert trainer.state.global_step == 8
    assert_identical(_final(reference), _final(out))
    # the adopted ones are kept as they were (never marked, counted or deleted); the new ones
    # are committed, and the next restart resumes the newest committed one
    assert not (out / "checkpoint-4" / hf.MARKER_NAME).exists()
    assert hf.latest_verified(out) == str(out / "checkpoint-8")


def test_an_interrupted_save_of_the_first_checkpoint_is_not_adopted(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    """Every file of checkpoint-2 is written, the marker is not (the first save, killed): it is
    snapkeep's interrupted save (claimed before the Trainer wrote it), not a stock checkpoint
    to adopt: a fresh start, said with why."""
    _kill_mid_save(tmp_path, 2, "state", "--callback")
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").exists()
    capfd.readouterr()
    assert hf.latest_verified(tmp_path) is None
    err = capfd.readouterr().err
    assert "snapkeep: skipped checkpoint-2 (step 2)" in err and "interrupted" in err, err


def test_a_copied_checkpoint_is_never_chosen_and_verify_reports_it(
        tmp_path: pathlib.Path, capfd: Any) -> None:
    """``cp -r checkpoint-4 checkpoint-40``: its marker records step 4; ``latest_verified``
    skips it (named, with why) on every restart, retention never counts it, and ``snapkeep
    verify`` reports it bad and exits 1. (971f8e4: checkpoint-40 chosen; verify exit 2.)"""
    import shutil

    from click.testing import CliRunner

    from snapkeep.cli import cli

    _train(tmp_path, "--callback")
    shutil.copytree(tmp_path / "checkpoint-4", tmp_path / "checkpoint-40")
    capfd.readouterr()
    for _ in range(2):
        assert hf.latest_verified(tmp_path) == str(tmp_path / "checkpoint-8")
        err = capfd.readouterr().err
        assert "snapkeep: skipped checkpoint-40 (step 40): " in err and "step 4" in err, err
    result = CliRunner().invoke(cli, ["verify", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "checkpoint-40" in result.output and "marker records step 4" in result.output


def test_a_users_directory_at_a_checkpoint_name_is_refused_and_left_untouched(
        tmp_path: pathlib.Path) -> None:
    """A user's ``checkpoint-4/my_eval_notes.txt`` before a callback run with
    ``save_total_limit=1``: the save of step 4 is refused before the Trainer writes into it
    (``SnapshotStorageError`` naming it and what to do); its file is untouched, never listed by
    a marker nor rotated away. (971f8e4: the step-4 marker listed the user's file and only
    checkpoint-12 was left at the end.)"""
    from snapkeep.errors import SnapshotStorageError

    notes = tmp_path / "checkpoint-4" / "my_eval_notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("eval notes")
    with pytest.raises(SnapshotStorageError, match=r"checkpoint-4 exists and is not a Trainer "
                                                   r"checkpoint.*Move it away"):
        _train(tmp_path, "--callback", "--save-total-limit", "1", "--max-steps", "12")
    assert sorted(os.listdir(notes.parent)) == ["my_eval_notes.txt"]
    assert notes.read_text() == "eval notes"
    assert (tmp_path / "checkpoint-2").is_dir()  # saved before the refusal, committed
    hf.verify_checkpoint(tmp_path / "checkpoint-2")
