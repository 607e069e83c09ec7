"""``observe_value`` and ``observe_lr``: put a value into the observation (as ppe's)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from snapkeep.training import extension
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol

__all__ = ["observe_lr", "observe_value"]


def observe_value(
    observation_key: str, target_func: Callable[[ExtensionsManagerProtocol], Any]
) -> Callable[[ExtensionsManagerProtocol], None]:
    """Returns an extension that stores ``target_func(manager)`` as ``observation_key``.

    As ppe's ``observe_value``: default trigger once per epoch, priority ``PRIORITY_WRITER``
    (so it runs before the ``LogReport`` of the same iteration reads the observation), default
    name ``'_observe_value'``. Stateless.

    Raises:
        TypeError: ``observation_key`` is not a str or ``target_func`` is not callable.
    """
    if not isinstance(observation_key, str):
        raise TypeError(f"observation_key must be a str, got {observation_key!r}")
    if not callable(target_func):
        raise TypeError(f"target_func must be callable as fn(manager), got {target_func!r}")

    @extension.make_extension(trigger=(1, "epoch"), priority=extension.PRIORITY_WRITER)
    def _observe_value(manager: ExtensionsManagerProtocol) -> None:
        manager.observation[observation_key] = target_func(manager)

    return _observe_value


def observe_lr(
    optimizer: torch.optim.Optimizer, param_group: int = 0, observation_key: str = "lr"
) -> Callable[[ExtensionsManagerProtocol], None]:
    """Returns an extension that observes ``optimizer.param_groups[param_group]['lr']`` (as
    ppe's ``observe_lr``; see :func:`observe_value` for trigger and priority).

    Raises:
        TypeError: ``param_group`` is not an int.
        IndexError: ``param_group`` is out of range for the optimizer (at construction).
    """
    if isinstance(param_group, bool) or not isinstance(param_group, numbers.Integral):
        raise TypeError(f"param_group must be an int, got {param_group!r}")
    groups = getattr(optimizer, "param_groups", None)
    if groups is not None and not -len(groups) <= param_group < len(groups):
        raise IndexError(
            f"param_group {param_group} is out of range: the optimizer has {len(groups)} "
            "param groups"
        )
    return observe_value(
        observation_key, lambda manager: optimizer.param_groups[param_group]["lr"]
    )
