"""report() inside run_iteration lands in manager.observation; Reporter and summaries."""

from __future__ import annotations

import pytest
import torch

import snapkeep.reporting as reporting


def test_report_lands_in_observation(make_manager):
    manager = make_manager()
    with manager.run_iteration():
        reporting.report({"lr": 0.1})
    assert manager.observation == {"lr": 0.1}
    with manager.run_iteration():
        pass
    assert manager.observation == {}  # fresh per iteration


def test_report_with_model_observer_is_prefixed_and_detached(make_manager):
    model = torch.nn.Sequential(torch.nn.Linear(2, 1))
    manager = make_manager(model=model)
    with manager.run_iteration():
        loss = model(torch.ones(1, 2)).sum()
        reporting.report({"loss": loss}, observer=model)
        reporting.report({"w": 1.0}, observer=model[0])
    assert set(manager.observation) == {"main/loss", "main0/w"}  # ppe's naming for submodules
    assert not manager.observation["main/loss"].requires_grad
    assert float(manager.observation["main/loss"]) == pytest.approx(float(loss.detach()))


def test_extensions_see_the_iterations_observation(make_manager):
    seen = []
    manager = make_manager()
    manager.extend(lambda m: seen.append(dict(m.observation)), name="read")
    with manager.run_iteration():
        reporting.report({"acc": 0.5})
    assert seen == [{"acc": 0.5}]


def test_report_without_a_current_reporter_does_nothing():
    reporting.report({"ignored": 1})
    with pytest.raises(RuntimeError, match="no Reporter is current"):
        reporting.get_current_reporter()


def test_report_scope_redirects_and_restores():
    reporter = reporting.Reporter()
    outer: dict = {}
    inner: dict = {}
    with reporter.scope(outer):
        reporting.report({"a": 1})
        with reporting.report_scope(inner):
            reporting.report({"b": 2})
        reporting.report({"c": 3})
    assert outer == {"a": 1, "c": 3}
    assert inner == {"b": 2}


def test_unregistered_observer_is_an_error():
    reporter = reporting.Reporter()
    with reporter.scope({}):
        with pytest.raises(KeyError, match="not registered"):
            reporter.report({"x": 1}, observer=object())


def test_dict_summary_mean_statistics_and_state():
    summary = reporting.DictSummary()
    summary.add({"x": 1.0, "y": torch.tensor(2.0), "skip": torch.ones(3)})
    summary.add({"x": 3.0, "y": (torch.tensor(4.0), 3)})
    means = summary.compute_mean()
    assert set(means) == {"x", "y"}
    assert means["x"] == 2.0
    assert float(means["y"]) == pytest.approx((2.0 + 12.0) / 4)
    stats = summary.make_statistics()
    assert stats["x.std"] == pytest.approx(1.0)

    restored = reporting.DictSummary()
    restored.load_state_dict(summary.state_dict())
    assert restored.compute_mean()["x"] == 2.0
    assert summary.state_dict()["x"] == {"_x": 4.0, "_x2": 10.0, "_n": 2}


def test_summary_of_constant_values_has_zero_std():
    summary = reporting.Summary()
    for _ in range(3):
        summary.add(0.1)
    assert summary.make_statistics()[1] == 0.0
