"""The path rules every write and delete of :class:`~._storage.Storage` obeys: no ``..``
component or NUL character (nothing outside out_dir is ever written or deleted), and no file name
longer than its filesystem's NAME_MAX in bytes (refused before anything is written)."""

from __future__ import annotations

import os

#: What a snapshot name may be, for messages.
ACCEPTED_NAMES = (
    "a relative path inside out_dir such as 'snapshot_iter_100' or 'snaps/iter_100': no "
    "absolute path, no '.', '..' or empty components, no NUL character, no component named "
    "'.snapkeep' or containing '.snapkeep-tmp.' (snapkeep's own metadata and temporary files)"
)
#: Components snapkeep reserves in out_dir: its manifest directory and temp-file marker.
_RESERVED_COMPONENT = ".snapkeep"
_RESERVED_MARKER = ".snapkeep-tmp."
#: NAME_MAX assumed where the filesystem cannot be asked (POSIX filesystems: 255 bytes).
DEFAULT_NAME_MAX = 255


def truncate_utf8(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8", "surrogateescape")[:max_bytes]
    return data.decode("utf-8", "ignore")


def check_path(path: str, what: str = "path") -> None:
    """Refuse a path that could leave the directory it was built for: a ``..`` component or a NUL
    character (every write and delete of :class:`Storage` checks this, whatever the caller).

    Raises:
        ValueError: naming the path and the rule.
    """
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a str, got {type(path).__name__}")
    if "\0" in path:
        raise ValueError(f"{what} {path!r} contains a NUL character; snapshot names must not")
    if ".." in path.replace("\\", "/").split("/"):
        raise ValueError(f"{what} {path!r} has a '..' component, which could leave out_dir; "
                         "snapshot names must be relative paths inside out_dir")


def local_name_max(directory: str) -> int:
    """NAME_MAX, in bytes, of the local filesystem holding ``directory`` (asked of its nearest
    existing ancestor); :data:`DEFAULT_NAME_MAX` where the OS cannot say."""
    probe = os.path.abspath(directory or ".")
    while True:
        try:
            return int(os.pathconf(probe, "PC_NAME_MAX"))
        except FileNotFoundError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return DEFAULT_NAME_MAX
            probe = parent
        except (OSError, ValueError):
            return DEFAULT_NAME_MAX


def check_basename_bytes(base: str, limit: int | None) -> None:
    """Refuse a file name ``base`` longer than ``limit`` bytes (NAME_MAX; ``None``: no limit).

    Raises:
        ValueError: naming the size and the limit; nothing was written.
    """
    if limit is not None and len(base.encode("utf-8", "surrogateescape")) > limit:
        raise ValueError(
            f"file name {truncate_utf8(base, 40)!r}... is "
            f"{len(base.encode('utf-8', 'surrogateescape'))} bytes, over the filesystem's "
            f"NAME_MAX of {limit} bytes; nothing was written")


def check_name(name: str, what: str = "snapshot name") -> str:
    """Return ``name`` when it stays inside its output directory; raise otherwise.

    A name is a relative ``/``-separated path. It escapes (or clobbers snapkeep's own files) when
    it is absolute, has a ``.``/``..``/empty component or a NUL character, or names snapkeep's
    manifest directory or temporary-file marker (retention and the temp sweep would treat it as
    their own).

    Raises:
        ValueError: naming ``name`` and what is accepted (:data:`ACCEPTED_NAMES`).
        TypeError: ``name`` is not a str.
    """
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {type(name).__name__}")
    problem = None
    if not name:
        problem = "it is empty"
    elif "\0" in name:
        problem = "it contains a NUL character"
    elif name.startswith("/"):
        problem = "it is an absolute path"
    else:
        for part in name.split("/"):
            if part in ("", ".", ".."):
                problem = f"it has a {part!r} component" if part else \
                    "it has an empty component (a '//' or a trailing '/')"
                break
            if part == _RESERVED_COMPONENT or _RESERVED_MARKER in part:
                problem = f"its component {part!r} is reserved for snapkeep's own files"
                break
    if problem is not None:
        raise ValueError(f"{what} {name!r} is refused because {problem}; accepted: "
                         f"{ACCEPTED_NAMES}")
    return name
