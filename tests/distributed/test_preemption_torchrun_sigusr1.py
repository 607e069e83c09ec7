"""SLURM's preemption notice under real torchrun (issue 25 item 5): SIGUSR1 kills torchrun's
agent (it does not handle it), whether sent to the agent alone or to the whole job step
(``--signal=USR1@<s>`` signals every process of the step; here the agent first, then each
worker: torchrun starts its workers in sessions of their own, so ``killpg`` of the agent's group
reaches the agent alone). Every worker still commits a
preemption snapshot of one iteration, records ``preempted`` and exits 143, instead of being
ended by snapkeep's watch on its agent before it could; the rerun resumes from that snapshot.
(SIGTERM, which torchrun forwards: tests/distributed/test_run_status.py.) 2 gloo ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed

from snapkeep.session import run_status
from support.ranks import torchrun

WORKER = Path(__file__).with_name("status_worker.py")
TIMEOUT_S = 120


def _workers(agent: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _exit_code(pid: int) -> int | None:
    """None while ``pid`` lives (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return None if f.read().rsplit(")", 1)[1].split()[0] != "Z" else 0
    except OSError:
        return 0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(), reason="needs Linux and gloo")
@pytest.mark.parametrize(("signum", "to"), [(signal.SIGUSR1, "agent"), (signal.SIGUSR1, "all")],
                         ids=["usr1-agent", "usr1-all"])
def test_a_preemption_signal_commits_a_snapshot_on_every_rank_and_the_rerun_resumes(
        tmp_path, signum, to):
    out, ready = tmp_path / "out", tmp_path / "ready"
    job = torchrun(WORKER, [str(out), str(ready), "1000000"])
    workers: list[int] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the job never reached iteration 3"
        workers = _workers(job.pid)
        assert len(workers) == 2, workers
        if to == "agent":
            job.send_signal(signum)
        else:
            for pid in [job.pid, *workers]:  # the agent first: it dies before the workers act
                os.kill(pid, signum)
        job.wait(timeout=TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while any(_exit_code(p) is None for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_exit_code(p) is not None for p in workers), "a worker outlived the job"
        assert job.stdout is not None
        said = job.stdout.read()
    finally:
        for pid in workers:
            if _exit_code(pid) is None:
                os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert "Traceback" not in said, said[-3000:]
    recorded = run_status(str(out))
    assert recorded is not None and recorded.state == "preempted", said[-3000:]
    step = recorded.step
    assert step >= 3 and recorded.world_size == 2 and recorded.snapshots == (
        f"snapshot_iter_{step}",), recorded
    assert recorded.reason.startswith(f"signal {signum.name}") or (
        to == "agent" and recorded.reason.startswith("torchrun's agent gone")), recorded
    assert said.count("preemption snapshot of iteration") == 2, said[-3000:]  # every rank
    assert (out / f"snapshot_iter_{step}").is_file()
    if to == "all":  # the rerun is the same as after the agent alone (suite time)
        return
    rerun = torchrun(WORKER, [str(out), str(tmp_path / "ready2"), str(step + 2)])
    output = rerun.communicate(timeout=TIMEOUT_S)[0]
    assert rerun.returncode == 0, output
    assert f"snapkeep: resuming from snapshot_iter_{step} (step {step})" in output, output
    finished = run_status(str(out))
    assert finished is not None and (finished.state, finished.step) == ("finished", step + 2)
