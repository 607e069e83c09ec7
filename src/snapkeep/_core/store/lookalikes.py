"""Files that look like snapshots but do not match the filename template.

A directory of ``100.pt``, ``200.pt`` searched with the template ``snapshot_iter_{.iteration}``
holds no snapshot of that template, and "nothing to resume" would silently restart training from
step 0. :func:`lookalike_message` names such files and the template that would match them, for a
warning: a file looks like a snapshot when it is not hidden, is not one of snapkeep's own files,
and has a number in its name; the suggested template puts the step field in place of the name's
last number.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_LAST_NUMBER = re.compile(r"[0-9]+(?!.*[0-9])")
#: Most names listed per suggested template.
MAX_NAMED = 5


def suggest_template(name: str, field: str) -> str | None:
    """``name`` with its last run of ASCII digits replaced by ``field`` (braces of the rest
    escaped), e.g. ``suggest_template('100.pt', '{step}') == '{step}.pt'``; ``None`` when the
    name has no digit."""
    match = _LAST_NUMBER.search(name)
    if match is None:
        return None

    def escape(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    return escape(name[:match.start()]) + field + escape(name[match.end():])


def lookalike_message(names: Iterable[str], template: str, field: str, where: str) -> str | None:
    """A warning naming the files among ``names`` that look like snapshots (see the module
    docstring) and the templates that would match them, or ``None`` when there are none.

    Args:
        names: file names in the directory (none of which matched ``template``).
        template: the template searched with.
        field: the step field of that kind of template (``'{step}'``, ``'{.iteration}'``).
        where: the directory, for the message.
    """
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        if name.startswith(".") or ".snapkeep" in name:
            continue
        suggestion = suggest_template(name, field)
        if suggestion is not None:
            groups.setdefault(suggestion, []).append(name)
    if not groups:
        return None
    parts = []
    for suggestion, matched in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        more = f" and {len(matched) - MAX_NAMED} more" if len(matched) > MAX_NAMED else ""
        parts.append(f"{matched[:MAX_NAMED]}{more} would match the template {suggestion!r}")
    return (f"{where} holds no snapshot of the template {template!r}, but file(s) that look like "
            f"snapshots: {'; '.join(parts)}. Pass that template if they are yours, or they will "
            "not be resumed from")


__all__ = ["MAX_NAMED", "lookalike_message", "suggest_template"]
