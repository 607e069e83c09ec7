"""Layout of the manager's ``state_dict`` and its version checks.

ppe 0.9.0's layout, key for key (loadable by ppe's manager, and ppe's snapshots load here)::

    _start_iteration, _start_execution   ints
    models, optimizers, state_objects    {name: obj.state_dict()} (models loaded through
                                         snapkeep.wrapping.live_state: canonical keys load
                                         into a compiled or DDP-wrapped model)
    extensions                           {name: {'extension': ..., 'trigger': ...}}
    ppe_version                          str: snapkeep's version (``ppe.__version__`` after
                                         ``import snapkeep as ppe``)

What a resumed run needs beyond that (RNG states, stop trigger states, registered generators)
travels in the snapshot extension's own part, ``extensions[name]['extension']`` (see
``_continuation``). Snapshots of snapkeep 0.1.0 also had ``_rng_state``, ``_stop_trigger``,
``_internal_stop_trigger`` and ``_snapkeep_version`` at the top level; they still load.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from snapkeep.layout import restore_rng_state
from snapkeep.session import user_stacklevel
from snapkeep.wrapping import live_state

if TYPE_CHECKING:
    from snapkeep.training.manager import ExtensionsManager

__all__ = ["PPE_VERSION_KEY", "RNG_STATE_KEY", "VERSION_KEY", "load_manager_state",
           "manager_state"]

logger = logging.getLogger(__name__)

PPE_VERSION_KEY = "ppe_version"
"""``state_dict`` key holding the version that produced it (ppe's key; snapkeep's version)."""
VERSION_KEY = "_snapkeep_version"
"""Top-level key of snapkeep 0.1.0 state dicts (read when loading; no longer written)."""
RNG_STATE_KEY = "_rng_state"
"""Top-level key of the RNG states in snapkeep 0.1.0 state dicts (restored when loading)."""

#: The ppe release whose API and layout snapkeep follows: its state dicts load without warning.
COMPATIBLE_PPE_VERSION = "0.9.0"


def snapkeep_version() -> str:
    import snapkeep  # at call time: snapkeep/__init__ imports this package

    return str(snapkeep.__version__)


def manager_state(manager: ExtensionsManager) -> dict[str, Any]:
    """Builds ``manager.state_dict()`` (see the module docstring for the layout)."""
    return {
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
        PPE_VERSION_KEY: snapkeep_version(),
    }


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
    for name, model in manager.models.items():  # canonical keys -> this wrapping's
        model.load_state_dict(live_state(model, _entry(to_load, "models", name)))
    for name, optimizer in manager._optimizers.items():
        optimizer.load_state_dict(_entry(to_load, "optimizers", name))
    if "state_objects" in to_load:
        for name, obj in manager._state_objects.items():
            obj.load_state_dict(_entry(to_load, "state_objects", name))
    # snapkeep 0.1.0 snapshots: continuation state at the top level
    if "_stop_trigger" in to_load:
        manager._stop_trigger.load_state_dict(to_load["_stop_trigger"])
    if "_internal_stop_trigger" in to_load:
        manager._internal_stop_trigger.load_state_dict(to_load["_internal_stop_trigger"])
    if restore_rng and RNG_STATE_KEY in to_load:
        restore_rng_state(to_load[RNG_STATE_KEY])
    saved_extensions = to_load.get("extensions", {})
    for name, entry in manager._extensions.items():
        if name in saved_extensions:
            entry.load_state_dict(saved_extensions[name])
        else:
            logger.warning(
                "extension %r has no saved state at iteration %d; it starts fresh", name, start
            )


def check_version(to_load: Mapping[str, Any]) -> None:
    """Warns (``UserWarning``, as ppe's manager) unless ``to_load`` was saved by this snapkeep
    version or by ppe 0.9.0, whose layout snapkeep follows."""
    current = snapkeep_version()
    saved = to_load.get(VERSION_KEY)  # snapkeep 0.1.0
    if saved is not None:
        if saved != current:
            warnings.warn(
                f"the state dict was saved by snapkeep version {saved}, this is snapkeep "
                f"version {current}; loading it anyway", UserWarning, stacklevel=user_stacklevel())
        return
    version = to_load.get(PPE_VERSION_KEY)
    if version is None:
        warnings.warn(
            f"the state dict records no version ({PPE_VERSION_KEY!r} missing); loading it into "
            f"snapkeep {current} anyway", UserWarning, stacklevel=user_stacklevel())
    elif version == COMPATIBLE_PPE_VERSION:
        logger.info("loading a state dict saved by pytorch-pfn-extras %s", version)
    elif version != current:
        warnings.warn(
            f"the state dict was saved by version {version} (snapkeep, or ppe before "
            f"{COMPATIBLE_PPE_VERSION}); this is snapkeep {current}; loading it anyway",
            UserWarning, stacklevel=user_stacklevel())


def _entry(to_load: Mapping[str, Any], section: str, name: str) -> Any:
    try:
        return to_load[section][name]
    except KeyError:
        available = sorted(to_load.get(section, {}))
        raise KeyError(
            f"state dict has no {section}[{name!r}] (has {section}: {available})"
        ) from None
