"""Autoload is all-or-nothing: a snapshot that does not fit the manager (other optimizer param
groups or sizes, a plain model state_dict as the newest file, a missing state object) raises
StateMismatchError naming the file and the mismatches, before anything is loaded: model weights,
optimizer state and iteration stay as they were, and no file is deleted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import snapkeep
from snapkeep.training import ExtensionsManager, extensions
from support.integration import TEMPLATE, listing, param_value, train


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def _run(out, optimizer_of, *, state_objects=None, n_retains=1):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = optimizer_of(model)
    manager = ExtensionsManager(
        model, optimizer, 100, iters_per_epoch=10, state_objects=state_objects,
        writer=snapkeep.writing.SimpleWriter(out_dir=str(out)))
    manager.extend(extensions.snapshot(filename=TEMPLATE, autoload=True, n_retains=n_retains),
                   trigger=(1, "iteration"))
    return manager, model, optimizer


def _one_group(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _two_groups(model):
    return torch.optim.SGD([{"params": model[0].parameters()},
                            {"params": model[1].parameters(), "lr": 0.01}], lr=0.1,
                           momentum=0.9)


def _first_layer_only(model):
    return torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)


def _saved_run(out, optimizer_of=_one_group, **kwargs):
    manager, model, optimizer = _run(out, optimizer_of, **kwargs)
    for _ in range(3):
        with manager.run_iteration():
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()  # momentum buffers exist in the snapshot
    manager.finalize()


def _untouched(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("optimizer_of", "expected"), [
    (_two_groups, "1 param group(s) in the snapshot, 2 in the optimizer"),
    (_first_layer_only, "param_groups[0]: 4 parameter(s) in the snapshot, 2 in the optimizer"),
])
def test_other_optimizer_param_groups_load_nothing(tmp_path, optimizer_of, expected):
    _saved_run(tmp_path)
    before = listing(tmp_path)
    manager, model, optimizer = _run(tmp_path, optimizer_of)
    weights = _untouched(model)
    with pytest.raises(snapkeep.StateMismatchError) as info:
        manager.start_extensions()
    message = str(info.value)
    assert "snapshot_iter_3" in message and "optimizers['main']" in message
    assert expected in message and "Nothing was loaded" in message
    assert manager.iteration == 0
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {}
    assert listing(tmp_path) == before


def test_a_plain_model_state_dict_as_the_newest_file_loads_nothing(tmp_path):
    _saved_run(tmp_path, n_retains=-1)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    torch.save(plain.state_dict(), tmp_path / "snapshot_iter_9")  # e.g. an export by hand
    before = listing(tmp_path)
    manager, model, _ = _run(tmp_path, _one_group)
    weights = _untouched(model)
    with pytest.warns(RuntimeWarning, match="no checksum manifest"), \
            pytest.raises(snapkeep.StateMismatchError) as info:
        manager.start_extensions()
    message = str(info.value)
    assert "snapshot_iter_9" in message and "not a manager snapshot" in message
    assert "'0.weight'" in message  # names what the file holds
    assert manager.iteration == 0
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert listing(tmp_path) == before


def test_a_missing_state_object_loads_nothing(tmp_path):
    _saved_run(tmp_path)
    manager, model, _ = _run(tmp_path, _one_group, state_objects={"counter": Counter()})
    weights = _untouched(model)
    with pytest.raises(snapkeep.StateMismatchError, match=r"missing state_objects\['counter'\]"):
        manager.start_extensions()
    assert manager.iteration == 0
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_fitting_snapshot_still_loads(tmp_path):
    _saved_run(tmp_path)
    manager, model, optimizer = _run(tmp_path, _one_group)
    manager.start_extensions()
    assert manager.iteration == 3
    assert len(optimizer.state_dict()["state"]) == 4  # momentum buffers restored
    manager.finalize()


def test_integration_helpers_still_fit(tmp_path):
    """The plain manager snapshot of the integration runs fits (no false mismatch)."""
    from support.integration import make_run

    manager, _, model = make_run(tmp_path)
    train(manager, model, 2)
    manager.finalize()
    manager, _, model = make_run(tmp_path)
    manager.start_extensions()
    assert manager.iteration == 2
    assert all(torch.all(p == param_value(2)) for p in model.parameters())
    manager.finalize()
