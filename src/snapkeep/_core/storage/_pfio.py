"""An fsspec view of a ppe/pfio-style filesystem object.

ppe's writers accept ``fs=`` objects that follow pfio's interface (``open(path, mode)``,
``list(path)``, ``stat(path)``, ``makedirs(path, exist_ok=...)``, ``exists(path)``,
``rename(src, dst)``, ``remove(path)``) -- pfio's POSIX, HDFS and S3 handlers, or ppe's own POSIX
class. :class:`PfioFileSystem` adapts such an object to ``fsspec.AbstractFileSystem`` so that it
goes through the same :class:`~._storage.Storage` as every other backend.

Such objects offer no atomic primitive other than ``rename``, so snapshots on them commit by temp
name + rename (:class:`~._commit.RenameCommit`). Atomicity and durability are exactly what the
wrapped object's ``rename`` gives: ``rename(2)`` on POSIX (no directory ``fsync`` is reachable
through the interface, so a power cut right after a commit may lose it), a server-side copy then a
delete on pfio's S3 (slow, but the destination appears whole). Paths are passed to the object
unchanged: snapkeep never prepends a root of its own.
"""

from __future__ import annotations

import posixpath
import stat as stat_mod
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.utils import stringify_path

REQUIRED_METHODS = ("open", "list", "stat", "makedirs", "exists", "rename", "remove")


def missing_methods(obj: Any) -> list[str]:
    """The pfio-style methods ``obj`` lacks (empty when it can be wrapped)."""
    return [m for m in REQUIRED_METHODS if not callable(getattr(obj, m, None))]


class PfioFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """fsspec filesystem over a ppe/pfio-style object (see the module docstring).

    Instances are picklable when the wrapped object is (they travel to process writers' workers)
    and are never shared through fsspec's instance cache.

    Args:
        obj: the pfio-style object.

    Raises:
        TypeError: ``obj`` lacks one of the required methods (they are named).
    """

    protocol = "pfio"
    root_marker = ""
    cachable = False

    def __init__(self, obj: Any, **kwargs: Any) -> None:
        missing = missing_methods(obj)
        if missing:
            raise TypeError(
                f"fs (a {type(obj).__name__}) is neither an fsspec filesystem nor a ppe/pfio-style "
                f"filesystem object: it lacks {', '.join(missing)} "
                f"(needed: {', '.join(REQUIRED_METHODS)})"
            )
        super().__init__(obj, **kwargs)
        self.obj = obj

    def __repr__(self) -> str:
        return f"PfioFileSystem({type(self.obj).__name__})"

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = stringify_path(path)
        if isinstance(text, str) and text.startswith("pfio://"):
            text = text[len("pfio://"):]
        return text if text in ("", "/") else text.rstrip("/")

    def unstrip_protocol(self, name: str) -> str:
        return name

    # -- listing and metadata ----------------------------------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        """Entries directly under ``path`` (``refresh`` and other fsspec options are accepted and
        ignored: nothing is cached). Raises ``FileNotFoundError`` for a missing directory."""
        path = self._strip_protocol(path)
        entries = []
        for name in self.obj.list(path):
            base = str(name).rstrip("/")
            if not base:
                continue
            full = posixpath.join(path, base) if path else base
            if str(name).endswith("/"):
                entries.append({"name": full, "size": 0, "type": "directory"})
                continue
            try:
                entries.append(self._entry(full, self.obj.stat(full)))
            except FileNotFoundError:  # vanished between list and stat
                continue
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        return self._entry(path, self.obj.stat(path))

    @staticmethod
    def _entry(path: str, st: Any) -> dict[str, Any]:
        isdir = getattr(st, "isdir", None)
        if callable(isdir):
            is_dir = bool(isdir())
        else:
            mode = getattr(st, "mode", getattr(st, "st_mode", None))
            is_dir = isinstance(mode, int) and stat_mod.S_ISDIR(mode)
        size = getattr(st, "size", getattr(st, "st_size", 0))
        mtime = getattr(st, "last_modified", getattr(st, "st_mtime", None))
        entry: dict[str, Any] = {"name": path, "size": int(size or 0),
                                 "type": "directory" if is_dir else "file"}
        if isinstance(mtime, (int, float)):
            entry["mtime"] = float(mtime)
        return entry

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self.obj.exists(self._strip_protocol(path)))

    # -- directories -----------------------------------------------------------------------------
    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.obj.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.makedirs(path, exist_ok=True)

    def rmdir(self, path: str) -> None:
        self.obj.remove(self._strip_protocol(path))

    # -- files -----------------------------------------------------------------------------------
    def _open(
        self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
        cache_options: Any = None, **kwargs: Any,
    ) -> Any:
        if not autocommit:
            raise NotImplementedError(
                "pfio-style filesystems have no deferred commit; snapkeep commits on them by "
                "temp name + rename")
        return self.obj.open(self._strip_protocol(path), mode)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        with self.obj.open(self._strip_protocol(path), "rb") as f:
            data = f.read()
        return bytes(data[start:end]) if start is not None or end is not None else bytes(data)

    def rm_file(self, path: str) -> None:
        self.obj.remove(self._strip_protocol(path))

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = path if isinstance(path, (list, tuple)) else [path]
        for p in paths:
            if recursive:
                self.obj.remove(self._strip_protocol(p), recursive=True)
            else:
                self.rm_file(p)

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, replacing it: the wrapped object's ``rename`` (the commit
        primitive of :class:`~._commit.RenameCommit`)."""
        self.obj.rename(self._strip_protocol(src), self._strip_protocol(dst))

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.replace(path1, path2)
