"""The plain-loop page's snapkeep loop (docs/plain-loop.md, its first ```python block, run as
written) killed with SIGKILL at random steps and rerun ends bit-identical to an uninterrupted run:
model, optimizer, LR scheduler, GradScaler, data position and the global RNG (dropout) all
continue exactly (issue 20's done-when). The page's plain shuffled DataLoader on the global RNG
with num_workers=0, and the same loop with ``generator=`` and num_workers=2 (only the trainer's
pid is killed: its worker processes outlive it and must not hold the store lock)."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

from support.doc_examples import python_blocks

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "plain-loop.md"
TOTAL_STEPS = 120
SAVE_LINE = "            ckpt.save(step, state)  # every 10 steps; returns while it is written\n"
BOUND_S = 120
LOADER_LINE = "loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)\n"
LOADERS = {
    "global-rng-0-workers": LOADER_LINE,
    "generator-2-workers": LOADER_LINE.replace(
        "shuffle=True)", "shuffle=True, num_workers=2,\n"
        "                                     generator=torch.Generator().manual_seed(5))"),
}


def _script(loader_line: str) -> str:
    block = python_blocks(PAGE.read_text())[0]
    assert "total_steps = 60\n" in block and SAVE_LINE in block  # the page's loop, as written
    assert LOADER_LINE in block
    block = block.replace(LOADER_LINE, loader_line)
    block = block.replace("total_steps = 60\n", f"total_steps = {TOTAL_STEPS}\n")
    # say each step on stdout, so the test can kill the loop right after a chosen step
    block = block.replace(SAVE_LINE, SAVE_LINE + "            print('step', step, flush=True)\n")
    return block + ("torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(),"
                    " 'scheduler': scheduler.state_dict(), 'scaler': scaler.state_dict(), "
                    "'rng': torch.get_rng_state()}, 'final.pt')\n")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore")


def _run_to_end(script: pathlib.Path, cwd: pathlib.Path) -> list[int]:
    """Run the loop to its end; return the steps it ran."""
    run = subprocess.run([sys.executable, str(script)], cwd=cwd, env=_env(), capture_output=True,
                         text=True, timeout=BOUND_S)
    assert run.returncode == 0, run.stderr
    return [int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("step ")]


def _kill_after(script: pathlib.Path, cwd: pathlib.Path, step: int, groups: list[int]) -> None:
    """Run the loop in its own process group (appended to ``groups``) and SIGKILL its pid only
    as soon as it reports ``step`` (or let it end first); worker processes live on."""
    proc = subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=_env(),
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


def _final(cwd: pathlib.Path) -> dict[str, Any]:
    return torch.load(cwd / "final.pt", weights_only=True)


def _assert_identical(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.timeout(6 * BOUND_S)
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_docs_plain_loop_killed_at_random_steps_ends_bit_identical(
        tmp_path: pathlib.Path, loader: str) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_script(LOADERS[loader]))
    groups: list[int] = []
    try:
        _killed_and_rerun(script, tmp_path, groups)
    finally:
        for group in groups:  # leftover worker processes of the killed loops
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _killed_and_rerun(script: pathlib.Path, tmp_path: pathlib.Path, groups: list[int]) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    assert _run_to_end(script, reference) == list(range(1, TOTAL_STEPS + 1))

    seed = random.randrange(2 ** 32)
    rng = random.Random(seed)
    kill_steps = sorted(rng.sample(range(12, TOTAL_STEPS), 2))  # after the first snapshot
    for step in kill_steps:
        _kill_after(script, killed, step, groups)
    assert not (killed / "final.pt").exists(), f"seed {seed}: a kill came too late"
    steps = _run_to_end(script, killed)
    resumed_at = steps[0] - 1
    assert resumed_at >= 10 and resumed_at % 10 == 0, steps  # a resume, not a restart
    assert steps == list(range(resumed_at + 1, TOTAL_STEPS + 1))
    _assert_identical(_final(reference), _final(killed), f"seed {seed}, kills {kill_steps}")
    listing = sorted(os.listdir(killed / "checkpoints"))
    assert listing == [".snapkeep", f"ckpt_{TOTAL_STEPS - 10}", f"ckpt_{TOTAL_STEPS}"], listing
