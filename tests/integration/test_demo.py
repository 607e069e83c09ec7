"""`snapkeep demo` killed with a real SIGKILL and started again ends with the same metrics as an
uninterrupted run (issue 2, item 5).

Each run is a process of its own running ``python -m snapkeep.cli demo --json ...``, forked by
a zygote that imported torch, snapkeep, click and scikit-learn's datasets once
(tests/support/zygote.py: ``runpy`` runs the module as ``python -m`` does). The killed run is
stopped at a progress line between two snapshots; the rerun must say it resumed, from a
snapshot older than the end, and print final metrics equal to the straight run's.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from support import zygote

pytest.importorskip("sklearn")

pytestmark = pytest.mark.slow

ITERATIONS = 600
SNAPSHOT_INTERVAL = 40
#: metrics that must be equal; timing and bookkeeping fields naturally differ.
METRICS = ("iteration", "loss", "accuracy", "eval_loss")
RUN_TIMEOUT_S = 240.0


def demo_command(out_dir: Path, writer: str) -> list[str]:
    return [
        sys.executable, "-m", "snapkeep.cli", "demo", "--json", "--out", str(out_dir),
        "--iterations", str(ITERATIONS), "--snapshot-interval", str(SNAPSHOT_INTERVAL),
        "--log-interval", "10", "--n-retains", "2", "--model-size", "small", "--seed", "3",
        "--writer", writer,
    ]


#: What the runs' zygote imports (the demo's own modules are run or imported in each run).
PRELOAD = ("torch", "snapkeep", "snapkeep.training", "click", "sklearn.datasets")


def _forked(command: list[str]) -> tuple[zygote.Zygote, str, list[str]]:
    """The zygote, module and arguments of ``command`` (``[sys.executable, "-m", module,
    *args]``)."""
    assert command[:2] == [sys.executable, "-m"], command
    return zygote.shared(PRELOAD, os.environ), command[2], command[3:]


def run_to_end(command: list[str]) -> tuple[dict[str, Any], str]:
    """Run ``command`` to completion; return its final JSON line and its whole stdout."""
    forks, module, args = _forked(command)
    proc = zygote.run(forks, module, args, cwd=os.getcwd(), env=os.environ,
                      timeout=RUN_TIMEOUT_S, module=module)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), proc.stdout


def run_and_kill(command: list[str], kill_at_iteration: int,
                 sig: signal.Signals = signal.SIGKILL) -> list[str]:
    """Start ``command``, SIGKILL its whole process group as soon as it prints the progress line
    for ``kill_at_iteration`` (another ``sig``: sent to the trainer only, which must then exit
    with 143 after its preemption snapshot); return the lines it printed."""
    forks, module, args = _forked(command)
    proc = zygote.ForkedPopen(forks, module, args, env=os.environ, module=module)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    marker = f"iter {kill_at_iteration:>6}  "
    killed = False
    try:
        while not killed:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                pytest.fail("the demo exited before it could be killed:\n" + "\n".join(seen))
            seen.append(line)
            if line.startswith(marker):
                if sig == signal.SIGKILL:
                    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its writer worker
                else:
                    os.kill(proc.pid, sig)  # as a scheduler preempting the job
                killed = True
    finally:
        if not killed and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=30)
    if sig != signal.SIGKILL:  # the rest of its output: the preemption's
        seen += [line for line in iter(lines.get, None)]
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 143), seen
    return seen


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted reference run (thread-queue writer). The other writers and a rerun of
    a finished run are checked in-process in tests/test_cli.py."""
    out = tmp_path_factory.mktemp("straight")
    result, _ = run_to_end(demo_command(out, "thread-queue"))
    assert result["resumed_from"] is None
    assert result["iteration"] == ITERATIONS
    return result


@pytest.mark.parametrize(
    ("writer", "kill_at"),
    [
        ("thread-queue", 130),  # between snapshots 120 and 160
        ("process", 170),       # just after snapshot 160 was handed to the worker process
        ("process-queue", 250),
    ],
)
def test_sigkill_then_rerun_matches_uninterrupted_run(
    tmp_path: Path, straight_run: dict[str, Any], writer: str, kill_at: int,
) -> None:
    out = tmp_path / "run"
    command = demo_command(out, writer)
    printed = run_and_kill(command, kill_at)
    assert any(line.startswith("starting fresh") for line in printed)
    on_disk = sorted(p.name for p in out.iterdir() if p.name.startswith("snapshot_iter_"))
    assert on_disk, "no snapshot was committed before the kill"

    resumed, stdout = run_to_end(command)

    newest_before = max(int(name.rsplit("_", 1)[1]) for name in on_disk)
    assert resumed["resumed_from"] == f"snapshot_iter_{newest_before}"
    assert 0 < resumed["resumed_iteration"] <= kill_at < ITERATIONS
    assert f"resumed from snapshot_iter_{newest_before} (iteration {newest_before})" in stdout
    assert resumed["iterations_run"] == ITERATIONS - newest_before
    assert {k: resumed[k] for k in METRICS} == {k: straight_run[k] for k in METRICS}
    # retention kept the two newest snapshots by step, the last one at the final iteration
    assert resumed["retained"] == [f"snapshot_iter_{ITERATIONS - SNAPSHOT_INTERVAL}",
                                   f"snapshot_iter_{ITERATIONS}"]


def test_sigterm_at_a_random_iteration_snapshots_it_and_the_rerun_matches(
    tmp_path: Path, straight_run: dict[str, Any],
) -> None:
    """``python -m snapkeep.demo`` preempted (SIGTERM) at a random iteration snapshots the next
    iteration boundary, exits 143, and the same command resumes from that snapshot."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "snapkeep.demo", *demo_command(out, "thread-queue")[4:]]
    at = random.randrange(10, ITERATIONS - 100, 10)  # a progress line; room to stop before the end
    printed = run_and_kill(command, at, sig=signal.SIGTERM)
    on_disk = sorted(int(p.name.rsplit("_", 1)[1]) for p in out.iterdir()
                     if p.name.startswith("snapshot_iter_"))
    preempted_at = on_disk[-1]  # the first iteration boundary after the signal
    assert at < preempted_at < ITERATIONS, (at, on_disk, printed)
    assert any(f"preemption snapshot of iteration {preempted_at} committed" in line
               for line in printed), (at, printed)

    resumed, _ = run_to_end(command)
    assert resumed["resumed_from"] == f"snapshot_iter_{preempted_at}", (at, resumed)
    assert resumed["iterations_run"] == ITERATIONS - preempted_at
    assert {k: resumed[k] for k in METRICS} == {k: straight_run[k] for k in METRICS}, at
