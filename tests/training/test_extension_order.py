"""Extension ordering by priority, snapshot-last, initialize/on_error hooks."""

from __future__ import annotations

import pytest

from snapkeep import training


class Recorder(training.Extension):
    def __init__(self, label, log, priority=None):
        self.label = label
        self.log = log
        if priority is not None:
            self.priority = priority

    def __call__(self, manager):
        self.log.append(self.label)

    def initialize(self, manager):
        self.log.append(f"init:{self.label}")


def test_priority_order_with_ties_in_registration_order(make_manager):
    log = []
    manager = make_manager()
    manager.extend(Recorder("reader", log), priority=training.PRIORITY_READER)
    manager.extend(Recorder("writer", log), priority=training.PRIORITY_WRITER)
    manager.extend(Recorder("editor-a", log), priority=training.PRIORITY_EDITOR)
    manager.extend(Recorder("editor-b", log), priority=training.PRIORITY_EDITOR)
    with manager.run_iteration():
        assert log == ["init:writer", "init:editor-a", "init:editor-b", "init:reader"]
        log.clear()
    assert log == ["writer", "editor-a", "editor-b", "reader"]


def test_snapshot_priority_runs_after_lower_priorities(make_manager):
    log = []
    manager = make_manager()
    manager.extend(Recorder("snapshot", log), priority=training.PRIORITY_SNAPSHOT)
    manager.extend(Recorder("very-low", log), priority=training.PRIORITY_SNAPSHOT - 100)
    manager.extend(Recorder("reader", log))
    with manager.run_iteration():
        log.clear()
    assert log == ["reader", "very-low", "snapshot"]


def test_snapshot_sees_every_trigger_of_the_iteration_already_evaluated(make_manager):
    # The snapshot extension saves the state of triggers registered after it; that state must
    # already include this iteration's evaluation (as ppe), or a resume fires them twice.
    once = training.triggers.OnceTrigger()
    captured = []

    def snapshot(manager):
        captured.append(manager.state_dict()["extensions"]["late"]["trigger"])

    snapshot.needs_model_state = True  # state_dict() reads the models
    manager = make_manager()
    manager.extend(snapshot, name="snap", priority=training.PRIORITY_SNAPSHOT)
    manager.extend(lambda m: None, name="late", trigger=once, priority=-1000)
    with manager.run_iteration():
        pass
    assert captured == [{"_flag_first": False}]


def test_duplicate_names_get_suffixes(make_manager):
    manager = make_manager()
    first, second, third = (Recorder(str(i), []) for i in range(3))
    manager.extend(first, name="ext")
    manager.extend(second, name="ext")
    manager.extend(third, name="ext")
    assert manager.get_extension("ext") is first
    assert manager.get_extension("ext_1") is second
    assert manager.get_extension("ext_2") is third


def test_extend_after_start_is_refused(make_manager):
    manager = make_manager()
    with manager.run_iteration():
        pass
    with pytest.raises(RuntimeError, match="extend"):
        manager.extend(Recorder("late", []))


def test_call_before_training_runs_once_before_the_first_iteration(make_manager):
    log = []
    manager = make_manager()
    manager.extend(Recorder("x", log), call_before_training=True, trigger=(2, "iteration"))
    with manager.run_iteration():
        assert log == ["init:x", "x"]
    with manager.run_iteration():
        pass
    assert log == ["init:x", "x", "x"]


def test_on_error_runs_once_and_the_error_propagates(make_manager):
    errors = []

    class Watcher(training.Extension):
        def __call__(self, manager):
            pass

        def on_error(self, manager, exc, tb):
            errors.append((type(exc), tb is not None))

    manager = make_manager()
    manager.extend(Watcher())
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            with manager.run_iteration():
                1 / 0  # noqa: B018
    assert errors == [(ZeroDivisionError, True)]
    assert manager.iteration == 0


def test_failing_extension_triggers_on_error(make_manager):
    errors = []
    manager = make_manager()

    @training.make_extension(on_error=lambda m, exc, tb: errors.append(str(exc)))
    def failing(manager):
        raise ValueError("bad extension")

    manager.extend(failing)
    with pytest.raises(ValueError, match="bad extension"):
        with manager.run_iteration():
            pass
    assert errors == ["bad extension"]


def test_models_only_for_extensions_that_declare_needs_model_state(make_manager):
    class Reads(training.Extension):
        needs_model_state = False

        def __call__(self, manager):
            manager.models["main"]

    manager = make_manager()
    manager.extend(Reads())
    with pytest.raises(RuntimeError, match="needs_model_state"):
        with manager.run_iteration():
            pass
    assert manager.models["main"] is not None  # outside extensions always allowed
