"""The random streams as a framework's training steps see them
(``snapkeep._core.state.rng_state.RngStream``): what the Lightning door keeps so that a resumed fit
draws what the uninterrupted one drew (``tests/doors/test_framework_continuation.py`` runs
the fits)."""

from __future__ import annotations

import random

import torch

from snapkeep._core.state.rng_state import RngStream, capture_rng_state


def _draws() -> tuple[float, float]:
    return torch.rand(()).item(), random.random()


def test_a_step_starts_from_where_the_last_one_ended_whatever_ran_between() -> None:
    """Draws made between two steps (a loader's base seed, validation) do not move the next
    step's numbers; a stream loaded from a snapshot of step N gives step N+1 the numbers the
    uninterrupted run's step N+1 drew, however many draws happened before it."""
    torch.manual_seed(0)
    random.seed(0)
    stream = RngStream()
    stream.step_start()
    _draws()
    stream.step_end()
    saved = stream.state_dict()
    torch.rand(3)  # the framework's work between steps
    stream.step_start()
    uninterrupted = _draws()

    resumed = RngStream()
    torch.manual_seed(123)
    resumed.load_state_dict(saved)
    torch.rand(7)  # a resumed run's extra iterator, no validation
    resumed.step_start()
    assert _draws() == uninterrupted


def test_an_epochs_draws_do_not_depend_on_what_ran_before_them_nor_repeat_the_steps() -> None:
    """``epoch_start`` reseeds from the recorded state: the next epoch's order is the same
    whether validation drew before it or not, and differs from the next step's draws."""
    torch.manual_seed(0)
    stream = RngStream()
    stream.step_start()
    stream.step_end()
    torch.rand(5)  # validation
    stream.epoch_start()
    order = torch.randperm(10)
    stream.step_start()
    step = torch.rand(4)

    again = RngStream()
    again.load_state_dict(stream.state_dict())
    again.epoch_start()
    assert torch.equal(torch.randperm(10), order)
    again.step_start()
    assert torch.equal(torch.rand(4), step)
    stream.epoch_start()
    assert not torch.equal(torch.rand(4), step)  # the epoch's stream is not the step's


def test_the_state_loads_as_older_snapshots_saved_it() -> None:
    """The saved layout is capture_rng_state's: a snapshot of an older snapkeep loads."""
    torch.manual_seed(5)
    old = capture_rng_state()
    expected = torch.rand(2)
    stream = RngStream()
    stream.load_state_dict(old)
    torch.rand(9)
    stream.step_start()
    assert torch.equal(torch.rand(2), expected)
    assert stream.state_dict().keys() == old.keys()
