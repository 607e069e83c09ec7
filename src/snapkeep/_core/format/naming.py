"""Filename templates: ``format(values) -> name`` and ``parse(name) -> key``.

The store's template language is ``str.format`` with named fields: ``'ckpt_{step}'``,
``'{step:08d}.pt'``, ``'snap_e{epoch}_i{step}'``, ``'m_{step}_{loss:.3f}'`` (``step`` and
``epoch`` are whole numbers; any other field is a number). A door that speaks another language
translates once, at its edge: ppe's ``'snapshot_iter_{.iteration}'`` (formatted with the manager)
becomes ``'snapshot_iter_{step}'`` with :func:`ppe_template`. A template may also be a callable
``values -> str`` (ppe's ``filename`` callable gets the manager), whose names cannot be parsed back.

Parsing turns the template into an anchored regular expression so that "latest" is decided by the
numbers in the name (step first, then epoch, then any other field) and never by mtime.
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
_INTEGER_FIELDS = ("step", "epoch")
_PRIORITY = {"step": 0, "epoch": 1, "epoch_detail": 2}
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: ppe's field: an attribute of the manager (``.iteration``, ``0.epoch``; ``.updater.iteration``,
#: ppe's deprecated alias of the manager, names the manager's own attribute)
_PPE_FIELD = re.compile(r"0?(?:\.updater)?\.([A-Za-z_][A-Za-z0-9_]*)\Z")
#: ppe's manager attribute -> the store's field
_PPE_NAMES = {"iteration": "step"}


def _parse(template: str, what: str) -> list[tuple[str, str | None, str | None, str | None]]:
    try:
        return list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{what} {template!r} is malformed: {e}") from e


def _escape(literal: str) -> str:
    return literal.replace("{", "{{").replace("}", "}}")


@dataclasses.dataclass(frozen=True)
class FilenameTemplate:
    """A snapshot filename template in the store's language (see the module docstring).

    Args:
        template: a format string with named fields (``'snapshot_iter_{step}'``,
            ``'e{epoch}_s{step:06d}'``) or a callable ``values -> str``. Callables cannot be
            parsed back, so autoload and retention by name only work with strings (as in ppe).
        shown: the template as its user wrote it, for messages (ppe's
            ``'snapshot_iter_{.iteration}'``); default the template itself.

    Raises:
        TypeError: ``template`` is neither a string nor a callable.
        ValueError: the format string is malformed, has a field that is not a name (``{}``,
            ``{0}``, ``{.iteration}``: translate ppe's with :func:`ppe_template`), or makes
            names outside the directory.
    """

    template: str | Callable[[Any], str]
    shown: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.template, str):
            sample = []
            for literal, field, _spec, _conv in _parse(self.template, "filename template"):
                sample.append(literal)
                if field is None:
                    continue
                if not _FIELD.match(field):
                    raise ValueError(
                        f"filename template {self.text!r} has the field {{{field}}}; a field is "
                        "a name, e.g. 'snapshot_iter_{step}', 'e{epoch}_s{step:06d}' (ppe's "
                        "'{.iteration}' spelling is translated by ppe_template)")
                sample.append("0")
            try:
                check_name("".join(sample))
            except ValueError as e:
                raise ValueError(f"filename template {self.text!r}: {e}") from None
        elif not callable(self.template):
            raise TypeError(
                "filename must be a format string such as 'snapshot_iter_{step}' or a callable "
                f"-> str, got {type(self.template).__name__}"
            )

    @property
    def text(self) -> str:
        """The template as its user wrote it (``shown``, else the template), for messages."""
        return self.shown or (self.template if isinstance(self.template, str)
                              else repr(self.template))

    @property
    def parsable(self) -> bool:
        """Whether names can be parsed back (only string templates)."""
        return isinstance(self.template, str)

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of a string template's fields, in order (``()`` for a callable)."""
        if not isinstance(self.template, str):
            return ()
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None)

    def name_at(self, step: int, **values: Any) -> str:
        """The name of the snapshot of ``step`` (and the template's other fields from
        ``values``); see :meth:`format` for the errors."""
        return self.format({"step": step, **values})

    def format(self, values: Any) -> str:
        """Return the concrete filename: a string template formatted with ``values`` (a mapping
        from field names to numbers), a callable called with ``values`` (whatever its door
        passes: ppe's manager).

        Raises:
            ValueError: ``values`` lacks a field of the template, or the result is not a name
                inside out_dir (empty, absolute, ``..``, NUL; see :func:`check_name`).
        """
        if callable(self.template):
            name = self.template(values)
        else:
            try:
                name = self.template.format_map(values)
            except (AttributeError, KeyError) as e:
                raise ValueError(
                    f"filename template {self.text!r} names a field that has no value ({e}); "
                    "e.g. {step} or {epoch}; ppe's manager has iteration, epoch and epoch_detail"
                ) from e
        if not isinstance(name, str) or not name:
            raise ValueError(f"filename template {self.text!r} produced {name!r}")
        try:
            return check_name(name, "filename")
        except ValueError as e:
            raise ValueError(f"filename template {self.text!r} produced a bad name: {e}") \
                from None

    @property
    def lock_key(self) -> str:
        """The template reduced to the set of names it matches: literals (braces escaped) and one
        ``{int}`` or ``{num}`` per field, whatever the field's format spec or conversion
        (``'s_{step}'`` and ``'s_{step:d}'``, and ppe's ``'s_{.iteration}'`` and
        ``'s_{0.iteration}'`` once translated, all give ``'s_{int}'``). Templates with one key
        list, autoload and retain the same files.

        Raises:
            TypeError: the template is a callable (it has no key).
        """
        if not isinstance(self.template, str):
            raise TypeError("callable filename templates have no lock key")
        parts: list[str] = []
        for literal, field, _spec, _conv in string.Formatter().parse(self.template):
            parts.append(_escape(literal))
            if field is not None:
                parts.append("{int}" if field in _INTEGER_FIELDS else "{num}")
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
            parts.append(_INTEGER if field in _INTEGER_FIELDS else _NUMBER)
            priorities.append(_PRIORITY.get(field, 3))
        return re.compile("".join(parts) + r"\Z"), priorities

    def parse(self, name: str) -> tuple[float, ...] | None:
        """Return the sort key of ``name`` or ``None`` when it is not a name of this template.

        The key orders the template's numeric fields step first, then epoch, then the others
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
        """The first number of ``name``'s key (the step when the template has one)."""
        key = self.parse(name)
        if not key:
            return None
        return int(key[0])


def step_template(template: str) -> FilenameTemplate:
    """``template`` (``'ckpt_{step}'``, ``'{step:08d}.pt'``, ``'run/{step}'``) checked to name
    the step and nothing else: the Checkpointer's ``template`` and Lightning's ``ModelCheckpoint``
    names with only a step. Format a name with :meth:`FilenameTemplate.name_at`.

    Raises:
        TypeError: ``template`` is not a str.
        ValueError: it has no ``{step}`` field, another field, or is malformed.
    """
    if not isinstance(template, str):
        raise TypeError(f"template must be a str with one {{step}} field such as 'ckpt_{{step}}' "
                        f"or '{{step:08d}}.pt', got {type(template).__name__}")
    fields = 0
    for _literal, field, _spec, conversion in _parse(template, "template"):
        if field is None:
            continue
        if field != "step" or conversion:
            raise ValueError(f"template {template!r} has the field {{{field}}}; the only field "
                             "is {step} (with an optional format spec such as {step:08d})")
        fields += 1
    if fields != 1:
        raise ValueError(f"template {template!r} must have exactly one {{step}} field (e.g. "
                         f"'ckpt_{{step}}', '{{step:08d}}.pt'), it has {fields}")
    return FilenameTemplate(template)


def ppe_template(filename: str | Callable[[Any], str]) -> FilenameTemplate:
    """ppe's ``filename`` (a format string formatted with the manager,
    ``'snapshot_iter_{.iteration}'``, or a callable ``manager -> str``) as the store's template:
    the one translation of ppe's spelling, made where ppe's names enter (the snapshot extensions,
    ``load_latest``, the CLI's ``-t``). Each field ``{.attr}`` (also ``{0.attr}`` and the
    deprecated ``{.updater.attr}``) becomes ``{attr}``, ``{.iteration}`` becomes ``{step}``;
    format specs and conversions are kept, and fields already named (``{step}``) stay. Format
    its names from a manager with :func:`ppe_name`.

    Raises:
        TypeError: ``filename`` is neither a str nor a callable.
        ValueError: a field names no attribute (``{}``, ``{0}``: the manager's repr) or more
            than one, or the template is malformed or makes names outside the directory.
    """
    if not isinstance(filename, str):
        return FilenameTemplate(filename)
    parts: list[str] = []
    for literal, field, spec, conversion in _parse(filename, "filename template"):
        parts.append(_escape(literal))
        if field is None:
            continue
        match = _PPE_FIELD.match(field)
        if match is not None:
            name = _PPE_NAMES.get(match.group(1), match.group(1))
        elif _FIELD.match(field):
            name = field
        elif re.fullmatch(r"\d*", field):  # '{}' / '{0}': the manager's repr
            raise ValueError(
                f"filename template {filename!r} has the field {{{field}}}, which would put the "
                "manager object itself into the name; name an attribute of the manager in each "
                "field, e.g. filename='snapshot_iter_{.iteration}' or 'snap_e{.epoch}_i"
                "{.iteration}'")
        else:
            raise ValueError(
                f"filename template {filename!r} has the field {{{field}}}; a field names one "
                "attribute of the manager, e.g. filename='snapshot_iter_{.iteration}' or "
                "'snap_e{.epoch}_i{.iteration}'")
        parts.append("{" + name + (f"!{conversion}" if conversion else "")
                     + (f":{spec}" if spec else "") + "}")
    return FilenameTemplate("".join(parts), shown=filename)


def ppe_name(template: FilenameTemplate, manager: Any) -> str:
    """The name :func:`ppe_template`'s ``template`` gives at ``manager``'s state, as ppe's
    ``filename.format(manager)``: a callable gets the manager; ``{step}`` is the manager's
    ``iteration`` and any other field the manager's attribute of that name.

    Raises:
        ValueError: the manager lacks an attribute a field names, or the name is bad (see
            :meth:`FilenameTemplate.format`).
    """
    return template.format(manager if not template.parsable else _ManagerFields(manager))


class _ManagerFields:
    """A ppe template's field values, read from the manager's attributes on demand."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def __getitem__(self, field: str) -> Any:
        attribute = next((k for k, v in _PPE_NAMES.items() if v == field), field)
        try:
            return getattr(self.manager, attribute)
        except AttributeError as e:
            raise KeyError(f"the manager has no attribute {attribute!r}") from e
