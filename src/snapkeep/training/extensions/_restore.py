"""Autoload's fit check: does a loaded snapshot fit the target? Checked before anything is loaded.

Autoload is all-or-nothing. Before the first ``load_state_dict`` call, :func:`fit_problems` checks
every part of the target against the snapshot:

- modules (a model target, or each of a manager's ``models``): every tensor key and shape;
- optimizers (an optimizer target, or each of a manager's ``optimizers``): the number of param
  groups, the number of parameters in each group, and that each saved per-parameter state
  belongs to a saved parameter and holds tensors of that parameter's shape;
- a manager: the snapshot is a manager snapshot (``_start_iteration``, ``models``,
  ``optimizers`` present -- a plain model ``state_dict`` is not), and it has an entry for every
  model, optimizer and state object the manager has; each registered extension with a
  ``continuation_problems(state)`` method (snapkeep's snapshot extension: its data loaders'
  positions and geometry) accepts its saved state;
- a dict target: every key is present and each value fits as above.

Any problem raises :class:`~snapkeep.errors.StateMismatchError` naming the file and the
mismatches; nothing is loaded (model weights and iteration unchanged) and nothing is deleted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from snapkeep.errors import StateMismatchError
from snapkeep.store import Entry, describe, find_mismatches

MANAGER_KEYS = ("_start_iteration", "models", "optimizers")
"""Keys every manager snapshot has (ppe's layout); their absence means another kind of file."""


def check_target(target: Any) -> None:
    """Raise ``TypeError`` unless ``target`` (or each value of a dict target) has
    ``state_dict()``/``load_state_dict()``."""
    if target is None:
        return
    objects = target.items() if type(target) is dict else [("target", target)]
    for key, obj in objects:
        missing = [m for m in ("state_dict", "load_state_dict")
                   if not callable(getattr(obj, m, None))]
        if missing:
            where = "target" if type(target) is not dict else f"target[{key!r}]"
            raise TypeError(
                f"{where} ({type(obj).__name__}) has no {' or '.join(missing)}; snapshot targets "
                "must be objects with state_dict()/load_state_dict() (modules, optimizers, the "
                "manager) or a dict of them")


def pairs_to_load(target: Any, state: Any, entry: Entry) -> list[tuple[Any, Any, str]]:
    """``(object, its saved state, where)`` for each part of ``target``.

    Raises:
        StateMismatchError: a dict target whose keys the snapshot lacks.
    """
    if type(target) is not dict:
        return [(target, state, "")]
    if not isinstance(state, Mapping):
        raise StateMismatchError(
            f"snapshot {entry.path} holds a {type(state).__name__}, the target is a dict; "
            "nothing was loaded or deleted. Next: pass the target it was saved from, or point "
            "out_dir elsewhere to start fresh")
    missing = [k for k in target if k not in state]
    if missing:
        raise StateMismatchError(
            f"snapshot {entry.path} lacks target key(s) {missing[:10]}; nothing was loaded or "
            f"deleted. Next: leave {missing[:10]} out of the target (snapshot_object of the "
            "saved keys), or point out_dir elsewhere to start fresh")
    return [(target[k], state[k], f"[{k!r}]") for k in target]


def fit_problems(obj: Any, state: Any, where: str = "") -> list[str]:
    """What keeps ``state`` from loading into ``obj`` (empty when it fits)."""
    prefix = f"{where}/" if where else ""
    if isinstance(obj, torch.nn.Module):
        return [prefix + p for p in find_mismatches(obj.state_dict(), state)]
    if isinstance(obj, torch.optim.Optimizer):
        return [prefix + p for p in optimizer_problems(obj, state)]
    if _is_manager(obj):
        return manager_problems(obj, state, where)
    return []


def _is_manager(obj: Any) -> bool:
    return isinstance(getattr(obj, "models", None), Mapping) \
        and isinstance(getattr(obj, "_optimizers", None), Mapping)


def manager_problems(manager: Any, state: Any, where: str = "") -> list[str]:
    """Fit of a manager snapshot (see the module docstring)."""
    if not isinstance(state, Mapping):
        return [f"{where or 'snapshot'} holds a {type(state).__name__}, not a manager snapshot"]
    missing = [k for k in MANAGER_KEYS if k not in state]
    if missing:
        keys = sorted(map(str, state))[:8]
        return [f"{where or 'snapshot'} is not a manager snapshot: no {missing} (top-level keys "
                f"{keys}{'...' if len(state) > 8 else ''}; a plain model state_dict?)"]
    problems: list[str] = []
    sections: list[tuple[str, Mapping[str, Any]]] = [
        ("models", manager.models), ("optimizers", manager.optimizers)]
    if "state_objects" in state:
        sections.append(("state_objects", getattr(manager, "_state_objects", {}) or {}))
    for section, objects in sections:
        saved = state[section]
        if not isinstance(saved, Mapping):
            problems.append(f"{where}{section} is a {type(saved).__name__}, not a dict")
            continue
        for name, obj in objects.items():
            here = f"{where}{section}[{name!r}]"
            if name not in saved:
                problems.append(f"missing {here} (snapshot has {sorted(map(str, saved))[:10]})")
                continue
            problems += fit_problems(obj, saved[name], here)
    return problems + extension_problems(manager, state, where)


def extension_problems(manager: Any, state: Mapping[str, Any], where: str = "") -> list[str]:
    """What keeps the saved ``extensions`` part of a manager snapshot from loading into the
    manager's extensions that can tell (a ``continuation_problems(state)`` method: snapkeep's
    snapshot extension, whose data loaders' saved positions must fit them); changes nothing."""
    problems: list[str] = []
    saved_extensions = state.get("extensions")
    for name, entry in (getattr(manager, "_extensions", None) or {}).items():
        check = getattr(getattr(entry, "extension", None), "continuation_problems", None)
        saved = saved_extensions.get(name) if isinstance(saved_extensions, Mapping) else None
        if callable(check) and isinstance(saved, Mapping):
            problems += [f"{where}extensions[{name!r}]: {p}"
                         for p in check(saved.get("extension"))]
    return problems


def optimizer_problems(optimizer: torch.optim.Optimizer, saved: Any) -> list[str]:
    """Param groups (count, sizes) and per-parameter state (owner, tensor shapes)."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), Mapping):
        return ["not an optimizer state_dict (no 'param_groups' list and 'state' dict)"]
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        return [f"{len(saved_groups)} param group(s) in the snapshot, {len(groups)} in the "
                "optimizer"]
    problems = []
    ids: dict[Any, torch.Tensor] = {}
    for i, (group, saved_group) in enumerate(zip(groups, saved_groups, strict=True)):
        saved_params = saved_group.get("params") if isinstance(saved_group, Mapping) else None
        if not isinstance(saved_params, list):
            problems.append(f"param_groups[{i}] has no 'params' list")
            continue
        if len(saved_params) != len(group["params"]):
            problems.append(f"param_groups[{i}]: {len(saved_params)} parameter(s) in the "
                            f"snapshot, {len(group['params'])} in the optimizer")
            continue
        ids.update(zip(saved_params, group["params"], strict=True))
    if problems:
        return problems
    for key, param_state in saved["state"].items():
        param = ids.get(key)
        if param is None:
            problems.append(f"state[{key!r}] belongs to no parameter of the snapshot's groups")
            continue
        if not isinstance(param_state, Mapping):
            continue
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and tuple(value.shape) != tuple(param.shape):
                problems.append(f"state[{key!r}][{name!r}] has shape {tuple(value.shape)}, its "
                                f"parameter {tuple(param.shape)}")
    return problems


def require_fit(pairs: Iterable[tuple[Any, Any, str]], entry: Entry) -> None:
    """Raise :class:`StateMismatchError` (naming ``entry`` and the mismatches) unless every
    ``(object, state, where)`` fits."""
    problems: list[str] = []
    for obj, state, where in pairs:
        problems += fit_problems(obj, state, where)
    if problems:
        raise StateMismatchError(
            f"snapshot {entry.path} (step {entry.step}) does not match the target: "
            f"{describe(problems)}. Nothing was loaded or deleted; point out_dir elsewhere or "
            f"fix the model definition ('snapkeep inspect {entry.path}' shows what it holds).")
