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

import pytest

from support.doc_examples import python_blocks
from support.killing import BOUND_S, assert_identical, final_state, kill_after, run_to_end

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "plain-loop.md"
TOTAL_STEPS = 120
SAVE_LINE = "            ckpt.save(step, state)  # every 10 steps; returns while it is written\n"
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
    assert run_to_end(script, reference) == list(range(1, TOTAL_STEPS + 1))

    seed = random.randrange(2 ** 32)
    rng = random.Random(seed)
    # both after the first snapshot's call; the later one after step 20: save(20) returns only
    # once step 10's snapshot committed (one in flight), so the rerun is a resume. Two kills
    # both at steps 12..20 can both come before that commit (a loaded machine): a restart.
    first = rng.randrange(12, TOTAL_STEPS)
    kill_steps = sorted([first, rng.choice([s for s in range(21, TOTAL_STEPS) if s != first])])
    for step in kill_steps:
        kill_after(script, killed, step, groups)
    assert not (killed / "final.pt").exists(), f"seed {seed}: a kill came too late"
    steps = run_to_end(script, killed)
    resumed_at = steps[0] - 1
    assert resumed_at >= 10 and resumed_at % 10 == 0, steps  # a resume, not a restart
    assert steps == list(range(resumed_at + 1, TOTAL_STEPS + 1))
    assert_identical(final_state(reference), final_state(killed),
                     f"seed {seed}, kills {kill_steps}")
    listing = sorted(os.listdir(killed / "checkpoints"))
    assert listing == [".snapkeep", f"ckpt_{TOTAL_STEPS - 10}", f"ckpt_{TOTAL_STEPS}"], listing
