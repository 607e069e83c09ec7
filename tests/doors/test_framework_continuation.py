"""Exact continuation through the framework doors (issue 32, item 5): a real Lightning fit and a
real Hugging Face Trainer run with dropout, SIGKILLed once a step's snapshot is committed and
rerun with the same command, feed the same batches and draw the same dropout masks at every step
after the resume (compared step by step) and end bit-identical to an uninterrupted run.

The worker is ``continuation_worker.py``; each configuration's uninterrupted run is made once.
Before (971f8e4): with torchdata's ``StatefulDataLoader`` the resumed run drew the loader's base
seed from the restored generator (every later dropout mask one draw off), and at an epoch's end
the validation loop's draws differed (an integer ``val_check_interval``), so the resumed steps
differed from the uninterrupted run's.
"""

from __future__ import annotations

import pathlib
import signal
from typing import Any

import pytest

from support import zygote
from support.killing import BOUND_S, assert_identical, env, final_state

pytest.importorskip("lightning")

WORKER = pathlib.Path(__file__).with_name("continuation_worker.py")
STEPS = 12  # 3 epochs of 4 batches
RUN_BOUND_S = 5 * BOUND_S  # one worker run (a Lightning import and 12 steps) on 2 busy cores

_REFERENCES: dict[tuple[str, ...], tuple[list[tuple[int, str]], dict[str, Any]]] = {}


def _run(cwd: pathlib.Path, args: list[str]) -> tuple[int, list[tuple[int, str]], str]:
    """One worker run, forked by the session's zygote that imported Lightning and transformers
    once (tests/support/zygote.py): a real process, killed by a real SIGKILL, without the
    ~10 s import of each run."""
    cwd.mkdir(parents=True, exist_ok=True)
    done = zygote.run(zygote.frameworks(env()), str(WORKER), args, cwd=str(cwd), env=env(),
                      timeout=RUN_BOUND_S)
    steps = [(int(line.split()[1]), line.split()[2]) for line in done.stdout.splitlines()
             if line.startswith("step ")]
    return done.returncode, steps, done.stderr


def _reference(factory: pytest.TempPathFactory, args: tuple[str, ...]
               ) -> tuple[list[tuple[int, str]], dict[str, Any]]:
    if args not in _REFERENCES:
        cwd = factory.mktemp("reference")
        code, steps, err = _run(cwd, [args[0], "ckpt", str(STEPS), *args[1:]])
        assert code == 0, err[-3000:]
        assert [s for s, _ in steps] == list(range(1, STEPS + 1))
        _REFERENCES[args] = (steps, final_state(cwd))
    return _REFERENCES[args]


def _killed_and_rerun(tmp_path: pathlib.Path, factory: pytest.TempPathFactory,
                      args: tuple[str, ...], kill_at: int, resumed_at: int) -> str:
    """Kill the run once step ``kill_at``'s snapshot is committed, rerun it; assert it resumed
    at ``resumed_at`` and continued as the uninterrupted run did. Returns the rerun's stderr."""
    expected, final = _reference(factory, args)
    command = [args[0], "ckpt", str(STEPS), *args[1:]]
    code, steps, err = _run(tmp_path, [*command, "--kill-at", str(kill_at)])
    assert code == -signal.SIGKILL, err[-3000:]
    assert steps == expected[:kill_at]
    code, steps, err = _run(tmp_path, command)
    assert code == 0, err[-3000:]
    assert f"(step {resumed_at})" in err, err[-3000:]
    assert steps == expected[resumed_at:], "batches or dropout masks differ after the resume"
    assert_identical(final, final_state(tmp_path), " ".join(args))
    return err


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_BOUND_S)
@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "generator"])
def test_lightning_a_stateful_loader_resumed_mid_epoch_is_bit_identical(
        tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory,
        generator: bool) -> None:
    """StatefulDataLoader, a snapshot every step, validation every 2 batches: killed after
    step 6 (2 batches into the second epoch), the rerun feeds the rest of that epoch and the
    next one (its shuffle) as the uninterrupted run did, with the same dropout masks."""
    args = ("lightning", "--loader", "stateful", "--val-every", "2",
            *(["--generator"] if generator else []))
    _killed_and_rerun(tmp_path, tmp_path_factory, args, kill_at=6, resumed_at=6)


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_BOUND_S)
@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_lightning_an_epoch_end_snapshot_with_an_integer_val_check_interval_is_bit_identical(
        tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, loader: str) -> None:
    """``val_check_interval=4`` (the epoch's 4 batches) and ModelCheckpoint's default trigger
    (a snapshot at each validation's end): killed in the second epoch, the rerun resumes from
    the step-4 snapshot; before, it drew one number more than the uninterrupted run before
    step 5 and every later step differed."""
    args = ("lightning", "--loader", loader, "--val-every", "4", "--every", "0")
    _killed_and_rerun(tmp_path, tmp_path_factory, args, kill_at=6, resumed_at=4)


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_BOUND_S)
@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_lightning_an_every_n_train_steps_snapshot_on_an_epochs_last_batch_is_bit_identical(
        tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, loader: str) -> None:
    """``every_n_train_steps=4`` with 4 batches an epoch and validation every 2 batches: the
    snapshot of step 4 is taken on the epoch's last batch, before that batch's validation; the
    rerun from it starts the next epoch as the uninterrupted run did."""
    args = ("lightning", "--loader", loader, "--every", "4", "--val-every", "2",
            "--generator")
    _killed_and_rerun(tmp_path, tmp_path_factory, args, kill_at=4, resumed_at=4)


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_BOUND_S)
def test_lightning_a_plain_loader_resumed_mid_epoch_says_so_at_the_start(
        tmp_path: pathlib.Path) -> None:
    """A plain DataLoader cannot resume mid-epoch under Lightning (it starts its epoch over):
    the rerun says so once, at the start, naming why and what to use instead."""
    command = ["lightning", "ckpt", "8", "--loader", "plain"]
    code, _, err = _run(tmp_path, [*command, "--kill-at", "6"])
    assert code == -signal.SIGKILL, err[-3000:]
    code, steps, err = _run(tmp_path, command)
    assert code == 0, err[-3000:]
    said = [line for line in err.splitlines() if "cannot resume mid-epoch" in line]
    assert len(said) == 1, err[-3000:]
    assert "2 batches into an epoch of 4" in said[0] and "StatefulDataLoader" in said[0]
    assert err.index("cannot resume mid-epoch") < err.index("step 7") if "step 7" in err \
        else True
    assert [s for s, _ in steps] == [7, 8]


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_BOUND_S)
@pytest.mark.parametrize("kill_at", [6, 4], ids=["mid-epoch", "epoch-end"])
def test_hf_a_run_resumed_mid_epoch_or_at_an_epoch_end_is_bit_identical(
        tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, kill_at: int) -> None:
    """The Trainer with snapkeep's owned save, a checkpoint every step, dropout: killed once
    ``checkpoint-6`` (mid-epoch) or ``checkpoint-4`` (an epoch's end) is committed, the rerun
    (``latest_verified``) continues as the uninterrupted run did."""
    _killed_and_rerun(tmp_path, tmp_path_factory, ("hf",), kill_at=kill_at, resumed_at=kill_at)


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_BOUND_S)
def test_hf_a_mid_epoch_resume_with_ignore_data_skip_says_so_at_the_start(
        tmp_path: pathlib.Path) -> None:
    """``ignore_data_skip=True`` makes the Trainer start a resumed epoch's data over: the
    resume says so once, at its start, and what to do."""
    command = ["hf", "ckpt", "8", "--ignore-data-skip"]
    code, _, err = _run(tmp_path, [*command, "--kill-at", "6"])
    assert code == -signal.SIGKILL, err[-3000:]
    code, _, err = _run(tmp_path, command)
    assert code == 0, err[-3000:]
    said = [line for line in err.splitlines() if "ignore_data_skip=True" in line]
    assert len(said) == 1 and "2 steps into an epoch of 4" in said[0], err[-3000:]
    assert "ignore_data_skip=False" in said[0]
