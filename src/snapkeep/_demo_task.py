"""The learning task of the ``snapkeep demo``: scikit-learn's digits and its MLP.

Nothing here calls snapkeep; :mod:`snapkeep.demo` runs this task under snapkeep's manager and
snapshot extension, with a shuffled ``DataLoader`` registered as ``snapshot(loaders=...)`` and
the last loss as a ``state_objects`` entry, so a resumed run continues the same data order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

#: The held-out split does not depend on ``--seed``, so runs with different seeds are comparable.
_SPLIT_SEED = 20240101
_HELD_OUT_FRACTION = 0.2
_N_CLASSES = 10


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_x, train_y, test_x, test_y)``: float32 ``[n, 64]`` in [0, 1] and int64 ``[n]``.

    Raises:
        ImportError: scikit-learn is missing (install the ``demo`` extra).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError(
            "the demo needs scikit-learn for its bundled digits data: "
            "pip install 'snapkeep[demo]'") from e
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    n_test = round(len(x) * _HELD_OUT_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


class LastLoss:
    """The last training loss, kept in the snapshot so a finished run can report it again."""

    def __init__(self) -> None:
        self.value = math.nan

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = float(state["value"])


def augment(x: torch.Tensor) -> torch.Tensor:
    """Random shift of the whole batch by up to one pixel plus Gaussian pixel noise.

    Draws from torch's global RNG (restored on resume by the manager).
    """
    dy, dx = (int(v) for v in torch.randint(-1, 2, (2,)))
    images = torch.roll(x.view(-1, 8, 8), shifts=(dy, dx), dims=(1, 2)).reshape(-1, 64)
    return images + 0.05 * torch.randn_like(images)


def build_model(hidden_size: int) -> torch.nn.Module:
    """MLP 64 -> h -> h -> 10 with ReLU and dropout 0.1."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden_size), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden_size, hidden_size), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden_size, _N_CLASSES),
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` on ``(x, y)``; leaves the model in train mode."""
    model.eval()
    try:
        logits = model(x)
    finally:
        model.train()
    accuracy = float((logits.argmax(dim=1) == y).to(torch.float64).mean())
    return accuracy, float(F.cross_entropy(logits, y))
