"""A snapshot whose file name says another step than the iteration it holds (a file copied or
renamed by hand, e.g. ``cp snapshot_iter_500 snapshot_iter_1000``) is not resumed from: "latest"
is the step in the name, so resuming it would silently go back in training, and every restart
would do so again. Autoload skips it with a warning naming both steps and falls back to the
next older snapshot, as for a corrupt file."""

from __future__ import annotations

import string
from typing import Any

#: The key of the manager state holding the iteration it was taken at.
ITERATION_KEY = "_start_iteration"


def _names_step(template: str) -> bool:
    """Whether a store template's fields include the step (``{step}``, ``{step:08d}``)."""
    try:
        return any(f == "step" for _, f, _, _ in string.Formatter().parse(template))
    except ValueError:
        return False


def misnamed_reason(name: str, step: int | None, template: Any, state: Any) -> str | None:
    """Why snapshot ``name`` (whose store ``template`` names the step and gave ``step``) must not
    be resumed from: it holds a manager state of another iteration (copied or renamed by hand).
    None when the name and the state agree, or when the state records no iteration."""
    if step is None or not isinstance(template, str) or not _names_step(template):
        return None
    if not isinstance(state, dict):
        return None
    saved = state.get(ITERATION_KEY)
    if isinstance(saved, bool) or not isinstance(saved, int) or saved == step:
        return None
    return (f"{name} is named for step {step} but holds iteration {saved} (copied or renamed?); "
            "it is not resumed from. Rename the file to match the iteration it holds, or move it "
            "away")
