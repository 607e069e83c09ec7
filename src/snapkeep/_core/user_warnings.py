"""Warnings attributed to the user's code.

A warning raised deep inside snapkeep (``warnings.warn(..., stacklevel=2)``) points at a snapkeep
file, which tells the user nothing. :func:`warn_user` walks up the stack to the first frame
outside the snapkeep package (or in its demo scripts), so the warning names the line of the
user's script that led to it (``manager = ExtensionsManager(...)``,
``snapkeep.load_latest(...)``), and Python's default filter shows it once per call site.

Warnings are not also logged (that printed every message twice); to route them into logging,
call :func:`logging.captureWarnings` (``py.warnings`` logger).
"""

from __future__ import annotations

import os
import sys
import warnings

#: Files under this directory are snapkeep's own (``src/snapkeep/``).
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: snapkeep's own scripts (``python -m snapkeep.demo``): their lines are the user's code there,
#: else the warning would name the frame that called them (click's).
ENTRY_POINTS = frozenset(PACKAGE_DIR + name for name in ("demo.py", "demo_sharded.py"))


def _snapkeep_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(PACKAGE_DIR) and path not in ENTRY_POINTS


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` call in the *caller* of this function
    point at the first frame outside the snapkeep package."""
    frame = sys._getframe(1)  # the function that will call warnings.warn: stacklevel 1
    level = 1
    while frame is not None and _snapkeep_internal(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's call site (see the module
    docstring)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
