"""The DCP state of a sharded snapshot: how :class:`~._sharded._ShardedSnapshot` maps its target
to the layout in :mod:`._sharded`'s docstring and back.

:class:`ShardedStateLayout` is held by the extension (built from its target and ``weights_only``);
the extension passes its rank to each call. Models and optimizers go through
``torch.distributed.checkpoint.state_dict``; other objects (the manager's own state, its state
objects) are ``torch.save`` bytes (loaded with ``weights_only`` as the extension was told), saved
by every rank under its rank and restored on the same rank (:class:`~snapkeep.distributed.
RankObjects`: a rank added since takes rank 0's, warned once).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from snapkeep.distributed import (
    RankObjects,
    object_from_bytes,
    object_to_bytes,
    optimizer_module,
)
from snapkeep.layout import capture_rng_state, restore_rng_state
from snapkeep.store import Entry

logger = logging.getLogger(__name__)

_MANAGER_OBJECT = "manager"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedStateLayout:
    """Builds the state a sharded snapshot saves, the template it loads into, and applies it.

    Attributes:
        target: what to snapshot (None: the manager).
        weights_only: unpickle the non-tensor state with ``torch.load(weights_only=True)``.
    """

    target: Any
    weights_only: bool

    def _parts(self, manager: Any) -> tuple[dict[str, torch.nn.Module],
                                            dict[str, torch.optim.Optimizer], dict[str, Any]]:
        """``(models, optimizers, other objects)`` of the target."""
        target = manager if self.target is None else self.target
        if target is manager:
            return dict(manager.models), dict(manager.optimizers), {_MANAGER_OBJECT: manager}
        objects = dict(target) if type(target) is dict else {"target": target}
        models = {k: v for k, v in objects.items() if isinstance(v, torch.nn.Module)}
        optimizers = {k: v for k, v in objects.items() if isinstance(v, torch.optim.Optimizer)}
        others = {k: v for k, v in objects.items() if k not in models and k not in optimizers}
        return models, optimizers, others

    @staticmethod
    def _model_of(optimizer: torch.optim.Optimizer, models: Mapping[str, torch.nn.Module],
                  name: str) -> torch.nn.Module:
        model = optimizer_module(optimizer, models)
        if model is not None:
            return model
        raise ValueError(f"optimizer {name!r} holds no parameter of the snapshot's models "
                         f"{sorted(models)}; SHARDED saves optimizers with their model")

    def _other_state(self, name: str, obj: Any) -> Any:
        if name == _MANAGER_OBJECT and self.target is None:
            state = dict(obj.state_dict())
            for key in ("models", "optimizers", "_rng_state"):
                state.pop(key, None)
            return state
        return obj.state_dict()

    def state(self, manager: Any, rank: int) -> dict[str, Any]:
        """The DCP state to save of ``manager``'s target; ``rank``: this process's rank."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        models, optimizers, others = self._parts(manager)
        state: dict[str, Any] = {
            "models": {n: get_model_state_dict(m) for n, m in models.items()},
            "optimizers": {n: get_optimizer_state_dict(self._model_of(o, models, n), o)
                           for n, o in optimizers.items()},
            **RankObjects.tree(rank, {n: object_to_bytes(self._other_state(n, o))
                                      for n, o in others.items()}),
        }
        if self.target is None and getattr(manager, "_save_rng_state", False):
            state["rank_state"] = {f"rank{rank}": object_to_bytes(capture_rng_state())}
        return state

    def load_template(self, manager: Any, keys: set[str], rank: int) -> dict[str, Any]:
        """What to load a snapshot holding the flattened ``keys`` into, on ``rank``.

        Raises:
            KeyError: the snapshot lacks an object of the target (saved from another target).
        """
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        models, optimizers, others = self._parts(manager)
        template: dict[str, Any] = {
            "models": {n: get_model_state_dict(m) for n, m in models.items()},
            "optimizers": {n: get_optimizer_state_dict(self._model_of(o, models, n), o)
                           for n, o in optimizers.items()},
        }
        plan = RankObjects.of(keys, list(others), rank)
        if plan.missing:
            raise KeyError(f"the snapshot lacks {list(plan.missing)} of rank {rank}; it was "
                           "saved from another target")
        template.update(plan.template())
        own = f"rank{rank}"
        if self.target is None and f"rank_state.{own}" in keys:
            template["rank_state"] = {own: b""}
        return template

    def objects_template(self, template: Mapping[str, Any]) -> dict[str, Any]:
        """The part of a :meth:`load_template` holding the non-tensor objects (the manager's
        own state among them): small ``bytes`` entries, loadable on their own."""
        return {k: v for k, v in template.items() if k not in ("models", "optimizers",
                                                               "rank_state")}

    def problems(self, manager: Any, loaded: dict[str, Any], rank: int) -> list[str]:
        """What keeps the loaded :meth:`objects_template` from loading into ``manager``'s
        extensions (``_restore.extension_problems``: the data loaders' saved positions);
        changes nothing."""
        from snapkeep.training.extensions._restore import extension_problems

        if self.target is not None:
            return []
        _, _, others = self._parts(manager)
        plan = RankObjects.of_loaded(loaded, list(others), rank)
        data = plan.loaded(loaded).get(_MANAGER_OBJECT)
        if data is None:
            return []
        state = object_from_bytes(data, self.weights_only)
        return extension_problems(manager, state) if isinstance(state, Mapping) else []

    def apply_loaded(self, manager: Any, loaded: dict[str, Any], entry: Entry, rank: int) -> None:
        """Set ``manager``'s target from ``loaded`` (a filled :meth:`load_template`) of
        ``entry``."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        models, optimizers, others = self._parts(manager)
        plan = RankObjects.of_loaded(loaded, list(others), rank)
        values = plan.loaded(loaded)
        for name, obj in others.items():
            state = object_from_bytes(values[name], self.weights_only)
            if name == _MANAGER_OBJECT and self.target is None:
                # the manager's own loader restores iteration, extensions and triggers; models
                # and optimizers are set from the sharded state just below
                state = {**state,
                         "models": {n: m.state_dict() for n, m in models.items()},
                         "optimizers": {n: o.state_dict() for n, o in optimizers.items()}}
            obj.load_state_dict(state)
        for name, model in models.items():
            set_model_state_dict(model, loaded["models"][name])
        for name, optimizer in optimizers.items():
            set_optimizer_state_dict(self._model_of(optimizer, models, name), optimizer,
                                     loaded["optimizers"][name])
        rank_state = loaded.get("rank_state", {}).get(f"rank{rank}")
        no_rng = False
        if rank_state is not None and getattr(manager, "_save_rng_state", False):
            restore_rng_state(object_from_bytes(rank_state, self.weights_only))
        elif self.target is None and getattr(manager, "_save_rng_state", False):
            no_rng = True
        if plan.from_rank0 or no_rng:  # one warning: this rank did not exist at save time
            taken = (f"its state {list(plan.from_rank0)} is rank 0's"
                     if plan.from_rank0 else "")
            streams = "its random streams start from the current state" if no_rng else ""
            logger.warning("rank %d: %s holds no state of this rank (saved on fewer ranks); %s",
                           rank, entry.path, "; ".join(p for p in (taken, streams) if p))

