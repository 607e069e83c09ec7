"""Layout of the manager's ``state_dict`` and its version checks.

ppe's keys, loadable by ppe and from ppe::

    _start_iteration, _start_execution   ints
    models, optimizers, state_objects    {name: obj.state_dict()}
    extensions                           {name: {'extension': ..., 'trigger': ...}}

snapkeep's additions (ignored by ppe's loader; optional when loading)::

    _stop_trigger, _internal_stop_trigger   stop trigger states (e.g. EarlyStoppingTrigger)
    _snapkeep_version                       str, checked on load
    _rng_state                              see ``_rng_state.capture_rng_state``
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from snapkeep._core.user_warnings import user_stacklevel
from snapkeep.training._rng_state import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from snapkeep.training.manager import ExtensionsManager

__all__ = ["RNG_STATE_KEY", "VERSION_KEY", "load_manager_state", "manager_state"]

logger = logging.getLogger(__name__)

VERSION_KEY = "_snapkeep_version"
"""``state_dict`` key holding the snapkeep version that produced it."""
RNG_STATE_KEY = "_rng_state"
"""``state_dict`` key holding the global RNG states (see ``save_rng_state``)."""


def snapkeep_version() -> str:
    import snapkeep  # at call time: snapkeep/__init__ imports this package

    return str(snapkeep.__version__)


def manager_state(manager: ExtensionsManager, *, save_rng_state: bool) -> dict[str, Any]:
    """Builds ``manager.state_dict()`` (see the module docstring for the layout)."""
    state: dict[str, Any] = {
        "_start_iteration": manager.iteration,
        "_start_execution": manager.execution,
        "models": {name: model.state_dict() for name, model in manager.models.items()},
        "optimizers": {name: opt.state_dict() for name, opt in manager._optimizers.items()},
        "state_objects": {
            name: obj.state_dict() for name, obj in manager._state_objects.items()
        },
        "extensions": {
            name: entry.state_dict() for name, entry in manager._extensions.items()
        },
        "_stop_trigger": manager._stop_trigger.state_dict(),
        "_internal_stop_trigger": manager._internal_stop_trigger.state_dict(),
        VERSION_KEY: snapkeep_version(),
    }
    if save_rng_state:
        state[RNG_STATE_KEY] = capture_rng_state()
    return state


def load_manager_state(
    manager: ExtensionsManager, to_load: Mapping[str, Any], *, restore_rng: bool
) -> None:
    """Implements ``manager.load_state_dict(to_load)``."""
    check_version(to_load)
    start = int(to_load["_start_iteration"])
    manager._start_iteration = start
    manager.iteration = start
    manager._start_execution = int(to_load.get("_start_execution", start))
    manager.execution = manager._start_execution
    for name, model in manager.models.items():
        model.load_state_dict(_entry(to_load, "models", name))
    for name, optimizer in manager._optimizers.items():
        optimizer.load_state_dict(_entry(to_load, "optimizers", name))
    if "state_objects" in to_load:
        for name, obj in manager._state_objects.items():
            obj.load_state_dict(_entry(to_load, "state_objects", name))
    saved_extensions = to_load.get("extensions", {})
    for name, entry in manager._extensions.items():
        if name in saved_extensions:
            entry.load_state_dict(saved_extensions[name])
        else:
            logger.warning(
                "extension %r has no saved state at iteration %d; it starts fresh", name, start
            )
    if "_stop_trigger" in to_load:
        manager._stop_trigger.load_state_dict(to_load["_stop_trigger"])
    if "_internal_stop_trigger" in to_load:
        manager._internal_stop_trigger.load_state_dict(to_load["_internal_stop_trigger"])
    if restore_rng and RNG_STATE_KEY in to_load:
        restore_rng_state(to_load[RNG_STATE_KEY])


def check_version(to_load: Mapping[str, Any]) -> None:
    """Warns unless ``to_load`` was saved by this snapkeep version or by ppe.

    A dict with ``'ppe_version'`` but no snapkeep version comes from ppe; it is logged, not
    warned about, since loading ppe snapshots is the point of the compatible layout.
    """
    current = snapkeep_version()
    saved = to_load.get(VERSION_KEY)
    if saved is None:
        ppe_version = to_load.get("ppe_version")
        if ppe_version is None:
            warnings.warn(
                f"the state dict records no version ({VERSION_KEY!r} missing); loading it "
                f"into snapkeep {current} anyway",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        else:
            logger.info("loading a state dict saved by pytorch-pfn-extras %s", ppe_version)
    elif saved != current:
        warnings.warn(
            f"the state dict was saved by snapkeep version {saved}, this is snapkeep "
            f"version {current}; loading it anyway",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _entry(to_load: Mapping[str, Any], section: str, name: str) -> Any:
    try:
        return to_load[section][name]
    except KeyError:
        available = sorted(to_load.get(section, {}))
        raise KeyError(
            f"state dict has no {section}[{name!r}] (has {section}: {available})"
        ) from None
