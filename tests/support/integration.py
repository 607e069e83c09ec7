"""Shared set-up for the integration tests: a small training run whose parameters are a
deterministic function of the step, so a loaded snapshot can be checked against its step."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

import snapkeep
from snapkeep.training import ExtensionsManager, extensions

TEMPLATE = "snapshot_iter_{.iteration}"


def make_model(out_features: int = 3, in_features: int = 4) -> torch.nn.Module:
    return torch.nn.Linear(in_features, out_features)


def param_value(step: int) -> float:
    """Every parameter equals this after ``step`` iterations."""
    return float(step)


def make_run(
    out_dir: str | os.PathLike[str], *, model: torch.nn.Module | None = None,
    writer: Any = None, trigger: Any = (1, "iteration"), max_epochs: int = 1000,
    **snapshot_kwargs: Any,
) -> tuple[ExtensionsManager, Any, torch.nn.Module]:
    """A manager with a snapshot extension (``autoload=True`` unless overridden)."""
    model = model if model is not None else make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if writer is None:
        writer = snapkeep.writing.SimpleWriter(out_dir=str(out_dir))
    manager = ExtensionsManager(model, optimizer, max_epochs, iters_per_epoch=10, writer=writer)
    snapshot_kwargs.setdefault("autoload", True)
    ext = extensions.snapshot(filename=TEMPLATE, **snapshot_kwargs)
    manager.extend(ext, trigger=trigger)
    return manager, ext, model


def train(
    manager: ExtensionsManager, model: torch.nn.Module, iterations: int,
    losses: Sequence[float] | None = None,
) -> None:
    """Run ``iterations`` iterations; parameters become :func:`param_value` of the new step and
    ``losses[step - 1]`` (when given) is reported as ``'loss'``."""
    for _ in range(iterations):
        with manager.run_iteration():
            step = manager.iteration + 1
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(param_value(step))
            if losses is not None:
                snapkeep.report({"loss": losses[step - 1]})


def listing(directory: str | os.PathLike[str]) -> list[str]:
    """Every file under ``directory`` (relative paths, hidden ones included), sorted; the
    store's lock files (``.snapkeep/*.lock``, never deleted by design) are left out."""
    out = []
    for root, _dirs, files in os.walk(directory):
        for name in files:
            if name.endswith(".lock") and os.path.basename(root) == ".snapkeep":
                continue
            out.append(os.path.relpath(os.path.join(root, name), directory))
    return sorted(out)


def snapshots(directory: str | os.PathLike[str]) -> list[str]:
    """Snapshot files (template names) directly in ``directory``, by step."""
    names = [n for n in os.listdir(directory) if n.startswith("snapshot_iter_")]
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]))


def manifests_of(names: Sequence[str]) -> list[str]:
    return [f".snapkeep/{n}.json" for n in names]


def assert_params(model: torch.nn.Module, step: int) -> None:
    for name, p in model.named_parameters():
        assert torch.all(p == param_value(step)), f"{name} is not the value of step {step}"
