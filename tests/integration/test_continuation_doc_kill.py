"""The continuation page's loop (docs/continuation.md, its first ```python block, run as
written: snapkeep's manager, a shuffled DataLoader on the global RNG registered with
``loaders=``, dropout, a snapshot every 4 iterations, mid-epoch included) killed with SIGKILL at
random iterations and rerun ends bit-identical to an uninterrupted run (issue 18's loop shapes:
the docs examples). Helpers: tests/support/killing.py."""

from __future__ import annotations

import pathlib
import random

import pytest

from support.doc_examples import python_blocks
from support.killing import BOUND_S, assert_identical, final_state, kill_after, run_to_end

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "continuation.md"
EPOCHS = 12  # 5 batches each: 60 iterations
BODY = "            loss.backward()\n"


def _script() -> str:
    block = python_blocks(PAGE.read_text())[0]
    head = "manager = ExtensionsManager(model, optimizer, 3, "
    assert head in block and BODY in block and "print(manager.iteration)\n" in block
    block = block.replace(head, f"manager = ExtensionsManager(model, optimizer, {EPOCHS}, ")
    # say each iteration on stdout (the kill follows it), and keep the final state
    block = block.replace(BODY, BODY + "        print('step', manager.iteration, flush=True)\n")
    return block + ("torch.save({'model': model.state_dict(), 'optimizer': "
                    "optimizer.state_dict(), 'rng': torch.get_rng_state()}, 'final.pt')\n")


@pytest.mark.slow
@pytest.mark.timeout(4 * BOUND_S)
def test_docs_continuation_loop_killed_at_random_iterations_ends_bit_identical(
        tmp_path: pathlib.Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_script())
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    total = EPOCHS * 5
    assert run_to_end(script, reference) == list(range(1, total + 1))
    seed = random.randrange(2 ** 32)
    kill_at = sorted(random.Random(seed).sample(range(5, total - 2), 2))
    groups: list[int] = []
    for step in kill_at:
        kill_after(script, killed, step, groups)
    assert not (killed / "final.pt").exists(), f"seed {seed}: a kill came too late"
    steps = run_to_end(script, killed)
    assert steps and steps[0] > 1 and steps == list(range(steps[0], total + 1)), steps
    assert_identical(final_state(reference), final_state(killed), f"seed {seed}, kills {kill_at}")
