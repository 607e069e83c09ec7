"""A process that resumes and closes at once exits 0: the staging buffers' prefault thread
(started by the resume, for the first snapshot) has ended when ``close`` returns. It used to
be still unwinding at interpreter exit, where a daemon thread is stopped inside torch's C++
frames: "terminate called without an active exception", exit 134, after a clean close (2 of 4
runs with 256 MiB, 3 of 3 with 1 GiB)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading

import torch

import snapkeep

SCRIPT = """
import sys, torch, snapkeep
out, mib = sys.argv[1], int(sys.argv[2])
model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(mib << 18))])
with snapkeep.Checkpointer(out, every=1, keep=1) as ck:
    step = ck.load(into={"model": model}) or 0
    if not step:
        ck.save(1, {"model": model})
"""


def _prefault_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "snapkeep-prefault" and t.is_alive()]


def test_close_returns_after_the_prefault_thread_ended(tmp_path: pathlib.Path) -> None:
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(32 << 18))])
    with snapkeep.Checkpointer(tmp_path, every=1, keep=1) as ck:
        ck.save(1, {"model": model})
    for _ in range(3):
        with snapkeep.Checkpointer(tmp_path, every=1, keep=1) as ck:
            assert ck.load(into={"model": model}) == 1
        assert _prefault_threads() == []


def test_a_process_that_resumes_and_closes_at_once_exits_0(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", SCRIPT, str(tmp_path / "run"), "256"]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    for _ in range(3):
        again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "resuming from ckpt_1" in again.stderr
