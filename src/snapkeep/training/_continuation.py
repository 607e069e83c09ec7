"""Continuation state: what a resumed run needs, besides models and optimizers, to go on exactly
as an uninterrupted one would. The snapshot extension carries it in its own ``state_dict()``, so
it travels in ``manager.state_dict()['extensions'][name]['extension']`` under snapkeep's manager
and under ppe's (whose layout has no other place for it), and it is restored while the manager
loads, i.e. before the training loop builds its next ``DataLoader`` iterator (ppe autoloads at
the first ``stop_trigger`` check)::

    {'format': 'snapkeep.continuation/1',
     'rng': {...},                      # see _rng_state.capture_rng_state; absent when disabled
     'generators': {name: state},       # objects the loop registered (snapshot(generators=...))
     'loaders': {name: position},       # data loaders' positions (snapshot(loaders=...));
                                        # see snapkeep._core.state.data_position
     'stop_trigger': {...},             # the manager's stop trigger state (EarlyStoppingTrigger)
     'internal_stop_trigger': {...},    # ... after their call at this iteration, and
     'stop_decisions': {'stop_trigger': (iteration, bool), ...}}   # see _stop_decision

Every value loads with ``torch.load(weights_only=True)`` and compares with ``==``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import torch

from snapkeep.layout import (
    LoaderPosition,
    capture_rng_state,
    restore_rng_state,
    to_bytes,
    to_tensor,
)
from snapkeep.training._stop_decision import StopDecision, wrap_stop_triggers

__all__ = ["FORMAT", "ContinuationMixin", "capture", "check_generators",
           "continuation_problems", "restore"]

logger = logging.getLogger(__name__)

FORMAT = "snapkeep.continuation/1"

_GENERATOR_KINDS = (
    "torch.Generator, random.Random, numpy.random.Generator/RandomState, or an object with "
    "state_dict()/load_state_dict()")


def check_generators(generators: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate ``snapshot(generators=...)``.

    Raises:
        TypeError: not a mapping of str to supported objects (the message names the kinds).
    """
    if generators is None:
        return {}
    if not isinstance(generators, Mapping):
        raise TypeError(f"generators must be a mapping of names to generators, got "
                        f"{type(generators).__name__}")
    for name, obj in generators.items():
        if not isinstance(name, str) or _kind(obj) is None:
            raise TypeError(f"generators[{name!r}] is a {type(obj).__name__}; accepted: "
                            f"{_GENERATOR_KINDS}")
    return dict(generators)


def _kind(obj: Any) -> str | None:
    if isinstance(obj, torch.Generator):
        return "torch"
    if isinstance(obj, random.Random):
        return "python"
    if hasattr(getattr(obj, "bit_generator", None), "state"):
        return "numpy_generator"
    if callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None)):
        return "numpy_random_state"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict",
                                                                       None)):
        return "state_dict"
    return None


def _plain(value: Any) -> Any:
    """NumPy arrays and scalars inside a bit generator's state as tuples/ints."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        out = tolist()
        return tuple(out) if isinstance(out, list) else out
    return value


def _capture_one(obj: Any) -> Any:
    kind = _kind(obj)
    if kind == "torch":
        return to_bytes(obj.get_state())
    if kind == "python":
        version, internal, gauss = obj.getstate()
        return (int(version), tuple(int(v) for v in internal), gauss)
    if kind == "numpy_generator":
        return _plain(obj.bit_generator.state)
    if kind == "numpy_random_state":
        kind_name, keys, pos, has_gauss, cached = obj.get_state(legacy=True)
        return (str(kind_name), tuple(int(k) for k in keys), int(pos), int(has_gauss),
                float(cached))
    return obj.state_dict()


def _restore_one(obj: Any, state: Any) -> None:
    kind = _kind(obj)
    if kind == "torch":
        obj.set_state(to_tensor(state))
    elif kind == "python":
        version, internal, gauss = state
        obj.setstate((int(version), tuple(int(v) for v in internal), gauss))
    elif kind == "numpy_generator":
        import numpy as np

        restored = dict(state)
        inner = restored.get("state")
        if isinstance(inner, Mapping) and isinstance(inner.get("key"), tuple):
            inner = {**inner, "key": np.asarray(inner["key"], dtype=np.uint32)}
            restored["state"] = inner
        obj.bit_generator.state = restored
    elif kind == "numpy_random_state":
        import numpy as np

        kind_name, keys, pos, has_gauss, cached = state
        obj.set_state((kind_name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss),
                       float(cached)))
    else:
        obj.load_state_dict(state)


def capture(manager: Any, *, rng: bool, generators: Mapping[str, Any],
            loaders: Mapping[str, LoaderPosition] | None = None) -> dict[str, Any]:
    """The continuation state of ``manager`` now (see the module docstring).

    Args:
        manager: snapkeep's or ppe's manager (its stop triggers are read when present).
        rng: include Python's, NumPy's, torch's CPU and CUDA global generator states.
        generators: objects registered by the loop, by name.
        loaders: data loader positions by name (``snapkeep.layout.check_loaders``).
    """
    state: dict[str, Any] = {"format": FORMAT}
    if loaders:  # first: a loader's state_dict may draw (torchdata's builds an iterator)
        state["loaders"] = {name: position.state_dict() for name, position in loaders.items()}
    if rng:
        state["rng"] = capture_rng_state()
    if generators:
        state["generators"] = {name: _capture_one(g) for name, g in generators.items()}
    decisions: dict[str, tuple[int, bool]] = {}
    for key in ("_stop_trigger", "_internal_stop_trigger"):
        trigger = getattr(manager, key, None)
        if isinstance(trigger, StopDecision):  # decide this iteration first: _stop_decision
            trigger(manager)
            if trigger.decided is not None:
                decisions[key.lstrip("_")] = trigger.decided
        to_state = getattr(trigger, "state_dict", None)
        if callable(to_state):
            state[key.lstrip("_")] = to_state()
    if decisions:
        state["stop_decisions"] = decisions
    return state


def restore(manager: Any, state: Mapping[str, Any], *, rng: bool,
            generators: Mapping[str, Any],
            loaders: Mapping[str, LoaderPosition] | None = None) -> None:
    """Restore what :func:`capture` returned.

    Generators and loaders registered now but absent from ``state`` (and the reverse) are
    logged and left as they are. A loader's position applies at the loop's next
    ``iter(loader)``. A resume in the middle of an epoch with no loader registered logs one
    warning naming ``loaders=`` (a ``for batch in loader`` loop would replay the epoch from its
    start).

    Raises:
        ValueError: ``state`` is not a continuation state of a known format; a loader's saved
            position does not fit the registered loader.
    """
    problems = continuation_problems(state, loaders)
    if problems:
        raise ValueError("; ".join(problems))
    decisions = state.get("stop_decisions", {})
    for key in ("stop_trigger", "internal_stop_trigger"):
        trigger = getattr(manager, "_" + key, None)
        load = getattr(trigger, "load_state_dict", None)
        if key in state and callable(load):
            load(state[key])
        if isinstance(trigger, StopDecision):
            # the saved decision stands for a trigger that keeps state (its observation was
            # consumed by the snapshot's call); a stateless one (the run length) is asked
            # again, so a rerun with more epochs goes on instead of stopping at the snapshot
            decided = decisions.get(key) if isinstance(decisions, Mapping) else None
            keeps_state = bool(trigger.state_dict())
            trigger.decided = None if decided is None or not keeps_state else (
                int(decided[0]), bool(decided[1]))
    saved = state.get("generators", {})
    for name, obj in generators.items():
        if name in saved:
            _restore_one(obj, saved[name])
        else:
            logger.warning("generator %r has no saved state; it continues from its current "
                           "state", name)
    for name in sorted(set(saved) - set(generators)):
        logger.warning("the snapshot holds the state of generator %r, which is not registered "
                       "now; ignored", name)
    loaders = loaders or {}
    saved_loaders = state.get("loaders", {})
    for name, position in loaders.items():
        if name in saved_loaders:
            position.load_state_dict(saved_loaders[name], name)
        else:
            logger.warning("loader %r has no saved position; it starts its epoch from the "
                           "beginning", name)
    for name in sorted(set(saved_loaders) - set(loaders)):
        logger.warning("the snapshot holds the position of loader %r, which is not registered "
                       "now (snapshot(loaders=...)); ignored", name)
    if not loaders:
        _hint_mid_epoch(manager)
    if rng and "rng" in state:
        restore_rng_state(state["rng"])


def continuation_problems(state: Any, loaders: Mapping[str, LoaderPosition] | None) -> list[str]:
    """Why ``state`` (from :func:`capture`) cannot be restored exactly: an unknown format, or a
    registered loader whose saved position does not fit it (its geometry changed). Changes
    nothing: the snapshot extension checks this before any part of a snapshot is loaded."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        return [f"not a snapkeep continuation state (format {found!r}, expected {FORMAT!r})"]
    saved_loaders = state.get("loaders", {})
    problems: list[str] = []
    for name, position in (loaders or {}).items():
        if isinstance(saved_loaders, Mapping) and name in saved_loaders:
            problems += position.problems(saved_loaders[name], name)
    return problems


def _hint_mid_epoch(manager: Any) -> None:
    """One warning when the run resumes inside an epoch and no loader position is kept."""
    iteration: Any = getattr(manager, "_iteration", None)
    if iteration is None:  # ppe's manager keeps a plain attribute
        iteration = getattr(manager, "iteration", 0)
    per_epoch = getattr(manager, "_iters_per_epoch", None)
    if not isinstance(per_epoch, int) or per_epoch < 1 or int(iteration) % per_epoch == 0:
        return
    logger.warning(
        "resuming at iteration %d, %d iterations into an epoch of %d, with no data loader "
        "position in the snapshot: if the loop iterates a DataLoader, pass "
        "extensions.snapshot(..., loaders={'train': loader}) so the epoch continues where it "
        "stopped (without it the loop starts the loader's epoch over)",
        int(iteration), int(iteration) % per_epoch, per_epoch)


class ContinuationMixin:
    """Gives a snapshot extension the continuation state as its ``state_dict()``.

    Only an extension that snapshots the manager (``target`` None) carries it; ``snapshot_object``
    keeps ppe's empty state. The manager is the one the extension was initialized with; RNG
    capture follows the manager's ``save_rng_state`` (snapkeep's manager; on by default under
    ppe's manager).
    """

    _target: Any
    _generators: dict[str, Any]
    _loaders: dict[str, LoaderPosition] = {}  # noqa: RUF012  (replaced per instance)
    _continuation_manager: Any = None

    def _bind_continuation(self, manager: Any) -> None:
        """Remember ``manager`` and wrap its stop triggers (``_stop_decision``) when this
        extension carries the continuation state; call at the start of ``initialize``, before
        anything (the memory tier, autoload) loads a snapshot."""
        self._continuation_manager = manager
        if self._carries_continuation():
            wrap_stop_triggers(manager)

    def _carries_continuation(self) -> bool:
        return self._target is None

    def _rng_enabled(self) -> bool:
        return bool(getattr(self._continuation_manager, "_save_rng_state", True))

    def state_dict(self) -> dict[str, Any]:
        """The continuation state (module docstring of ``snapkeep.training._continuation``) when
        this extension snapshots the manager; ``{}`` otherwise (as ppe)."""
        if not self._carries_continuation():
            return {}
        return capture(self._continuation_manager, rng=self._rng_enabled(),
                       generators=self._generators, loaders=self._loaders)

    def continuation_problems(self, to_load: Any) -> list[str]:
        """Why :meth:`load_state_dict` would refuse ``to_load`` (see
        :func:`continuation_problems`); empty when it loads, or carries nothing."""
        if not to_load or not self._carries_continuation():
            return []
        return continuation_problems(to_load, self._loaders)

    def load_state_dict(self, to_load: dict[str, Any]) -> None:
        """Restore RNG, generator, loader and stop trigger states saved by :meth:`state_dict`;
        an empty dict (ppe's snapshot, snapkeep 0.1.0) restores nothing.

        Raises:
            ValueError: a non-empty state of an unknown format.
        """
        if not to_load or not self._carries_continuation():
            return
        restore(self._continuation_manager, to_load, rng=self._rng_enabled(),
                generators=self._generators, loaders=self._loaders)
