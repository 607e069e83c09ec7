"""Filename templates: ``format(manager) -> name`` and ``parse(name) -> key``.

A template is a ``str.format`` string that receives the manager as its only positional argument
(as ppe's ``snapshot(filename='snapshot_iter_{.iteration}')``), or a callable ``manager -> str``.
Parsing turns the template into an anchored regular expression so that "latest" is decided by the
numbers in the name (iteration first, then epoch, then any other field) and never by mtime.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
from collections.abc import Callable
from typing import Any

from snapkeep._core.storage import check_name

#: ASCII digits only: ``\d`` would also match other scripts' digits ('snapshot_iter_\u0663',
#: fullwidth '\uff13'), which ``int``/``float`` read as numbers, so a file no writer made would
#: tie with the real step and could win autoload or retention over it.
_NUMBER = r"(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)"
_INTEGER = r"(-?[0-9]+)"
#: fields that are counters: their names only match whole numbers ("_iter_10.5" is not a snapshot)
_INTEGER_FIELDS = ("iteration", "epoch")
_PRIORITY = {"iteration": 0, "epoch": 1, "epoch_detail": 2}


def _attribute_of(field_name: str) -> str:
    """``'.iteration'`` / ``'0.iteration'`` / ``'[0].epoch'`` -> ``'iteration'`` / ``'epoch'``."""
    match = re.search(r"\.([A-Za-z_][A-Za-z0-9_]*)$", field_name)
    return match.group(1) if match else field_name


@dataclasses.dataclass(frozen=True)
class FilenameTemplate:
    """A snapshot filename template.

    Args:
        template: a format string formatted with the manager (``'snapshot_iter_{.iteration}'``)
            or a callable ``manager -> str``. Callables cannot be parsed back, so autoload and
            retention by name only work with strings (as in ppe).

    Raises:
        TypeError: ``template`` is neither a string nor a callable.
        ValueError: the format string is malformed.
    """

    template: str | Callable[[Any], str]

    def __post_init__(self) -> None:
        if isinstance(self.template, str):
            try:
                fields = list(string.Formatter().parse(self.template))
            except ValueError as e:
                raise ValueError(f"filename template {self.template!r} is malformed: {e}") from e
            sample = []
            for literal, field, _spec, _conv in fields:
                sample.append(literal)
                if field is None:
                    continue
                if re.fullmatch(r"\d*", field):  # '{}' / '{0}': the manager's repr
                    raise ValueError(
                        f"filename template {self.template!r} has the field {{{field}}}, which "
                        "would put the manager object itself into the name; name an attribute "
                        "of the manager in each field, e.g. filename='snapshot_iter_{.iteration}'"
                        " or 'snap_e{.epoch}_i{.iteration}'")
                sample.append("0")
            try:
                check_name("".join(sample))
            except ValueError as e:
                raise ValueError(f"filename template {self.template!r}: {e}") from None
        elif not callable(self.template):
            raise TypeError(
                "filename must be a format string such as 'snapshot_iter_{.iteration}' or a "
                f"callable manager -> str, got {type(self.template).__name__}"
            )

    @property
    def parsable(self) -> bool:
        """Whether names can be parsed back (only string templates)."""
        return isinstance(self.template, str)

    def name_at(self, step: int) -> str:
        """The name of the snapshot of ``step`` (an ``{.iteration}`` template, as
        :func:`step_template` makes; see :meth:`format` for the errors)."""
        return self.format(_Step(step))

    def format(self, manager: Any) -> str:
        """Return the concrete filename for ``manager``'s current state.

        Raises:
            ValueError: the template names an attribute the manager lacks, or the result is not a
                name inside out_dir (empty, absolute, ``..``, NUL; see :func:`check_name`).
        """
        if callable(self.template):
            name = self.template(manager)
        else:
            try:
                name = self.template.format(manager)
            except IndexError as e:
                raise ValueError(
                    f"filename template {self.template!r} has more than one automatically "
                    f"numbered field ({e}); the manager is the only argument, so name it in "
                    "each field: 'snapshot_e{0.epoch}_i{0.iteration}'"
                ) from e
            except (AttributeError, KeyError) as e:
                raise ValueError(
                    f"filename template {self.template!r} names a field the manager does not "
                    f"have ({e}); use attributes such as {{.iteration}} or {{.epoch}}"
                ) from e
        if not isinstance(name, str) or not name:
            raise ValueError(f"filename template {self.template!r} produced {name!r}")
        try:
            return check_name(name, "filename")
        except ValueError as e:
            raise ValueError(f"filename template {self.template!r} produced a bad name: {e}") \
                from None

    @property
    def lock_key(self) -> str:
        """The template reduced to the set of names it matches: literals (braces escaped) and one
        ``{int}`` or ``{num}`` per field, whatever the field's spelling, conversion or format
        spec (``'s_{.iteration}'``, ``'s_{0.iteration}'`` and ``'s_{.iteration:d}'`` all give
        ``'s_{int}'``). Templates with one key list, autoload and retain the same files, so the
        directory lock is taken on this key, not on the template's text.

        Raises:
            TypeError: the template is a callable (it has no key; nothing is locked).
        """
        if not isinstance(self.template, str):
            raise TypeError("callable filename templates have no lock key")
        parts: list[str] = []
        for literal, field, _spec, _conv in string.Formatter().parse(self.template):
            parts.append(literal.replace("{", "{{").replace("}", "}}"))
            if field is not None:
                parts.append("{int}" if _attribute_of(field) in _INTEGER_FIELDS else "{num}")
        return "".join(parts)

    def _regex(self) -> tuple[re.Pattern[str], list[int]]:
        if not isinstance(self.template, str):
            raise TypeError("callable filename templates cannot be parsed")
        parts: list[str] = []
        priorities: list[int] = []
        for literal, field, _spec, _conv in string.Formatter().parse(self.template):
            parts.append(re.escape(literal))
            if field is None:
                continue
            attribute = _attribute_of(field)
            parts.append(_INTEGER if attribute in _INTEGER_FIELDS else _NUMBER)
            priorities.append(_PRIORITY.get(attribute, 3))
        return re.compile("".join(parts) + r"\Z"), priorities

    def parse(self, name: str) -> tuple[float, ...] | None:
        """Return the sort key of ``name`` or ``None`` when it is not a name of this template.

        The key orders the template's numeric fields iteration first, then epoch, then the others
        in template order. A template without fields yields ``()`` for its single name. Numbers
        are ASCII digits only, and a number beyond a float's range is not a step (``None``).
        """
        regex, priorities = self._regex()
        match = regex.match(name)
        if match is None:
            return None
        values = [float(v) for v in match.groups()]
        if not all(math.isfinite(v) for v in values):  # digits beyond a float's range
            return None
        order = sorted(range(len(values)), key=lambda i: (priorities[i], i))
        return tuple(values[i] for i in order)

    def step_of(self, name: str) -> int | None:
        """The first number of ``name``'s key (the iteration when the template has one)."""
        key = self.parse(name)
        if not key:
            return None
        return int(key[0])


class _Step:
    """What a step template is formatted with (its ``{step}`` fields became ``{.iteration}``)."""

    def __init__(self, step: int) -> None:
        self.iteration = step


def step_template(template: str) -> FilenameTemplate:
    """``template`` (``'ckpt_{step}'``, ``'{step:08d}.pt'``, ``'run/{step}'``) as a
    :class:`FilenameTemplate` whose names parse back to the step: the one translation of a
    ``{step}`` name (the Checkpointer's ``template``, Lightning's ``ModelCheckpoint`` names with
    only a step) into the store's template. Format a name with :meth:`FilenameTemplate.name_at`.

    Raises:
        TypeError: ``template`` is not a str.
        ValueError: it has no ``{step}`` field, another field, or is malformed.
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a str with one {{step}} field such as 'ckpt_{{step}}' "
                        f"or '{{step:08d}}.pt', got {type(template).__name__}")
    parts: list[str] = []
    fields = 0
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"template {template!r} is malformed: {e}") from e
    for literal, field, spec, conversion in parsed:
        parts.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is None:
            continue
        if field != "step" or conversion:
            raise ValueError(f"template {template!r} has the field {{{field}}}; the only field "
                             "is {step} (with an optional format spec such as {step:08d})")
        fields += 1
        parts.append("{.iteration" + (f":{spec}" if spec else "") + "}")
    if fields != 1:
        raise ValueError(f"template {template!r} must have exactly one {{step}} field (e.g. "
                         f"'ckpt_{{step}}', '{{step:08d}}.pt'), it has {fields}")
    return FilenameTemplate("".join(parts))
