"""State trees for the CLI: an iterative walk (no recursion, so a hostile file nested a million
levels deep cannot raise RecursionError), tensor statistics and the comparison behind
``snapkeep diff``.

A *path* is the tuple of keys from the root to a leaf (dict keys as ``str``, list/tuple indices as
``int``); rendered with ``/`` between parts (``models/main/0.weight``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

#: Containers nested deeper than this are refused (a real training state is < 10 levels deep).
MAX_DEPTH = 1000
#: Characters of a non-tensor value's repr shown by ``diff``.
REPR_CHARS = 120


class TreeTooDeepError(ValueError):
    """The state nests containers deeper than :data:`MAX_DEPTH` levels."""


def render(path: tuple[Any, ...]) -> str:
    """``('models', 'main', '0.weight')`` -> ``'models/main/0.weight'``; ``()`` -> ``'<root>'``."""
    return "/".join(str(p) for p in path) if path else "<root>"


def leaves(tree: Any, *, max_depth: int = MAX_DEPTH) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` of every non-container value under ``tree``, depth first, in key order.

    dicts, lists and tuples are containers; everything else (tensors, numbers, strings, None) is a
    leaf. A container met a second time (shared or cyclic) is not walked again.

    Raises:
        TreeTooDeepError: containers nest deeper than ``max_depth``.
    """
    seen: set[int] = set()
    stack: list[tuple[tuple[Any, ...], Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            children = [((*path, str(k)), v) for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            children = [((*path, i), v) for i, v in enumerate(node)]
        else:
            yield path, node
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if len(path) >= max_depth:
            raise TreeTooDeepError(
                f"the state nests containers deeper than {max_depth} levels (under "
                f"{render(path[:5])}/...); not a training snapshot")
        stack.extend(reversed(children))


def select(state: Any, key: str) -> Any:
    """The sub-tree of ``state`` at ``key`` (``'models/main'``; list indices as numbers).

    Raises:
        KeyError: a part of ``key`` is not there; the message lists the keys at that level.
    """
    node = state
    walked: list[str] = []
    for part in [p for p in key.split("/") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            where = "/".join(walked) or "<root>"
            if isinstance(node, dict):
                available = ", ".join(repr(str(k)) for k in list(node)[:20])
            elif isinstance(node, (list, tuple)):
                available = f"indices 0..{len(node) - 1}"
            else:
                available = f"nothing: it is a {type(node).__name__}"
            raise KeyError(f"{part!r} is not under {where} (there: {available})")
        walked.append(part)
    return node


def tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


@dataclasses.dataclass
class KeyStats:
    """Tensors and bytes under one top-level key."""

    key: str
    tensors: int = 0
    bytes: int = 0


def stats_by_key(state: Any) -> list[KeyStats]:
    """Tensor count and bytes per top-level key (``'<root>'`` for a non-dict state)."""
    if isinstance(state, dict):
        out = [KeyStats(str(k)) for k in state]
        index = {s.key: s for s in out}
    else:
        out = [KeyStats("<root>")]
        index = {}
    for path, leaf in leaves(state):
        if not isinstance(leaf, torch.Tensor):
            continue
        row = index.get(str(path[0])) if path and index else out[0]
        if row is None:
            continue
        row.tensors += 1
        row.bytes += tensor_bytes(leaf)
    return out


# -- diff ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Difference:
    """The comparison of two states (see :func:`compare`). ``as_json`` is the ``diff`` JSON
    body's ``only_in_a``/``only_in_b``/``tensors``/``values`` part."""

    only_in_a: list[str] = dataclasses.field(default_factory=list)
    only_in_b: list[str] = dataclasses.field(default_factory=list)
    tensors: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    values: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.values
                    or any(not t["equal"] for t in self.tensors))

    def as_json(self) -> dict[str, Any]:
        return {"only_in_a": self.only_in_a, "only_in_b": self.only_in_b,
                "tensors": self.tensors, "values": self.values}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= REPR_CHARS else text[:REPR_CHARS - 3] + "..."


def max_abs_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """``(max |a - b|, positions where exactly one side is NaN)`` of same-shape tensors,
    computed in float64 (complex128 for complex); NaN in both at one position counts as equal."""
    if a.numel() == 0:
        return 0.0, 0
    wide = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
    x, y = a.detach().cpu().to(wide), b.detach().cpu().to(wide)
    nan_x, nan_y = x.isnan(), y.isnan()
    one_nan = int((nan_x ^ nan_y).sum())
    diff = (x - y).abs()
    diff = torch.where(nan_x | nan_y, torch.zeros((), dtype=diff.dtype), diff)
    value = float(diff.max())
    return (value if math.isfinite(value) else float("inf")), one_nan


def _tensor_row(key: str, a: torch.Tensor, b: torch.Tensor, atol: float) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": key,
        "a": {"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch.")},
        "b": {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")},
        "max_abs_diff": None, "nan_mismatches": 0,
    }
    if a.shape != b.shape:
        row["equal"] = False
        return row
    value, one_nan = max_abs_difference(a, b)
    row["max_abs_diff"] = value if math.isfinite(value) else None
    row["nan_mismatches"] = one_nan
    row["equal"] = a.dtype == b.dtype and one_nan == 0 and math.isfinite(value) and value <= atol
    return row


def compare(a: Any, b: Any, *, atol: float = 0.0) -> Difference:
    """Compare two states leaf by leaf.

    Tensors are compared by shape, dtype and the maximum absolute difference of their values
    (equal when dtypes and shapes match and it is ``<= atol``); other leaves by ``==``.

    Raises:
        TreeTooDeepError: either state nests deeper than :data:`MAX_DEPTH`.
    """
    left = {render(p): v for p, v in leaves(a)}
    right = {render(p): v for p, v in leaves(b)}
    out = Difference(only_in_a=[k for k in left if k not in right],
                     only_in_b=[k for k in right if k not in left])
    for key, x in left.items():
        if key not in right:
            continue
        y = right[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            out.tensors.append(_tensor_row(key, x, y, atol))
            continue
        same = type(x) is type(y) and not isinstance(x, torch.Tensor)
        if same:
            try:
                same = bool(x == y) or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
            except (TypeError, ValueError, RuntimeError):
                same = False
        if not same:
            out.values.append({"key": key, "a": _short(x), "b": _short(y)})
    out.values = _grouped(out.values, left)
    return out


#: Differing elements of one list or tuple (an RNG state's 625 ints) shown as one row from here.
GROUP_MIN = 8


def _grouped(values: list[dict[str, Any]], left: dict[str, Any]) -> list[dict[str, Any]]:
    """``values`` with the differing elements of one list or tuple, when there are at least
    :data:`GROUP_MIN`, replaced by one row for the container (how many differ, and the first),
    so that two RNG states do not print a line per element."""
    def parent_of(key: str) -> str | None:
        parent, _, last = key.rpartition("/")
        return parent if parent and last.isdigit() else None

    counts: dict[str, int] = {}
    for row in values:
        parent = parent_of(row["key"])
        if parent is not None:
            counts[parent] = counts.get(parent, 0) + 1
    out: list[dict[str, Any]] = []
    shown: set[str] = set()
    for row in values:
        parent = parent_of(row["key"])
        if parent is None or counts[parent] < GROUP_MIN:
            out.append(row)
            continue
        if parent in shown:
            continue
        shown.add(parent)
        total = sum(1 for k in left if parent_of(k) == parent)
        index = row["key"].rpartition("/")[2]
        out.append({"key": parent, "a": f"[{index}] {row['a']}",
                    "b": f"[{index}] {row['b']} ({counts[parent]} of {total} elements differ)"})
    return out
