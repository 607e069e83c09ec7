"""Storage: the only place that talks to fsspec or the OS file API.

``resolve_storage(out_dir, fs, storage_options)`` picks one :class:`Storage` for a local path, an
fsspec URL or filesystem, or a ppe/pfio-style object. Every backend exposes the same operations;
what differs is the commit strategy (see :mod:`._commit`): replace+fsync on the local filesystem,
temp+rename on pfio-style objects, one complete PUT on object stores and ``memory://``.
"""

from snapkeep._core.storage._commit import (
    CommitStrategy,
    RenameCommit,
    ReplaceCommit,
    Target,
    WriteResult,
    set_publish_guard,
)
from snapkeep._core.storage._durable_file import DurableFile
from snapkeep._core.storage._hashing import CHECKSUM_ALGORITHM, HashingWriter, new_hasher
from snapkeep._core.storage._local import open_regular
from snapkeep._core.storage._paths import ACCEPTED_NAMES, check_name
from snapkeep._core.storage._pfio import PfioFileSystem
from snapkeep._core.storage._private import (
    NotPrivateError,
    check_root,
    list_private,
    lstat_private,
    private_dir,
    private_storage,
    read_private,
    remove_private,
    remove_private_file,
)
from snapkeep._core.storage._put import ObjectPutCommit
from snapkeep._core.storage._resolve import commit_strategy_for, resolve_storage
from snapkeep._core.storage._storage import Storage
from snapkeep._core.storage._temps import TEMP_MARKER, base36, is_temp_name, pid_alive

__all__ = [
    "NotPrivateError", "check_root", "list_private", "lstat_private", "private_dir",
    "private_storage", "read_private", "remove_private", "remove_private_file",
    "TEMP_MARKER", "CommitStrategy", "ObjectPutCommit", "PfioFileSystem", "RenameCommit",
    "ReplaceCommit", "Storage", "Target", "WriteResult", "commit_strategy_for", "is_temp_name",
    "open_regular", "resolve_storage", "set_publish_guard", "CHECKSUM_ALGORITHM", "HashingWriter",
    "new_hasher", "DurableFile", "ACCEPTED_NAMES", "check_name", "base36", "pid_alive",
]
