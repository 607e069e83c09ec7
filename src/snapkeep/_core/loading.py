"""Safe loading of snapshot files.

Loading uses ``torch.load(weights_only=True)`` (tensors, containers and primitive types only)
plus :data:`SAFE_GLOBALS`; arbitrary unpickling, which can run code, happens only when the caller
passes ``weights_only=False`` by name.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from snapkeep._core.errors import UnsafeSnapshotError
from snapkeep._core.storage import Storage

#: Extra types snapkeep's own snapshots may contain, allowed under ``weights_only=True``.
SAFE_GLOBALS: list[Any] = []


def load_file(
    storage: Storage, path: str, *, map_location: Any = "cpu", weights_only: bool = True,
) -> Any:
    """Load one snapshot file.

    Args:
        storage: where it lives.
        path: its path on ``storage``.
        map_location: as ``torch.load``'s (default ``'cpu'``).
        weights_only: ``True`` (default) refuses arbitrary pickled objects.

    Raises:
        UnsafeSnapshotError: the file needs arbitrary unpickling and ``weights_only`` is True.
        RuntimeError, EOFError, pickle.UnpicklingError: the file is not a readable torch file.
    """
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            if storage.is_local:
                return torch.load(path, map_location=map_location, weights_only=weights_only)
            with storage.open_read(path) as f:
                return torch.load(f, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        if weights_only and "weights only" in str(e).lower():
            raise UnsafeSnapshotError(
                f"{path} contains objects that only arbitrary unpickling can load, which can run "
                "code; loading refused. If you trust this file, pass weights_only=False. "
                f"(torch: {str(e).splitlines()[0]})"
            ) from e
        raise
