"""Compare a loaded state tree with the target's before loading it."""

from __future__ import annotations

from typing import Any

import torch

MAX_LISTED = 10


def _flatten(tree: Any, prefix: str, out: dict[str, Any], parents: dict[str, Any]) -> None:
    if isinstance(tree, dict):
        parents[prefix] = tree
        for key, value in tree.items():
            _flatten(value, f"{prefix}/{key}" if prefix else str(key), out, parents)
    elif isinstance(tree, torch.Tensor):
        out[prefix] = tree


def find_mismatches(expected: Any, loaded: Any) -> list[str]:
    """Differences between the tensors of ``expected`` (the target's current state_dict) and
    ``loaded``: tensors missing from ``loaded``, shape differences, and unexpected tensors in a
    dict that already holds tensors in ``expected`` (a module's state_dict). Containers that are
    empty in ``expected`` (e.g. optimizer state before the first step) accept anything.
    """
    exp: dict[str, Any] = {}
    got: dict[str, Any] = {}
    exp_parents: dict[str, Any] = {}
    got_parents: dict[str, Any] = {}
    _flatten(expected, "", exp, exp_parents)
    _flatten(loaded, "", got, got_parents)
    problems: list[str] = []
    for path, tensor in exp.items():
        other = got.get(path)
        if other is None:
            parent = path.rpartition("/")[0]
            if parent in got_parents or parent == "":
                problems.append(f"missing {path} (expected shape {tuple(tensor.shape)})")
            else:
                problems.append(f"missing {path}")
        elif tuple(other.shape) != tuple(tensor.shape):
            problems.append(
                f"shape of {path}: snapshot {tuple(other.shape)}, target {tuple(tensor.shape)}")
    for path in got:
        if path in exp:
            continue
        parent = path.rpartition("/")[0]
        siblings = exp_parents.get(parent)
        if isinstance(siblings, dict) \
                and any(isinstance(v, torch.Tensor) for v in siblings.values()):
            problems.append(f"unexpected {path} in the snapshot")
    return problems


def describe(problems: list[str]) -> str:
    head = "; ".join(problems[:MAX_LISTED])
    more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
    return f"{len(problems)} mismatch(es): {head}{more}"
