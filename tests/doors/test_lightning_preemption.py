"""The Lightning door's preemption through snapkeep's agreement (issue 26, as the Checkpointer's
``preemption=True``): a real SIGTERM or SIGUSR1 to a real Trainer process becomes a committed
snapshot of the next step, the run status ``preempted`` and exit code 143; the rerun with
``ckpt_path="last"`` resumes from it and ends bit-identical to the uninterrupted run. Before,
Lightning's own path saved at its ``SIGTERMException`` and exited 0, and ``snapkeep status``
had nothing to say about a Lightning directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("lightning")

import snapkeep  # noqa: E402
from snapkeep.cli import cli  # noqa: E402
from support import zygote  # noqa: E402
from support.killing import BOUND_S, env  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import framework_doors  # noqa: E402

WORKER = HERE / "framework_doors.py"
STEPS = 8


def test_a_signal_commits_the_next_step_says_preempted_and_exits_143(tmp_path: Path) -> None:
    """SIGTERM (torchrun forwards it; SIGUSR1 takes the same path: the Checkpointer's tests run
    both through the one ``SignalWatch``). The rerun from the preemption snapshot is the
    torchrun case's (bit-identical)."""
    sig = signal.SIGTERM
    out = tmp_path / "run"
    # saves only every 100 steps: the one snapshot is the preemption's
    proc = subprocess.Popen([sys.executable, str(WORKER), "lightning", str(out), str(STEPS),
                             "--every", "100", "--pause-at", "3"], env=env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "step 3"
        proc.send_signal(sig)  # recorded by the handler; agreed at the end of step 4
        _, err = proc.communicate("go\n", timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert sorted(p.name for p in out.iterdir()) == [".snapkeep", "ckpt_4"]  # committed
    status = snapkeep.session.run_status(str(out))
    assert status is not None and status.state == "preempted" and status.step == 4
    assert status.snapshots == ("ckpt_4",) and status.reason == f"signal {sig.name}"
    result = CliRunner().invoke(cli, ["status", str(out)])
    assert result.exit_code == 75 and "preempted" in result.output, result.output


def test_without_snapkeeps_preemption_lightnings_sigterm_path_still_says_preempted(
        tmp_path: Path) -> None:
    """``ModelCheckpoint(preemption=False)``: Lightning's own SIGTERM handling (its
    ``SIGTERMException``, a ``SystemExit`` without a code); the snapshot of that step is still
    committed, and the run status says ``preempted`` (not ``finished``)."""
    import lightning.pytorch as pl

    class SignalAt3(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler: raised next batch

    with pytest.raises(SystemExit) as exited:
        framework_doors.train_lightning(tmp_path, STEPS, every=100, preemption=False,
                                        callbacks=(SignalAt3(),))
    assert exited.value.code is None
    status = snapkeep.session.run_status(str(tmp_path))
    assert status is not None and status.state == "preempted", status
    assert status.snapshots == (f"ckpt_{status.step}",) and 3 <= status.step < STEPS
    assert sorted(p.name for p in tmp_path.iterdir()) == [".snapkeep", f"ckpt_{status.step}"]


@pytest.mark.slow
@pytest.mark.timeout(4 * BOUND_S)
def test_under_torchrun_a_signal_to_one_rank_preempts_every_rank(tmp_path: Path) -> None:
    """DDP on CPU (gloo), 2 ranks under ``torchrun --standalone``: SIGTERM to rank 1 alone;
    both ranks agree at the next batch end, the snapshot of that step is committed, the status
    names the signal and the rank, every rank exits 143; the rerun of the same command resumes
    from it and ends bit-identical to an uninterrupted run (the ranks see the same batch, so
    the one-process run is the reference). About 30 s: two torchrun launches."""
    import psutil

    from support import ranks

    out, go = tmp_path / "run", tmp_path / "go"
    args = ["lightning", str(out), str(STEPS), "--every", "100", "--devices", "2"]
    proc = ranks.torchrun(WORKER, [*args, "--pause-at", "3"], env={"SNAPKEEP_TEST_GO": str(go)})
    try:
        assert proc.stdout is not None
        seen = ""
        while seen.count("step 3") < 2:  # both ranks paused after step 3
            line = proc.stdout.readline()
            assert line, seen
            seen += line
        rank1 = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if p.environ().get("RANK") == "1"]
        assert len(rank1) == 1
        rank1[0].send_signal(signal.SIGTERM)
        go.touch()
        output = seen + proc.communicate(timeout=BOUND_S)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert output.count("exitcode  : 143") == 2, output  # torchrun's report of each rank
    assert sorted(p.name for p in out.iterdir()) == [".snapkeep", "ckpt_4"]
    status = snapkeep.session.run_status(str(out))
    assert status is not None and status.state == "preempted" and status.step == 4
    assert status.reason == "signal SIGTERM on rank 1" and status.world_size == 2
    rerun = ranks.torchrun(WORKER, args)
    try:
        output = rerun.communicate(timeout=BOUND_S)[0]
    finally:
        if rerun.poll() is None:
            os.killpg(rerun.pid, signal.SIGKILL)
            rerun.communicate()
    assert rerun.returncode == 0, output
    assert f"snapkeep: resuming from ckpt_4 (step 4) in {out}" in output
    reference = framework_doors.train_lightning(tmp_path / "straight", STEPS, every=100)
    resumed = torch.load(out / "final.pt", weights_only=True)
    assert torch.equal(resumed["weight"], reference.weight)
    assert torch.equal(resumed["bias"], reference.bias)


@pytest.mark.slow
def test_killed_with_its_newest_step_in_ram_only_resumes_from_ram_bit_identical(
        tmp_path: Path) -> None:
    """``SnapkeepCheckpointIO(memory=MemoryTier(every=1))``, checkpoints every 2 steps:
    SIGKILL after step 5 (committed to RAM; storage's newest is 4). The rerun's
    ``ckpt_path="last"`` resumes from RAM step 5 (said on stderr, the RAM copy verified), ends
    bit-identical to an uninterrupted run, and, storage then holding its newest step, removes
    the tier. (Before: the Lightning door had no memory tier; the rerun resumed from step 4.)"""
    out, root = tmp_path / "run", tmp_path / "shm"
    command = [sys.executable, str(WORKER), "lightning", str(out), str(STEPS), "--every", "2",
               "--memory", str(root)]
    proc = subprocess.Popen([*command, "--pause-at", "5"], env=env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "step 5", proc.communicate(timeout=BOUND_S)
    finally:
        proc.kill()
        proc.communicate(timeout=BOUND_S)
    assert [p.name for p in root.glob("snapkeep-*/rank0/ram_iter_*")] == ["ram_iter_5"]
    assert "ckpt_4" in {p.name for p in out.iterdir()} and not (out / "ckpt_5").exists()
    # the rerun and the uninterrupted run: forked from the session's framework zygote
    # (tests/support/zygote.py), real processes without their ~6 s Lightning import
    forks = zygote.frameworks(env())
    rerun = zygote.run(forks, command[1], command[2:], cwd=os.getcwd(), env=env(),
                       timeout=BOUND_S)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "snapkeep: resuming from RAM step 5 (own copy; storage's newest: 4) in " \
        in rerun.stderr, rerun.stderr[-3000:]
    reference = zygote.run(forks, str(WORKER), ["lightning", str(tmp_path / "straight"),
                                                str(STEPS)], cwd=os.getcwd(), env=env(),
                           timeout=BOUND_S)
    assert reference.returncode == 0, reference.stderr[-3000:]
    resumed = torch.load(out / "final.pt", weights_only=True)
    straight = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert list(root.glob("snapkeep-*/rank0/ram_iter_*")) == []  # storage holds step 8
