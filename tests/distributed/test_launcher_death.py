"""Workers end with their torchrun launcher: ``kill -9`` of torchrun's agent (the job's visible
process) leaves no rank training on with the out_dir's lock, so rerunning the same command
resumes. Real torchrun, 2 gloo ranks, real SIGKILL."""

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


def _torchrun(out: Path, ready: Path, iterations: int) -> subprocess.Popen[str]:
    return torchrun(WORKER, [str(out), str(ready), str(iterations)])


def _workers(agent: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(), reason="needs Linux and gloo")
def test_kill_9_of_torchrun_ends_its_workers_and_the_rerun_resumes(tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"
    job = _torchrun(out, ready, 1_000_000)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the job never reached iteration 3"
        workers = _workers(job.pid)
        assert len(workers) == 2, workers
        job.send_signal(signal.SIGKILL)  # the agent only: its workers are not signalled
        job.wait(timeout=TIMEOUT_S)  # not communicate(): a worker left alive holds the pipe
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "a worker outlived its torchrun agent"
        assert job.stdout is not None
        said = job.stdout.read()  # every writer of the pipe is gone: read to its end
        # each worker ends itself with the message, none with a traceback first (a peer's
        # collective failing because the other worker already ended)
        # (this worker has extensions.preemption: each snapshots first, then exits; a rank may
        # learn of it through the per-iteration agreement before its own watch looks)
        assert said.count("torchrun's agent (pid") >= 1 and "Traceback" not in said, said[-3000:]
        assert said.count("preemption snapshot of iteration") == 2, said[-3000:]
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
            job.communicate()
    preempted = run_status(str(out))  # the workers snapshotted before they ended
    assert preempted is not None and preempted.state == "preempted", preempted
    end = preempted.step + 3
    rerun = _torchrun(out, tmp_path / "ready2", end)
    output = rerun.communicate(timeout=TIMEOUT_S)[0]
    assert rerun.returncode == 0, output  # not refused by the lock of a worker left behind
    recorded = run_status(str(out))
    assert recorded is not None and recorded.state == "finished", output
    assert (out / f"snapshot_iter_{end}").is_file()
