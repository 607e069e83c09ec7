"""Safe loading of snapshot files.

Loading uses ``torch.load(weights_only=True)`` (tensors, containers and primitive types only)
plus :data:`SAFE_GLOBALS`; arbitrary unpickling, which can run code, happens only when the caller
passes ``weights_only=False`` by name. Files in the safetensors format (detected from their first
bytes, see :mod:`snapkeep._core.format.codec`) are decoded by safetensors, which never runs code.

Local files are memory-mapped (``torch.load(mmap=True)``, safetensors' own mapping): the loaded
tensors are copy-on-write views of the file's page-cache pages, so resuming holds no second copy
of the state and reads it at disk speed. Callers verify the file's checksum first
(:meth:`snapkeep._core.store.files.SnapshotStore.verify` hashes it through a memory map as well).
Autoload instead verifies while it reads, in one pass (:mod:`snapkeep._core.load.one_pass`), and
uses this module for the files that path does not take.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import pickle
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from snapkeep._core.errors import SnapshotCorruptError, UnsafeSnapshotError
from snapkeep._core.format.codec import (
    HEADER_PROBE_BYTES,
    is_safetensors_header,
    load_safetensors,
    load_safetensors_file,
)
from snapkeep._core.storage import Storage
from snapkeep._core.tiers.incremental import (
    PICKLE_MODULE,
    area_of,
    is_skeleton,
    materialise,
    skeleton_digests,
)
from snapkeep._core.tiers.incremental import SAFE_GLOBALS as INCREMENTAL_GLOBALS

logger = logging.getLogger(__name__)

#: Extra types snapkeep's own snapshots may contain, allowed under ``weights_only=True``: the
#: skeleton of an incremental snapshot (:mod:`snapkeep._core.tiers.incremental`).
SAFE_GLOBALS: list[Any] = [*INCREMENTAL_GLOBALS]


def is_refused_global(error: pickle.UnpicklingError) -> bool:
    """Whether torch's weights-only refusal is of a well-formed pickle naming a global outside
    the allow-list (unsafe), rather than of bytes that are no pickle at all (corrupt)."""
    return "unsupported global" in str(error).lower()


def _refusal_reason(error: pickle.UnpicklingError) -> str:
    """What torch refused, e.g. ``'posix.mkdir'`` (the rest of its message is boilerplate)."""
    match = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f"; it calls {match.group(1)}" if match else ""


def load_file(
    storage: Storage, path: str, *, map_location: Any = "cpu", weights_only: bool = True,
    data: bytes | None = None,
) -> Any:
    """Load one snapshot file (``torch.save`` or safetensors format).

    Args:
        storage: where it lives.
        path: its path on ``storage``.
        map_location: as ``torch.load``'s (default ``'cpu'``).
        weights_only: ``True`` (default) refuses arbitrary pickled objects.
        data: the file's bytes when already fetched (then ``storage`` is not read again).

    Raises:
        UnsafeSnapshotError: the file is a well-formed pickle that needs objects outside the
            allow-list and ``weights_only`` is True; nothing in the file was executed.
        SnapshotCorruptError: the file is not a well-formed snapshot (junk, an XML error body,
            a pickle torch cannot decode).
        RuntimeError, EOFError, ValueError, IndexError: other decode failures of a damaged
            torch or safetensors file (callers treat them as corrupt).
    """
    if data is None and not storage.is_local:
        data = storage.read_bytes(path)  # one download, decoded from memory
    if data is not None:
        if is_safetensors_header(data[:HEADER_PROBE_BYTES]):
            return load_safetensors(data, map_location=map_location)
    else:
        with storage.open_read(path) as f:
            head = f.read(HEADER_PROBE_BYTES)
        if is_safetensors_header(head):
            return load_safetensors_file(path, map_location=map_location)
    state = _load_torch(path, map_location=map_location, weights_only=weights_only, data=data)
    if is_skeleton(state):  # an incremental snapshot: its blobs, each verified
        return materialise(state, area_of(storage, path, state), map_location=map_location)
    return state


def skeleton_blobs(storage: Storage, path: str) -> set[str]:
    """The blobs the file at ``path`` refers to when it is an incremental snapshot (its
    skeleton only is read, safely); empty for any other file, or one that does not decode."""
    try:
        data = None if storage.is_local else storage.read_bytes(path)
        state = _load_torch(path, map_location="cpu", weights_only=True, data=data)
    except (OSError, pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
        logger.debug("%s: no blob references read (%s)", path, e)
        return set()
    digests = skeleton_digests(state)
    return set(digests) if digests else set()


def _load_torch(path: str, *, map_location: Any, weights_only: bool,
                data: bytes | None) -> Any:
    """``torch.load`` of a snapshot file (``data``: its bytes, else mapped from ``path``)."""
    extra: dict[str, Any] = {} if weights_only else {"pickle_module": PICKLE_MODULE}
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            if data is not None:
                return torch.load(io.BytesIO(data), map_location=map_location,
                                  weights_only=weights_only, **extra)
            return _load_mapped(path, map_location=map_location, weights_only=weights_only,
                                **extra)
    except pickle.UnpicklingError as e:
        if weights_only and "weights only" in str(e).lower():
            if not is_refused_global(e):  # junk that happens to start like a pickle
                raise SnapshotCorruptError(
                    f"{path} is not a well-formed snapshot (corrupt: torch cannot decode it)"
                ) from e
            raise UnsafeSnapshotError(
                f"{path} is unsafe, not corrupt: a well-formed snapshot with objects that only "
                f"arbitrary unpickling can load, which can run code{_refusal_reason(e)}; loading "
                "refused and nothing in it was executed. If you trust this file, pass "
                "weights_only=False."
            ) from e
        raise SnapshotCorruptError(
            f"{path} is not a well-formed snapshot (corrupt: {e})") from e


#: Leaf types every ``weights_only`` load accepts: not pickled to check them.
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype,
                 torch.device, torch.Size)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple)


def _children(node: Any) -> list[tuple[Any, Any]]:
    if type(node) in (dict, collections.OrderedDict):
        return list(node.items())
    if type(node) in (list, tuple):
        return list(enumerate(node))
    return []


def _suspects(tree: Any, path: tuple[str, ...], out: list[tuple[tuple[str, ...], Any]]) -> None:
    """Key paths and values of ``tree``'s leaves of other than plain types, and of containers
    of other than plain types (a dict subclass), in order."""
    if type(tree) in _PLAIN_LEAVES or isinstance(tree, torch.Tensor):
        return  # (exact types: an IntEnum or a str subclass pickles as its class)
    if type(tree) not in _CONTAINERS:
        out.append((path, tree))
        return
    for key, value in _children(tree):
        if type(tree) in (dict, collections.OrderedDict) and type(key) not in _PLAIN_LEAVES:
            out.append((path + (str(key),), key))
        _suspects(value, path + (str(key),), out)


def _loads_safely(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception:  # not even picklable (a local class, a lock): it cannot be saved either
        return False
    buffer.seek(0)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError:
        return False
    return True


def unloadable_value(tree: Any) -> str | None:
    """Where ``tree`` holds a value that :func:`load_file` with ``weights_only=True`` (the
    default of every door's load) would refuse, as a key path (``"cfg"``, ``"extra/0"``); None
    when all of it loads. Checked before a snapshot is written, so that a run never saves
    snapshots it cannot resume from. Tensors, numbers, strings, bytes, dtypes, devices and
    sizes in plain dicts, lists and tuples are accepted without pickling; each other value is
    tried alone through ``torch.save`` and a ``weights_only`` load (snapkeep's allow-list
    included)."""
    suspects: list[tuple[tuple[str, ...], Any]] = []
    _suspects(tree, (), suspects)
    for path, value in suspects:
        if not _loads_safely(value):
            return "/".join(path) or "<root>"
    return None


def _load_mapped(path: str, *, map_location: Any, weights_only: bool, **extra: Any) -> Any:
    """``torch.load(path, mmap=True)``: tensors are copy-on-write views of the mapped file, so
    ``load_state_dict`` copies each one straight from the page cache into the existing parameter
    (and an optimizer adopts its state tensors without a copy); no second full copy of the state
    is ever held. Files in torch's legacy (pre-zip) format cannot be mapped and load as before."""
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True,
                          **extra)
    except RuntimeError as e:
        if "mmap can only be used" not in str(e):
            raise
    logger.debug("%s is in torch's legacy format; loading it without mmap", path)
    return torch.load(path, map_location=map_location, weights_only=weights_only, **extra)


def optimizers_in(target: Any) -> list[torch.optim.Optimizer]:
    """The optimizers a snapshot target restores: the target itself, the values of a dict
    target, or a manager's ``optimizers`` mapping (as ppe's ``ExtensionsManager``)."""
    if isinstance(target, torch.optim.Optimizer):
        return [target]
    if type(target) is dict:
        return [o for v in target.values() for o in optimizers_in(v)]
    optimizers = getattr(target, "optimizers", None)
    if isinstance(optimizers, Mapping):
        return [o for o in optimizers.values() if isinstance(o, torch.optim.Optimizer)]
    return []


@contextlib.contextmanager
def into_existing_state(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[None]:
    """Around ``load_state_dict``: optimizer state tensors that existed before (a resumed
    trainer that already stepped, or a second load) receive the loaded values in place
    (``copy_``) where shape, dtype, device and layout match, instead of being replaced by new
    tensors; the loaded tensors (views of the mapped file) are then dropped. Parameters need
    nothing: ``Module.load_state_dict`` always copies in place. State that did not exist before
    is adopted as loaded (torch's ``Optimizer.load_state_dict``: no copy on the same device and
    dtype)."""
    before = [(opt, {p: dict(state) for p, state in opt.state.items()}) for opt in optimizers]
    yield
    with torch.no_grad():
        for opt, old_states in before:
            for param, state in opt.state.items():
                old = old_states.get(param)
                if not old:
                    continue
                for key, value in state.items():
                    prev = old.get(key)
                    if isinstance(prev, torch.Tensor) and prev is not value \
                            and _same_layout(prev, value):
                        prev.copy_(value)
                        state[key] = prev


def _same_layout(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.layout == b.layout == torch.strided and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and a.is_contiguous()
            and b.is_contiguous())
