"""Model state keys without wrapper prefixes: a snapshot taken in one wrapping resumes in any
other.

``torch.compile`` inserts ``_orig_mod.`` into every key of a model's ``state_dict``,
``DistributedDataParallel``/``DataParallel`` insert ``module.`` (``_orig_mod.module.`` or
``module._orig_mod.`` for both); loading one into another fails on every key (nanoGPT#325,
pytorch#101107). As DCP's ``get_state_dict`` does, snapshots store the canonical keys (those of
the unwrapped model) and autoload maps them to the live model's keys:

- :func:`canonical_tree` (at save): for a module target, each module of a dict target, and each
  of a manager's ``models``, keys (and ``_metadata`` module paths) lose the wrapper atoms, found
  by walking the live module tree (a user submodule named ``module`` is kept);
- :func:`live_tree` (at load): each saved key goes to the live key with the same canonical key;
  a key saved with wrapper prefixes (snapshots written before) is mapped after stripping its
  leading ``module.``/``_orig_mod.`` atoms and every other ``_orig_mod.`` atom. Keys nothing
  matches are left for the fit check to report.
- :func:`canonical_names` (``snapkeep inspect``/``diff``, no model at hand): the same stripping
  for a state dict whose every key carries wrapper atoms.

Optimizer state is keyed by parameter index; wrappers keep the order of ``parameters()``, so it
needs no mapping. Sharded snapshots get canonical keys from DCP's ``get_state_dict`` itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

_WRAPPED_ATTR = "_orig_mod"  # torch._dynamo.eval_frame.OptimizedModule's wrapped module


def _wrapped_child(module: torch.nn.Module) -> str | None:
    """The attribute under which ``module`` (a wrapper) holds the wrapped model, else None."""
    if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return "module"
    if type(module).__name__ == "OptimizedModule" and _WRAPPED_ATTR in module._modules:
        return _WRAPPED_ATTR
    return None


def canonical_key(module: torch.nn.Module, key: str) -> str:
    """``key`` (a state_dict key or module path of ``module``) without its wrapper atoms."""
    obj: torch.nn.Module | None = module
    out = []
    for atom in key.split(".") if key else []:
        if obj is not None and _wrapped_child(obj) == atom:
            obj = obj._modules.get(atom)
            continue
        out.append(atom)
        obj = obj._modules.get(atom) if obj is not None else None
    return ".".join(out)


def _remap(state: Mapping[str, Any], mapping: dict[str, str]) -> Any:
    """``state`` with keys renamed by ``mapping`` (``state`` itself when nothing changes);
    ``_metadata`` module paths renamed too (a deeper path wins: the model over its wrapper)."""
    if all(mapping.get(k, k) == k for k in state):
        return state
    out: OrderedDict[str, Any] = OrderedDict((mapping.get(k, k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if isinstance(metadata, Mapping):
        renamed: OrderedDict[str, Any] = OrderedDict()
        for path, value in metadata.items():
            renamed[mapping.get(path + ".", path + ".")[:-1] if path else ""] = value
        out._metadata = renamed  # type: ignore[attr-defined]
    return out


def _has_wrappers(module: torch.nn.Module) -> bool:
    return any(_wrapped_child(m) is not None for m in module.modules())


def canonical_state(module: torch.nn.Module, state: Any) -> Any:
    """``module.state_dict()`` output with canonical keys (see the module docstring)."""
    if not isinstance(state, Mapping) or not _has_wrappers(module):
        return state
    paths = [name for name, _ in module.named_modules()]
    mapping = {k: canonical_key(module, k) for k in state}
    mapping.update({p + ".": canonical_key(module, p) + "." for p in paths if p})
    return _remap(state, mapping)


def _strip(key: str) -> str:
    atoms = key.split(".")
    while atoms and atoms[0] in ("module", _WRAPPED_ATTR):  # DDP and compile, either order
        atoms.pop(0)
    return ".".join(a for a in atoms if a != _WRAPPED_ATTR)


def live_state(module: torch.nn.Module, state: Any) -> Any:
    """A saved model state with its keys mapped to ``module``'s own (see the module
    docstring)."""
    if not isinstance(state, Mapping):
        return state
    live = list(module.state_dict().keys())
    live_set = set(live)
    to_live = {canonical_key(module, k): k for k in live}
    mapping: dict[str, str] = {}
    for key in state:
        if key in live_set and key not in to_live:
            continue
        target = to_live.get(key) or to_live.get(_strip(key))
        if target is not None:
            mapping[key] = target
    paths = {canonical_key(module, p): p for p, _ in module.named_modules() if p}
    mapping.update({p + ".": paths[_strip(p)] + "." for p in
                    (getattr(state, "_metadata", None) or {}) if p and _strip(p) in paths})
    return _remap(state, mapping)


def _models_of(target: Any) -> Mapping[str, Any] | None:
    models = getattr(target, "models", None)
    return models if isinstance(models, Mapping) and hasattr(target, "_optimizers") else None


def _map_tree(target: Any, state: Any, one: Any) -> Any:
    if isinstance(target, torch.nn.Module):
        return one(target, state)
    if not isinstance(state, Mapping):
        return state
    if type(target) is dict:
        changed = {k: _map_tree(target[k], v, one) if k in target else v
                   for k, v in state.items()}
        return changed if any(changed[k] is not state[k] for k in state) else state
    models = _models_of(target)
    saved = state.get("models")
    if models is None or not isinstance(saved, Mapping):
        return state
    mapped = {k: one(models[k], v) if isinstance(models.get(k), torch.nn.Module) else v
              for k, v in saved.items()}
    if all(mapped[k] is saved[k] for k in saved):
        return state
    return {**state, "models": mapped}


def canonical_tree(target: Any, state: Any) -> Any:
    """The state of a snapshot target (a module, a dict of objects, a manager) with every
    model's keys canonical; ``state`` itself when there are no wrappers."""
    return _map_tree(target, state, canonical_state)


def live_tree(target: Any, state: Any) -> Any:
    """A loaded snapshot state with every model's keys mapped to the live target's."""
    return _map_tree(target, state, live_state)


def _strip_flat(state: Mapping[Any, Any]) -> Any:
    keys = list(state)
    if not keys or not all(isinstance(k, str) and (
            k.startswith("module.") or _WRAPPED_ATTR in k.split(".")) for k in keys):
        return state
    stripped = [_strip(k) for k in keys]
    if len(set(stripped)) != len(stripped) or "" in stripped:
        return state
    return dict(zip(stripped, state.values(), strict=True))


def canonical_names(state: Any) -> Any:
    """For showing a snapshot without its model (``snapkeep inspect``/``diff``): a state dict
    whose every key carries wrapper atoms (a snapshot written before keys were canonical, or
    by another tool), at the top level or as one of a manager snapshot's ``models``, with
    leading ``module.`` atoms and every ``_orig_mod.`` atom removed. Anything else unchanged."""
    if not isinstance(state, Mapping):
        return state
    top = _strip_flat(state)
    if top is not state:
        return top
    models = state.get("models")
    if not isinstance(models, Mapping):
        return state
    mapped = {k: _strip_flat(v) if isinstance(v, Mapping) else v for k, v in models.items()}
    if all(mapped[k] is models[k] for k in models):
        return state
    return {**state, "models": mapped}


def dtensor_models(target: Any) -> list[str]:
    """Where the models of a snapshot target (a module, a dict of objects, a manager) hold
    ``DTensor`` parameters (FSDP2 ``fully_shard``): ``'target'``, ``"target['k']"`` or
    ``"models['name']"``."""
    if isinstance(target, torch.nn.Module):
        parts: list[tuple[str, Any]] = [("target", target)]
    elif type(target) is dict:
        parts = [(f"target[{k!r}]", v) for k, v in target.items()]
    else:
        models = _models_of(target) or {}
        parts = [(f"models[{k!r}]", v) for k, v in models.items()]
    return [where for where, obj in parts if isinstance(obj, torch.nn.Module)
            and any(type(p).__name__ == "DTensor" for p in obj.parameters())]
