"""Storage: the only place that talks to fsspec or the OS file API.

``resolve_storage(out_dir, fs)`` picks one :class:`Storage` for a local path, an fsspec URL or
filesystem, or a ppe/pfio-style object. Every backend exposes the same operations; what differs is
the commit strategy (see :mod:`._commit`).
"""

from snapkeep._core.storage._storage import (
    TEMP_MARKER,
    Storage,
    WriteResult,
    is_temp_name,
    resolve_storage,
)

__all__ = ["TEMP_MARKER", "Storage", "WriteResult", "is_temp_name", "resolve_storage"]
