"""RNG state continuation and torch.load(weights_only=True) of the whole manager state."""

from __future__ import annotations

import io
import logging
import random

import numpy as np
import pytest
import torch

import snapkeep
from snapkeep.layout import restore_rng_state
from snapkeep.training import Extension, extensions, triggers


def _draw():
    return (
        random.random(),
        random.gauss(0.0, 1.0),  # leaves a cached gauss_next
        np.random.rand(3).tolist(),
        float(np.random.randn()),  # leaves a cached gaussian
        torch.rand(3).tolist(),
    )


def _with_snapshot(manager, **kwargs):
    manager.extend(extensions.snapshot(**kwargs), name="snapshot")
    return manager


def test_rng_state_round_trip_through_the_snapshot_extension(make_manager):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    _draw()
    manager = _with_snapshot(make_manager())
    state = manager.state_dict()
    assert "_rng_state" not in state  # ppe's layout: it lives in the extension's part
    assert set(state["extensions"]["snapshot"]["extension"]["rng"]) >= {"python", "numpy",
                                                                        "torch"}
    expected = _draw()
    assert _draw() != expected  # the generators have moved on

    _with_snapshot(make_manager()).load_state_dict(state)
    assert _draw() == expected


def test_registered_generators_round_trip(make_manager):
    gen, rnd, npgen = torch.Generator().manual_seed(5), random.Random(5), np.random.default_rng(5)
    regs = {"loader": gen, "aug": rnd, "np": npgen}

    def draw():
        return (torch.rand(2, generator=gen).tolist(), rnd.random(), npgen.random(2).tolist())

    state = _with_snapshot(make_manager(), generators=regs).state_dict()
    expected = draw()
    assert draw() != expected
    _with_snapshot(make_manager(), generators=regs).load_state_dict(state)
    assert draw() == expected
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["extensions"] == state["extensions"]


def test_bad_generators_are_rejected_naming_the_argument():
    with pytest.raises(TypeError, match=r"generators\['x'\].*accepted: torch.Generator"):
        extensions.snapshot(generators={"x": object()})


def test_old_snapkeep_state_with_top_level_rng_still_loads(make_manager):
    torch.manual_seed(3)
    state = make_manager().state_dict()
    state.pop("ppe_version")
    state["_snapkeep_version"] = snapkeep.__version__
    from snapkeep.layout import capture_rng_state

    state["_rng_state"] = capture_rng_state()
    expected = torch.rand(3).tolist()
    make_manager().load_state_dict(state)
    assert torch.rand(3).tolist() == expected


def test_save_rng_state_false_neither_saves_nor_restores(make_manager):
    with_rng = _with_snapshot(make_manager()).state_dict()
    manager = _with_snapshot(make_manager(save_rng_state=False))
    assert "rng" not in manager.state_dict()["extensions"]["snapshot"]["extension"]
    torch.manual_seed(2)
    expected = torch.rand(2)
    torch.manual_seed(2)
    manager.load_state_dict(with_rng)
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cuda_state_without_cuda_is_skipped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="snapkeep._core.state.rng_state"):
        restore_rng_state({"cuda": [torch.zeros(16, dtype=torch.uint8)]})
    assert "CUDA is not available" in caplog.text


class TensorState(Extension):
    def __init__(self):
        self.total = torch.zeros(2)

    def __call__(self, manager):
        self.total += 1

    def state_dict(self):
        return {"total": self.total.clone()}

    def load_state_dict(self, state):
        self.total = state["total"].clone()


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _build(make_manager):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    manager = make_manager(
        model=model,
        optimizer=optimizer,
        iters_per_epoch=2,
        state_objects={"scheduler": scheduler},
        stop_trigger=triggers.EarlyStoppingTrigger(monitor="main/loss", check_trigger=(1, "epoch")),
    )
    manager.extend(TensorState(), name="tensor", trigger=triggers.MinValueTrigger(
        "main/loss", (1, "iteration")))
    manager.extend(lambda m: None, name="once", trigger=triggers.OnceTrigger(True))
    manager.extend(lambda m: None, name="time", trigger=triggers.TimeTrigger(3600))
    manager.extend(lambda m: None, name="fn", trigger=triggers.FunctionTrigger(lambda: False))
    return manager, model, scheduler


def test_whole_state_dict_survives_weights_only_load(make_manager):
    manager, model, scheduler = _build(make_manager)
    for _ in range(5):
        with manager.run_iteration(step_optimizers=["main"]):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            snapkeep.reporting.report({"loss": loss}, observer=model)
            loss.backward()
        scheduler.step()
    saved = manager.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    _assert_same(saved, loaded)

    fresh, fresh_model, _ = _build(make_manager)
    assert not torch.equal(fresh_model[0].weight, model[0].weight)
    fresh.load_state_dict(loaded)
    _assert_same(fresh.state_dict(), saved)
