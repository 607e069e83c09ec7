"""Faults injected into ``os.write``/``os.pwrite`` for one test's files only.

``monkeypatch.setattr(_direct.os, "pwrite", ...)`` replaces the function process-wide
(``_direct.os`` is ``os``): every other thread's writes go through it too (a pool thread of an
earlier test still finishing, multiprocessing's resource tracker, pytest-xdist's own I/O). A fault
that counts or refuses every call then hits another thread's write whenever one happens to run
meanwhile, which a loaded machine makes likely: the test fails only under load. Faults decide by
the descriptor instead (:func:`fd_under`), and pass every other write through unchanged.
"""

from __future__ import annotations

import os
from typing import Any


def fd_under(fd: int, directory: Any) -> bool:
    """Whether the descriptor ``fd`` is open on a file under ``directory`` (Linux ``/proc``)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(f"{os.fspath(directory)}{os.sep}")
    except OSError:
        return False
