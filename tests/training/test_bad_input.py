"""Bad arguments fail early with a message that names the argument and the accepted values."""

from __future__ import annotations

import pytest
import torch

from snapkeep import training
from snapkeep.training import triggers


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [
        (lambda: triggers.IntervalTrigger(1, "step"), ValueError,
         r"unit must be 'iteration' or 'epoch', got 'step'"),
        (lambda: triggers.get_trigger((5, "steps")), ValueError,
         r"unit must be 'iteration' or 'epoch', got 'steps'"),
        (lambda: triggers.ManualScheduleTrigger([1], "day"), ValueError,
         r"unit must be 'iteration' or 'epoch', got 'day'"),
        (lambda: triggers.IntervalTrigger(0, "iteration"), ValueError,
         r"period must be > 0, got 0"),
        (lambda: triggers.IntervalTrigger(-2, "epoch"), ValueError, r"period must be > 0, got -2"),
        (lambda: triggers.IntervalTrigger(2.5, "iteration"), ValueError,
         r"period must be a whole number of iterations"),
        (lambda: triggers.IntervalTrigger("2", "iteration"), TypeError, r"period must be a number"),
        (lambda: triggers.ManualScheduleTrigger([3, -1], "iteration"), ValueError,
         r"points must be >= 0, got -1"),
        (lambda: triggers.TimeTrigger(0), ValueError, r"period must be > 0 seconds"),
        (lambda: triggers.get_trigger(5), TypeError, r"trigger must be a Trigger.*got 5"),
        (lambda: triggers.EarlyStoppingTrigger(mode="lowest"), ValueError,
         r"mode must be 'min', 'max' or 'auto', got 'lowest'"),
        (lambda: triggers.EarlyStoppingTrigger(max_trigger=(10, "epochs")), ValueError,
         r"unit must be 'iteration' or 'epoch'"),
    ],
)
def test_trigger_arguments(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


@pytest.mark.parametrize("iters_per_epoch", [0, -3])
def test_iters_per_epoch_must_be_positive(iters_per_epoch, writer):
    with pytest.raises(ValueError, match=rf"iters_per_epoch must be >= 1, got {iters_per_epoch}"):
        training.ExtensionsManager(
            torch.nn.Linear(1, 1), object(), 1, iters_per_epoch=iters_per_epoch, writer=writer
        )


def test_iters_per_epoch_must_be_an_int(writer):
    with pytest.raises(TypeError, match="iters_per_epoch must be an int"):
        training.ExtensionsManager(
            torch.nn.Linear(1, 1), object(), 1, iters_per_epoch=2.5, writer=writer
        )


def test_models_must_be_a_module_or_mapping(writer):
    with pytest.raises(ValueError, match="models must be a torch.nn.Module or a mapping"):
        training.ExtensionsManager([1, 2], object(), 1, iters_per_epoch=1, writer=writer)


def test_bad_stop_trigger_unit(writer):
    with pytest.raises(ValueError, match="unit must be 'iteration' or 'epoch', got 'step'"):
        training.ExtensionsManager(
            {}, {}, 1, iters_per_epoch=1, writer=writer, stop_trigger=(10, "step")
        )


def test_extend_with_bad_trigger_unit(make_manager):
    manager = make_manager()
    with pytest.raises(ValueError, match="got 'iter'"):
        manager.extend(lambda m: None, trigger=(1, "iter"))


def test_reserved_extension_name(make_manager):
    with pytest.raises(ValueError, match="'training' is reserved"):
        make_manager().extend(lambda m: None, name="training")


def test_unknown_extension_lists_registered_names(make_manager):
    manager = make_manager()
    manager.extend(lambda m: None, name="log")
    with pytest.raises(ValueError, match=r"'snap' not found; registered: \['log'\]"):
        manager.get_extension("snap")
