"""Manager state_dict/load_state_dict: trigger state, layout, versions, state objects."""

from __future__ import annotations

import warnings

import pytest
import torch

import snapkeep
from snapkeep.training import extensions, triggers


def _build(make_manager, log):
    manager = make_manager(
        iters_per_epoch=2,
        stop_trigger=triggers.EarlyStoppingTrigger(
            check_trigger=(1, "iteration"), monitor="val/loss", patience=3
        ),
    )
    manager.extend(lambda m: log.append(("best", m.iteration)), name="best",
                   trigger=triggers.MinValueTrigger("val/loss", (1, "iteration")))
    manager.extend(lambda m: log.append(("once", m.iteration)), name="once",
                   trigger=triggers.OnceTrigger())
    manager.extend(lambda m: log.append(("every2", m.iteration)), name="every2",
                   trigger=(2, "iteration"))
    # continuation state (the stop trigger's) travels in the snapshot extension's part
    manager.extend(extensions.snapshot(), name="snapshot", trigger=(1000, "iteration"))
    return manager


def _run(manager, values):
    stops = []
    for value in values:
        with manager.run_iteration():
            snapkeep.reporting.report({"val/loss": torch.tensor(value)})
        stops.append(manager.stop_trigger)
    return stops


def test_resumed_manager_continues_exactly_like_the_original(make_manager):
    first_log: list = []
    original = _build(make_manager, first_log)
    _run(original, [5.0, 3.0, 4.0])
    state = original.state_dict()
    first_log.clear()
    expected_stops = _run(original, [3.5, 3.6])
    expected_log = list(first_log)

    resumed_log: list = []
    resumed = _build(make_manager, resumed_log)
    fresh = resumed.state_dict()
    assert fresh["extensions"]["best"]["trigger"]["_best_value"] is None  # differs before load
    assert fresh["extensions"]["once"]["trigger"] == {"_flag_first": True}
    resumed.load_state_dict(state)
    assert resumed.iteration == 3
    resumed_log.clear()  # (nothing ran during load)
    assert _run(resumed, [3.5, 3.6]) == expected_stops
    assert resumed_log == expected_log
    # 4.0, 3.5, 3.6: three checks without improvement on 3.0 -- only with the saved count
    assert expected_stops == [False, True]


def test_trigger_state_layout_matches_ppe(make_manager):
    log: list = []
    manager = _build(make_manager, log)
    _run(manager, [5.0, 3.0])
    state = manager.state_dict()
    assert state["extensions"]["best"] == {
        "extension": {},
        "trigger": {"interval_trigger": {}, "_summary": {}, "_best_value": 3.0},
    }
    assert state["extensions"]["once"] == {"extension": {}, "trigger": {"_flag_first": False}}
    assert state["extensions"]["every2"] == {"extension": {}, "trigger": {}}
    continuation = state["extensions"]["snapshot"]["extension"]
    assert continuation["stop_trigger"]["count"] == 0
    assert continuation["stop_trigger"]["best"] == 3.0
    assert set(state) == {  # ppe 0.9.0's keys exactly
        "_start_iteration", "_start_execution", "models", "optimizers", "state_objects",
        "extensions", "ppe_version",
    }
    assert state["ppe_version"] == snapkeep.__version__


def test_ppe_state_dict_loads_without_warning(make_manager):
    log: list = []
    source = make_manager()
    ppe_state = {
        "_start_iteration": 6,
        "_start_execution": 6,
        "models": {"main": source._models["main"].state_dict()},
        "optimizers": {"main": source._optimizers["main"].state_dict()},
        "state_objects": {},
        "extensions": {
            "best": {"extension": {}, "trigger": {
                "interval_trigger": {}, "_summary": {}, "_best_value": 2.0}},
            "once": {"extension": {}, "trigger": {"_flag_first": False}},
            "every2": {"extension": {}, "trigger": {}},
        },
        "ppe_version": "0.9.0",
    }
    manager = _build(make_manager, log)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager.load_state_dict(ppe_state)
    assert manager.iteration == 6
    assert manager.state_dict()["extensions"]["best"]["trigger"]["_best_value"] == 2.0


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda s: s.update(ppe_version="0.0.1"), "saved by version 0.0.1"),
        (lambda s: s.update(ppe_version="23.0.0"), "saved by version 23.0.0"),
        (lambda s: s.pop("ppe_version"), "records no version"),
        # a snapkeep 0.1.0 state dict
        (lambda s: s.update(_snapkeep_version="0.0.1"), "saved by snapkeep version 0.0.1"),
    ],
)
def test_version_mismatch_or_absence_warns(make_manager, mutate, pattern):
    state = make_manager().state_dict()
    mutate(state)
    with pytest.warns(UserWarning, match=pattern):
        make_manager().load_state_dict(state)


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_state_objects_are_saved_and_restored(make_manager):
    saved_counter = Counter()
    saved_counter.count = 7
    state = make_manager(state_objects={"counter": saved_counter}).state_dict()
    assert state["state_objects"] == {"counter": {"count": 7}}
    restored = Counter()
    make_manager(state_objects={"counter": restored}).load_state_dict(state)
    assert restored.count == 7


def test_missing_model_entry_is_named(make_manager):
    state = make_manager().state_dict()
    state["models"] = {"other": {}}
    with pytest.raises(KeyError, match=r"models\['main'\]"):
        make_manager().load_state_dict(state)


def test_model_and_optimizer_state_restored(make_manager):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    manager = make_manager(model=model, optimizer=optimizer)
    for _ in range(3):
        with manager.run_iteration(step_optimizers=["main"]):
            model(torch.ones(1, 3)).sum().backward()
    state = manager.state_dict()

    other = torch.nn.Linear(3, 2)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    assert not torch.equal(other.weight, model.weight)
    training_manager = make_manager(model=other, optimizer=other_opt)
    training_manager.load_state_dict(state)
    assert torch.equal(other.weight, model.weight)
    assert other_opt.state_dict()["state"][0]["step"] == 3


def test_max_epochs_zero_makes_a_manager_that_only_loads(make_manager):
    source = make_manager()
    with source.run_iteration():
        pass
    state = source.state_dict()
    loader = make_manager(max_epochs=0)
    assert loader.stop_trigger is True
    loader.load_state_dict(state)
    assert loader.iteration == 1
    assert loader.stop_trigger is True


def test_finalized_manager_error_matches_ppe_text(make_manager):
    manager = make_manager()
    manager.finalize()
    with pytest.raises(RuntimeError, match="finalized manager"):
        with manager.run_iteration():
            pass
