"""Warnings name the user's line: the first frame outside snapkeep's package, where snapkeep's
demo scripts count as the user's code (not the click frame that called them)."""

from __future__ import annotations

import os
import warnings

from snapkeep._core import user_warnings


def _run_as(filename: str) -> warnings.WarningMessage:
    """Call ``warn_user`` from a function whose code claims to live in ``filename``, through a
    snapkeep-internal caller."""
    inner = compile("def inner():\n    warn_user('hello')\n",
                    os.path.join(user_warnings.PACKAGE_DIR, "_core", "fake_internal.py"), "exec")
    outer = compile("def outer():\n    inner()\n", filename, "exec")
    space: dict[str, object] = {"warn_user": user_warnings.warn_user}
    exec(inner, space)
    exec(outer, space)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        space["outer"]()  # type: ignore[operator]
    assert len(caught) == 1
    return caught[0]


def test_a_warning_names_the_first_frame_outside_snapkeep() -> None:
    # outer() is snapkeep-internal too, so the warning names this test's line
    got = _run_as(os.path.join(user_warnings.PACKAGE_DIR, "_core", "fake_outer.py"))
    assert got.filename == __file__


def test_the_demo_scripts_lines_count_as_the_users() -> None:
    for script in ("demo.py", "demo_sharded.py"):
        got = _run_as(os.path.join(user_warnings.PACKAGE_DIR, script))
        assert got.filename == os.path.join(user_warnings.PACKAGE_DIR, script)
        assert got.lineno == 2
