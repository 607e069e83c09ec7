"""What the ProcessWriter worker can receive: checked in the trainer, before a snapshot is accepted.

The worker is a ``spawn`` child that never imports the training script, so a class or function
of ``__main__``, a lambda or a local definition would pickle in the trainer and fail to unpickle
in the worker. :func:`check_sendable` finds the first such leaf (tensors excepted: they travel
through shared memory, see :mod:`.shm`) and names its key path.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from typing import Any

#: The end of every message about something the worker cannot receive (also sent back by the
#: worker for a message it could not unpickle, see :mod:`.worker`).
WORKER_HINT = ("the ProcessWriter worker never imports the training script (__main__) and "
                "cannot receive lambdas, local classes or OS handles; define the class at module "
                "level in an importable module, or use ThreadWriter")


class _Unsendable(Exception):
    pass


class _WorkerPickler(pickle.Pickler):
    """Pickles like the pipe does, skipping tensors (they travel through shared memory), and
    refuses what would pickle here but not unpickle in the worker: classes and functions of
    ``__main__`` or local to a function."""

    def persistent_id(self, obj: Any) -> Any:
        return "tensor" if _is_tensor(obj) else None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            module = getattr(obj, "__module__", None)
            qualname = getattr(obj, "__qualname__", "")
            if module == "__main__":
                raise _Unsendable(f"{qualname} is defined in __main__ (the training script)")
            if "<locals>" in qualname or "<lambda>" in qualname:
                raise _Unsendable(f"{module}.{qualname} is a lambda or local definition")
        return NotImplemented


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _dumps_for_worker(obj: Any) -> None:
    buffer = io.BytesIO()
    _WorkerPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)


def _first_unsendable(node: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], str] | None:
    """The key path of the first leaf the worker cannot receive and why."""
    try:
        _dumps_for_worker(node)
        return None
    except RecursionError:
        return path, "it is nested too deeply to pickle"
    except Exception as e:
        reason = f"{type(e).__name__}: {e}" if not isinstance(e, _Unsendable) else str(e)
    if isinstance(node, dict):
        for key, value in node.items():
            found = _first_unsendable(key, (*path, f"<key {key!r}>")) or \
                _first_unsendable(value, (*path, key))
            if found is not None:
                return found
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            found = _first_unsendable(value, (*path, i))
            if found is not None:
                return found
    return path, reason


_PLAIN_LEAVES = (int, float, complex, str, bytes, bool, type(None))


def _plainly_sendable(tree: Any) -> bool:
    """Fast path: only plain containers, tensors and builtin scalars (a state_dict, an optimizer
    state): nothing the worker could fail to import."""
    import collections

    import torch

    leaves = (*_PLAIN_LEAVES, torch.dtype, torch.device)
    tensor = torch.Tensor
    stack = [tree]
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > 10_000_000:
            return False
        kind = type(node)
        if kind in leaves or isinstance(node, tensor):
            continue
        if kind is dict or kind is collections.OrderedDict:
            extra = getattr(node, "__dict__", None)
            if extra:
                stack.append(dict(extra))
            for key in node:
                if type(key) not in _PLAIN_LEAVES:
                    return False
            stack.extend(node.values())
        elif kind is list or kind is tuple or kind is torch.Size:
            stack.extend(node)
        else:
            return False
    return True


def check_sendable(tree: Any, *, what: str = "the state") -> None:
    """Check, in the trainer, that the worker process can receive ``tree`` (tensors excepted:
    they are staged into shared memory).

    Raises:
        TypeError: naming the key path of the first leaf that cannot be sent, why, and what to do
            (a module-level class, or ThreadWriter).
    """
    if _plainly_sendable(tree):
        return
    found = _first_unsendable(tree, ())
    if found is None:
        return
    path, reason = found
    where = "/".join(map(str, path)) or "<root>"
    raise TypeError(f"{what} at {where} cannot be sent to the ProcessWriter worker ({reason}); "
                    f"{WORKER_HINT}")
