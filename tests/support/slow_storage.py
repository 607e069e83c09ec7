"""A really slow storage for deadline tests: a ppe/pfio-style filesystem object over local
absolute paths whose writes are throttled to ``bytes_per_s`` (each ``write`` sleeps for its
size); snapkeep commits on it by its own temp name + rename (``RenameCommit``), so a write cut
short leaves only snapkeep's own temp file."""

from __future__ import annotations

import os
import stat
import time
from typing import Any


class _FileStat:
    def __init__(self, st: os.stat_result) -> None:
        self.size = st.st_size
        self.mode = st.st_mode
        self.last_modified = st.st_mtime

    def isdir(self) -> bool:
        return stat.S_ISDIR(self.mode)


class _Throttled:
    """A binary file whose writes take ``len(data) / bytes_per_s`` seconds each."""

    def __init__(self, f: Any, bytes_per_s: float) -> None:
        self._f = f
        self._bytes_per_s = bytes_per_s

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        time.sleep(size / self._bytes_per_s)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _Throttled:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


class SlowPfio:
    """pfio-style object over absolute local paths; writes at ``bytes_per_s``."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s

    def open(self, path: str, mode: str = "rb") -> Any:
        f = open(path, mode)  # noqa: SIM115 (the caller closes it)
        return _Throttled(f, self.bytes_per_s) if "w" in mode or "a" in mode else f

    def list(self, path: str = "") -> Any:
        for entry in os.scandir(path):
            yield entry.name + ("/" if entry.is_dir() else "")

    def stat(self, path: str) -> _FileStat:
        return _FileStat(os.stat(path))

    def makedirs(self, path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        os.makedirs(path, mode, exist_ok)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str, recursive: bool = False) -> None:
        os.remove(path)
