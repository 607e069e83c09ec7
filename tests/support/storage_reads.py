"""Proof that a resume read no saved state: an audit hook recording every open for reading of a
file that existed under a directory when recording was set up."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def _not_a_marker(path: str) -> bool:
    """Saved state, not a manifest, lock or commit marker."""
    return "/.snapkeep/" not in path and not path.endswith(".snapkeep-commit.json")


class StorageReads:
    """Records (in :attr:`reads`) each ``open`` for reading of a file under ``root`` that existed
    at creation and passes ``is_state`` (default: not snapkeep's manifests, locks or markers),
    while :attr:`recording`. Audit hooks cannot be removed: set ``recording = False`` to stop."""

    def __init__(self, root: str, *, recording: bool = True,
                 is_state: Callable[[str], bool] = _not_a_marker) -> None:
        self.saved = {os.path.join(d, n) for d, _, names in os.walk(root) for n in names}
        self.reads: list[str] = []
        self.recording = recording
        self._is_state = is_state
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not self.recording or not isinstance(args[0], str):
            return
        path, mode, flags = args
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and flags & (os.O_WRONLY | os.O_RDWR))
        if path in self.saved and not writes and self._is_state(path):
            self.reads.append(path)
