"""An EMA copy of a model's state, updated in place after each step: a state object no
optimizer owns (the overlap and the staging budget copy it at the call)."""

from __future__ import annotations

import torch


class Ema:
    """An EMA copy of the model's state, updated in place after each step (a state object)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                self.shadow[key].mul_(0.5).add_(value, alpha=0.5)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.shadow = state
