"""``FailOnNonNumber``: stops training when a parameter or gradient is NaN or infinite."""

from __future__ import annotations

import torch

from snapkeep.training import extension
from snapkeep.training._manager_protocol import ExtensionsManagerProtocol

__all__ = ["FailOnNonNumber"]


class FailOnNonNumber(extension.Extension):
    """Raises when a model's parameters (or their gradients) hold NaN or Inf (as ppe's).

    Runs every iteration by default and reads ``manager.models`` (``needs_model_state``). The
    error is raised from the manager's ``run_iteration``, so every extension's ``on_error``
    runs (a snapshot extension may keep the last good snapshot).

    Args:
        check_grad: Also check ``param.grad`` where it is set (default True).

    Raises:
        RuntimeError: (when called) a parameter or gradient of model ``name`` is not finite;
            the message names the model and the parameter and contains ``'diverge'`` (which
            ppe's tests match).
    """

    needs_model_state = True

    def __init__(self, *, check_grad: bool = True) -> None:
        self._check_grad = bool(check_grad)

    def __call__(self, manager: ExtensionsManagerProtocol) -> None:
        for name, model in manager.models.items():
            for param_name, param in model.named_parameters():
                bad = "parameter" if not torch.isfinite(param).all() else None
                if bad is None and self._check_grad and param.grad is not None \
                        and not torch.isfinite(param.grad).all():
                    bad = "gradient"
                if bad is not None:
                    raise RuntimeError(
                        f"training diverged: the {bad} {param_name!r} of model {name!r} holds "
                        f"NaN or Inf at iteration {manager.iteration}"
                    )
