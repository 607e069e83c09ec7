"""Safe loading of snapshot files.

Loading uses ``torch.load(weights_only=True)`` (tensors, containers and primitive types only)
plus :data:`SAFE_GLOBALS`; arbitrary unpickling, which can run code, happens only when the caller
passes ``weights_only=False`` by name. Files in the safetensors format (detected from their first
bytes, see :mod:`snapkeep._core.codec`) are decoded by safetensors, which never runs code.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch

from snapkeep._core.codec import HEADER_PROBE_BYTES, is_safetensors_header, load_safetensors
from snapkeep._core.errors import UnsafeSnapshotError
from snapkeep._core.storage import Storage

#: Extra types snapkeep's own snapshots may contain, allowed under ``weights_only=True``.
SAFE_GLOBALS: list[Any] = []


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
        UnsafeSnapshotError: the file needs arbitrary unpickling and ``weights_only`` is True;
            nothing in the file was executed.
        RuntimeError, EOFError, pickle.UnpicklingError, ValueError: the file is not a readable
            torch or safetensors file.
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
                return load_safetensors(head + f.read(), map_location=map_location)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            source: Any = path if data is None else io.BytesIO(data)
            return torch.load(source, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        if weights_only and "weights only" in str(e).lower():
            raise UnsafeSnapshotError(
                f"{path} contains objects that only arbitrary unpickling can load, which can run "
                f"code{_refusal_reason(e)}; loading refused and nothing in it was executed. If "
                "you trust this file, pass weights_only=False."
            ) from e
        raise
