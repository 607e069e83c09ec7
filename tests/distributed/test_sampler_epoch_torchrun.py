"""The sampler's epoch is part of the data position, under real torchrun (issue 24): the
plain-loop page's loop (StatefulDataLoader + DistributedSampler + ``set_epoch``, a sharded
Checkpointer) SIGKILLed inside its second epoch and rerun feeds the same samples at the same
steps and ends bit-identical to the uninterrupted run on every rank (before: the resumed
iterator was built by ``load`` with epoch 0's order, steps 7-12 were fed epoch 0's batches).
2 gloo ranks, OMP_NUM_THREADS=1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

from support.killing import assert_identical
from support.ranks import run_torchrun_forked, torchrun

WORKER = Path(__file__).with_name("epoch_worker.py")
ITERS = 16
KILL_AT = 9  # inside epoch 1 (6 steps an epoch), after the commit of step 8
TIMEOUT_S = 180
MARKER = ".snapkeep-commit.json"


def _run(out: Path, report: Path) -> str:
    job = torchrun(WORKER, [str(out), str(report), str(ITERS)], env={"OMP_NUM_THREADS": "1"})
    output = job.communicate(timeout=TIMEOUT_S)[0]
    assert job.returncode == 0, output[-3000:]
    return output


def _reference(out: Path, report: Path) -> None:
    """The uninterrupted run: the same ranks, forked with torchrun's environment (torchrun is
    what the killed run and its rerun go through)."""
    run_torchrun_forked(WORKER, [str(out), str(report), str(ITERS)], timeout_s=TIMEOUT_S,
                        env={"OMP_NUM_THREADS": "1"})


def _kill_inside_epoch_1(out: Path, report: Path) -> None:
    # the ranks wait after step KILL_AT until killed: on a loaded machine they ran on to step 12
    # (an epoch's end, committed) between the line and the kill (a clean-clone run under load)
    job = torchrun(WORKER, [str(out), str(report), str(ITERS)],
                   env={"OMP_NUM_THREADS": "1", "PAUSE_AT": str(KILL_AT)})
    workers: list[int] = []
    try:
        assert job.stdout is not None
        for line in job.stdout:
            words = line.split()
            if words[:1] == ["step"] and int(words[1]) >= KILL_AT \
                    and (out / "ckpt_8" / MARKER).is_file():
                found = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True,
                                       text=True)
                workers = [int(p) for p in found.stdout.split()]
                break
    finally:
        for pid in [*workers, job.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.communicate(timeout=TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(), reason="needs Linux and gloo")
def test_killed_inside_an_epoch_the_rerun_feeds_that_epochs_order(tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    for d in (reference, killed):
        d.mkdir()
    _reference(reference / "ckpt", reference)
    _kill_inside_epoch_1(killed / "ckpt", killed)
    assert not (killed / "final_rank0.pt").exists(), "the kill came too late"
    output = _run(killed / "ckpt", killed)
    assert "snapkeep: resuming from" in output, output[-3000:]
    for rank in (0, 1):
        ref = torch.load(reference / f"final_rank{rank}.pt", weights_only=True)
        got = torch.load(killed / f"final_rank{rank}.pt", weights_only=True)
        resumed_at = min(got["fed"]) - 1
        assert resumed_at >= 8 and resumed_at % 6 != 0, resumed_at  # inside an epoch
        assert got["fed"] == {s: ref["fed"][s] for s in got["fed"]}, f"rank {rank}"
        assert_identical(ref["weight"], got["weight"], f"rank {rank}")
        assert_identical(ref["bias"], got["bias"], f"rank {rank}")
