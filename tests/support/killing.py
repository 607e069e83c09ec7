"""Kill-and-rerun helpers shared by the docs-loop kill tests: run a loop script to its end, SIGKILL
it right after it reports a step, and compare final states bit for bit."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch

BOUND_S = 120


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore")


def run_to_end(script: pathlib.Path, cwd: pathlib.Path) -> list[int]:
    """Run the loop to its end; return the steps it ran."""
    run = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env(), capture_output=True,
                         text=True, timeout=BOUND_S)
    assert run.returncode == 0, run.stderr
    return [int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("step ")]


def kill_after(script: pathlib.Path, cwd: pathlib.Path, step: int, groups: list[int],
               args: Sequence[str] = ()) -> None:
    """Run the loop (``script`` with ``args``) in its own process group (appended to
    ``groups``) and SIGKILL its pid only as soon as it reports ``step`` (a line ending in the
    step number; or let it end first); worker processes live on."""
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    groups.append(proc.pid)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.split() and line.split()[-1].isdigit() and int(line.split()[-1]) >= step:
                os.kill(proc.pid, signal.SIGKILL)
                break
        assert proc.wait(timeout=BOUND_S) in (-signal.SIGKILL, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def final_state(cwd: pathlib.Path) -> dict[str, Any]:
    return torch.load(cwd / "final.pt", weights_only=True)


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
