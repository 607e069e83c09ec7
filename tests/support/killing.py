"""Kill-and-rerun helpers shared by the docs-loop kill tests: run a loop script to its end, SIGKILL
it right after it reports a step, and compare final states bit for bit. Each run is a process of
its own forked by this test process's zygote that imported torch and snapkeep once
(tests/support/zygote.py: a session of its own, the exit status as subprocess gives it), not a
new interpreter importing torch (~3 CPU-s a run)."""

from __future__ import annotations

import os
import pathlib
import signal
import sys
from collections.abc import Sequence
from typing import Any

import torch

from support import zygote

BOUND_S = 120


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore")


#: What the zygote of these runs imports (the loops' own imports beyond these happen in each run).
PRELOAD = ("torch", "snapkeep", "snapkeep.training")


def zygote_for_loops() -> zygote.Zygote:
    """This test process's zygote for the loops (:data:`PRELOAD` imported)."""
    return zygote.shared(PRELOAD, env())


def run_to_end(script: pathlib.Path, cwd: pathlib.Path) -> list[int]:
    """Run the loop to its end; return the steps it ran."""
    run = zygote.run(zygote_for_loops(), str(script), [], cwd=str(cwd), env=env(), timeout=BOUND_S)
    assert run.returncode == 0, run.stderr
    return [int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("step ")]


def kill_after(script: pathlib.Path, cwd: pathlib.Path, step: int, groups: list[int],
               args: Sequence[str] = ()) -> None:
    """Run the loop (``script`` with ``args``) in its own process group (appended to
    ``groups``) and SIGKILL its pid only as soon as it reports ``step`` (a line ending in the
    step number; or let it end first); worker processes live on."""
    proc = zygote.Forked(zygote_for_loops(), str(script), [str(arg) for arg in args], cwd=str(cwd),
                         env=env())
    groups.append(proc.pid)
    timer, late = zygote.group_killer(proc.pid, BOUND_S)  # bounded, as wait(timeout=) was
    timer.start()
    try:
        for line in proc.stdout:
            if line.split() and line.split()[-1].isdigit() and int(line.split()[-1]) >= step:
                os.kill(proc.pid, signal.SIGKILL)
                break
        assert proc.wait() in (-signal.SIGKILL, 0)
        assert not late.is_set(), f"{script} ran past {BOUND_S} s"
    finally:
        timer.cancel()
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGKILL)  # its pid only: its workers live on, as above
            proc.wait()
        proc.close()


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
