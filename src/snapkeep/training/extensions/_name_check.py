"""A resumed snapshot whose file name says another step than the iteration it holds (a file
copied or renamed by hand, e.g. ``cp snapshot_iter_500 snapshot_iter_1000``) resumes from the
iteration it holds; say so instead of resuming without a word."""

from __future__ import annotations

import re
import string
from typing import Any

from snapkeep.store import warn_user

#: The key of the manager state holding the iteration it was taken at.
ITERATION_KEY = "_start_iteration"


def _names_iteration(template: str) -> bool:
    """Whether a template's fields include the iteration (``{.iteration}``, ``{0.iteration}``)."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f]
    except ValueError:
        return False
    return any(re.search(r"(^|\.)iteration$", f) for f in fields)


def warn_if_renamed(name: str, step: int | None, template: Any, state: Any) -> None:
    """Warn (attributed to the user's code) when snapshot ``name``, whose ``template`` names the
    iteration and gave ``step``, holds a manager state of another iteration."""
    if step is None or not isinstance(template, str) or not _names_iteration(template):
        return
    if not isinstance(state, dict):
        return
    saved = state.get(ITERATION_KEY)
    if isinstance(saved, bool) or not isinstance(saved, int) or saved == step:
        return
    warn_user(
        f"snapshot {name} is named for step {step} but holds iteration {saved} (copied or "
        f"renamed?); the run resumes from iteration {saved}. Rename the file to match, or check "
        "that it is the snapshot you meant to resume", UserWarning)
