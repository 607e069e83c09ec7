"""True continuation: a run killed between snapshots and resumed ends bit-identical (CPU) to a
run never interrupted, although every iteration draws from torch, NumPy and Python ``random`` and
reads data through a stateful sampler registered in ``state_objects``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

import snapkeep
from snapkeep.training import ExtensionsManager, extensions

ITERATIONS = 12
SNAPSHOT_EVERY = 4
KILLED_AT = 9  # after the snapshot of iteration 8: iteration 9 is lost and redone


class Sampler:
    """Yields dataset indices in a shuffled order per epoch (its own generator); its position
    and order are state, as a data loader's would be."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.epoch = 0
        self.position = 0
        self.order = self._shuffle()

    def _shuffle(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + self.epoch)
        return torch.randperm(self.size, generator=g)

    def next_batch(self, batch: int) -> torch.Tensor:
        if self.position + batch > self.size:
            self.epoch += 1
            self.position = 0
            self.order = self._shuffle()
        out = self.order[self.position:self.position + batch]
        self.position += batch
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "order": self.order.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = state["order"].clone()


DATA = torch.linspace(-1, 1, 40 * 6).reshape(40, 6)


def _build(
    out, save_rng_state: bool = True,
) -> tuple[ExtensionsManager, torch.nn.Module, torch.optim.Optimizer, Sampler]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = Sampler(len(DATA))
    manager = ExtensionsManager(
        {"main": model}, {"main": optimizer}, 100, iters_per_epoch=5,
        writer=snapkeep.writing.SimpleWriter(out_dir=str(out)), state_objects={"sampler": sampler},
        save_rng_state=save_rng_state)
    manager.extend(extensions.snapshot(autoload=True, n_retains=2),
                   trigger=(SNAPSHOT_EVERY, "iteration"))
    return manager, model, optimizer, sampler


def _train(manager, model, sampler, until: int, draws: list[tuple[float, ...]]) -> None:
    while manager.iteration < until:
        with manager.run_iteration(step_optimizers=["main"]):
            x = DATA[sampler.next_batch(8)]
            x = x + torch.from_numpy(np.random.normal(0, 0.1, x.shape).astype(np.float32))
            if random.random() < 0.5:  # python-random augmentation
                x = x.flip(0)
            loss = model(x).pow(2).mean() + 0.01 * torch.randn(()).abs()
            loss.backward()
            snapkeep.report({"loss": loss.item()})
            draws.append((manager.iteration, random.random(), float(np.random.rand()),
                          float(torch.rand(()))))


def _seed(value: int) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def _state(model, optimizer, sampler) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "momentum": [optimizer.state[p]["momentum_buffer"].clone()
                         for p in model.parameters()],
            "sampler": sampler.state_dict()}


def _assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for x, y in zip(a["momentum"], b["momentum"], strict=True):
        assert torch.equal(x, y)
    assert a["sampler"]["position"] == b["sampler"]["position"]
    assert a["sampler"]["epoch"] == b["sampler"]["epoch"]
    assert torch.equal(a["sampler"]["order"], b["sampler"]["order"])


def test_killed_and_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    _seed(0)
    manager, model, optimizer, sampler = _build(tmp_path / "straight")
    straight_draws: list[tuple[float, ...]] = []
    _train(manager, model, sampler, ITERATIONS, straight_draws)
    straight = _state(model, optimizer, sampler)

    _seed(0)
    manager, model, optimizer, sampler = _build(tmp_path / "killed")
    killed_draws: list[tuple[float, ...]] = []
    _train(manager, model, sampler, KILLED_AT, killed_draws)
    # The process dies here: no finalize; only what the writer committed survives. The new
    # process starts with other random states and fresh objects.
    del manager, model, optimizer, sampler
    _seed(999)
    manager, model, optimizer, sampler = _build(tmp_path / "killed")
    resumed_draws: list[tuple[float, ...]] = []
    assert manager.iteration == 8  # resumed from the last snapshot before the kill
    _train(manager, model, sampler, ITERATIONS, resumed_draws)
    manager.finalize()

    assert killed_draws == straight_draws[:KILLED_AT]
    assert resumed_draws == straight_draws[8:]  # iteration 9 redone with the same numbers
    _assert_identical(_state(model, optimizer, sampler), straight)


def test_without_rng_state_the_resumed_run_differs(tmp_path):
    """The check above is sensitive: dropping the RNG states from the snapshot breaks it."""
    _seed(0)
    manager, model, optimizer, sampler = _build(tmp_path / "straight")
    straight_draws: list[tuple[float, ...]] = []
    _train(manager, model, sampler, ITERATIONS, straight_draws)

    _seed(0)
    manager, model, optimizer, sampler = _build(tmp_path / "killed", save_rng_state=False)
    _train(manager, model, sampler, KILLED_AT, [])
    _seed(999)
    manager, model, optimizer, sampler = _build(tmp_path / "killed")
    resumed_draws: list[tuple[float, ...]] = []
    _train(manager, model, sampler, ITERATIONS, resumed_draws)
    manager.finalize()
    assert resumed_draws != straight_draws[8:]
