"""Fakes shared by the training tests: a writer that records the manager's calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from snapkeep.training import ExtensionsManager


class RecordingWriter:
    """Stand-in writer: records every call the manager makes, writes nothing."""

    def __init__(self, out_dir: str = "fake-out") -> None:
        self._out_dir = out_dir
        self.calls: list[tuple[str, Any]] = []

    @property
    def out_dir(self) -> str:
        return self._out_dir

    def initialize(self, out_dir: str) -> None:
        self.calls.append(("initialize", out_dir))

    def finalize(self) -> None:
        self.calls.append(("finalize", None))

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("call", args))


@pytest.fixture
def writer() -> RecordingWriter:
    return RecordingWriter()


@pytest.fixture
def make_manager(writer: RecordingWriter) -> Callable[..., ExtensionsManager]:
    """Builds a manager around a small model, with the recording writer unless overridden."""

    def make(
        *,
        iters_per_epoch: int = 4,
        max_epochs: int = 3,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> ExtensionsManager:
        model = model if model is not None else torch.nn.Linear(3, 2)
        if optimizer is None:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        kwargs.setdefault("writer", writer)
        return ExtensionsManager(
            model, optimizer, max_epochs, iters_per_epoch=iters_per_epoch, **kwargs
        )

    return make
