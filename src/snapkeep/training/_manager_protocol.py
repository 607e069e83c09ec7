"""Seams between the manager, its extensions, triggers and writer (as ppe's ``_manager_protocol``).

Extensions and triggers only see the manager through :class:`ExtensionsManagerProtocol`, so they
can be driven by test doubles. :class:`WriterLike` is the part of a writer the manager itself uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from snapkeep import reporting
    from snapkeep.training._trigger_util import Trigger
    from snapkeep.training.extension import Extension

__all__ = ["ExtensionsManagerProtocol", "StateObjectProtocol", "WriterLike"]


class WriterLike(Protocol):
    """What :class:`~snapkeep.training.ExtensionsManager` needs from a writer.

    Call order, all on the training thread of the rank that owns the manager:

    1. ``initialize(out_dir)`` once, from the manager's constructor, with ``out_dir`` the
       writer's own ``out_dir`` (as ppe). It may create the directory; an error propagates out of
       the constructor.
    2. ``__call__(...)`` any number of times, by extensions (the snapshot extension), never by
       the manager itself.
    3. ``finalize()`` once, from ``manager.finalize()``, after every extension's ``finalize``;
       it must wait for background saves and re-raise their failures.

    ``snapkeep.writing``'s writers (``SimpleWriter``, ``ThreadWriter``, ...) satisfy it.
    """

    @property
    def out_dir(self) -> str:
        """Directory (or URL prefix) that snapshots are written under."""
        ...

    def initialize(self, out_dir: str) -> None:
        """Prepares ``out_dir`` before training starts."""
        ...

    def finalize(self) -> None:
        """Waits for pending writes and releases resources; idempotent."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Writes one target (signature defined by ``snapkeep.writing``)."""
        ...


class ExtensionsManagerProtocol(Protocol):
    """The manager as seen by extensions and triggers (as ppe's protocol of the same name)."""

    @property
    def iteration(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def epoch_detail(self) -> float: ...

    @property
    def _iters_per_epoch(self) -> int: ...

    @property
    def models(self) -> Mapping[str, torch.nn.Module]: ...

    @property
    def raw_models(self) -> Mapping[str, torch.nn.Module]: ...

    @property
    def optimizers(self) -> Mapping[str, torch.optim.Optimizer]: ...

    @property
    def elapsed_time(self) -> float: ...

    @property
    def is_before_training(self) -> bool: ...

    @property
    def stop_trigger(self) -> bool: ...

    @property
    def _stop_trigger(self) -> Trigger: ...

    @property
    def out(self) -> str: ...

    @property
    def writer(self) -> WriterLike | None: ...

    @property
    def reporter(self) -> reporting.Reporter: ...

    def get_extension(self, name: str) -> Extension: ...

    @property
    def observation(self) -> reporting.Observation: ...


@runtime_checkable
class StateObjectProtocol(Protocol):
    """An object whose state the manager saves and restores (``state_objects=`` argument)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
