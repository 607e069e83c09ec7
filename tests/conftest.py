"""Shared fixtures. Every test is bounded by pytest-timeout (see pyproject)."""

from __future__ import annotations

import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _snapkeep_logging(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="snapkeep")


@pytest.fixture
def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return model, optimizer
