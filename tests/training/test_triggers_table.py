"""Table-driven firing patterns of the triggers and get_trigger's accepted inputs."""

from __future__ import annotations

import pytest

from snapkeep.training import triggers

T, F = True, False


@pytest.mark.parametrize(
    ("iters_per_epoch", "make_trigger", "expected"),
    [
        (3, lambda: triggers.IntervalTrigger(2, "iteration"), [F, T, F, T, F, T, F]),
        (3, lambda: triggers.IntervalTrigger(1, "epoch"), [F, F, T, F, F, T, F]),
        (2, lambda: triggers.IntervalTrigger(1.5, "epoch"), [F, F, T, F, F, T, F]),
        (4, lambda: triggers.IntervalTrigger(0.5, "epoch"), [F, T, F, T, F, T, F]),
        (2, lambda: triggers.ManualScheduleTrigger([2, 5], "iteration"), [F, T, F, F, T, F, F]),
        (2, lambda: triggers.ManualScheduleTrigger(1.5, "epoch"), [F, F, T, F, F, F, F]),
        (2, lambda: triggers.OnceTrigger(), [T, F, F, F, F, F, F]),
        (2, lambda: triggers.get_trigger(None), [F, F, F, F, F, F, F]),
        (2, lambda: triggers.get_trigger((3, "iteration")), [F, F, T, F, F, T, F]),
        (2, lambda: triggers.get_trigger(lambda m: m.iteration in (1, 4)), [T, F, F, T, F, F, F]),
        (
            2,
            lambda: triggers.FunctionTrigger(lambda: True, trigger=(2, "iteration")),
            [F, T, F, T, F, T, F],
        ),
    ],
)
def test_firing_pattern(make_manager, iters_per_epoch, make_trigger, expected):
    manager = make_manager(iters_per_epoch=iters_per_epoch, max_epochs=100)
    trigger = make_trigger()
    fired = []
    for _ in expected:
        with manager.run_iteration():
            pass
        fired.append(trigger(manager))
    assert fired == expected


@pytest.mark.parametrize(
    ("make_trigger", "iterations_that_may_fire"),
    [
        (lambda: triggers.IntervalTrigger(3, "iteration"), [3, 6]),
        (lambda: triggers.IntervalTrigger(1, "epoch"), [2, 4, 6]),
        (lambda: triggers.ManualScheduleTrigger([1, 5], "iteration"), [1, 5]),
        (lambda: triggers.MinValueTrigger("loss", (2, "iteration")), [2, 4, 6]),
    ],
)
def test_may_fire(make_trigger, iterations_that_may_fire):
    trigger = make_trigger()
    assert [i for i in range(7) if trigger.may_fire(i, 2)] == iterations_that_may_fire


@pytest.mark.parametrize(
    ("trigger_type", "values", "expected"),
    [
        (triggers.MinValueTrigger, [3.0, 2.0, 2.0, 5.0, 1.0], [T, T, F, F, T]),
        (triggers.MaxValueTrigger, [3.0, 2.0, 4.0, 4.0, 5.0], [T, F, T, F, T]),
    ],
)
def test_best_value_triggers(make_manager, trigger_type, values, expected):
    manager = make_manager(iters_per_epoch=1, max_epochs=100)
    trigger = trigger_type("val/loss", (1, "iteration"))
    fired = []
    for value in values:
        with manager.run_iteration():
            manager.reporter.report({"val/loss": value})
        fired.append(trigger(manager))
    assert fired == expected


def test_early_stopping_fires_after_patience_checks(make_manager):
    manager = make_manager(iters_per_epoch=1, max_epochs=100)
    trigger = triggers.EarlyStoppingTrigger(
        check_trigger=(1, "iteration"), monitor="val/loss", patience=2
    )
    fired = []
    for value in [5.0, 4.0, 4.5, 4.2, 3.0, 3.5, 3.6]:
        with manager.run_iteration():
            manager.reporter.report({"val/loss": value})
        fired.append(trigger(manager))
    assert fired == [F, F, F, T, F, F, T]


def test_time_trigger_uses_elapsed_time():
    class Clock:
        elapsed_time = 0.0

    trigger = triggers.TimeTrigger(10.0)
    clock = Clock()
    fired = []
    for t in [5.0, 10.5, 12.0, 20.1, 45.0, 46.0]:
        clock.elapsed_time = t
        fired.append(trigger(clock))
    assert fired == [F, T, F, T, T, T]  # catches up one period per call, as ppe


def test_get_trigger_returns_trigger_objects_unchanged():
    trigger = triggers.IntervalTrigger(1, "epoch")
    assert triggers.get_trigger(trigger) is trigger
