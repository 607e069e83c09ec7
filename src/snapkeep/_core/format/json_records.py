"""Bounded, strict JSON for every record snapkeep reads from storage.

Manifests, commit markers, the run status, owner records of the memory tier, the lock's holder
line, a safetensors header: each is a file anyone with write access to the directory may have
written (DESIGN invariant 12), so each is parsed by :func:`parse_json`, which answers with the
value or :class:`RecordError` (a ``ValueError``), never ``RecursionError``, ``OverflowError`` or
a value later code cannot use:

- at most ``max_bytes`` bytes of UTF-8;
- nesting at most ``max_depth`` arrays/objects deep (a 100,000-deep array is refused at once:
  Python's parser stops at the recursion limit; code walking a parsed record never nears it);
- numbers: integers of at most :data:`MAX_INT_DIGITS` digits (the magnitude of a 64-bit value);
  floats finite (``1e400``, ``NaN``, ``Infinity`` refused unless ``allow_nan``, which ppe's
  ``LogReport`` log needs);
- strings (keys included) valid Unicode: a lone surrogate (``"\\ud800"``), which no UTF-8 output
  can print, is refused.

Each reader then range-checks its fields with :func:`int_field`, :func:`number_field`,
:func:`str_field` (a pid of ``2**70`` or a time of ``1e300`` is refused there, naming the field
and the accepted range).
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Deepest nesting of arrays/objects a record may have by default (snapkeep's own are <= 3).
MAX_DEPTH = 32
#: Most digits of an integer (sign excluded): 2**63 has 19.
MAX_INT_DIGITS = 20
#: Largest int a record's counters may hold (steps, sizes, pids: below 2**63).
INT64_LIMIT = 1 << 63
#: First Unix time (seconds) past what ``datetime`` can show (year 10000).
UNIX_TIME_LIMIT_S = 253402300800.0



class RecordError(ValueError):
    """A record that is not bounded, strict JSON, or a field out of its range (the message
    names what is wrong)."""


def parse_json(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH,
               allow_nan: bool = False) -> Any:
    """The JSON value of ``data`` within the bounds of the module docstring.

    Args:
        data: the record's bytes (UTF-8) or text.
        max_bytes: largest record accepted, in bytes.
        max_depth: deepest nesting of arrays and objects accepted.
        allow_nan: accept ``NaN``, ``Infinity`` and ``-Infinity`` (as Python's json does).

    Raises:
        RecordError: too large, too deep, not UTF-8, not JSON, a number out of range, or a
            string that is not valid Unicode.
    """
    if not isinstance(data, (str, bytes, bytearray, memoryview)):
        raise RecordError(f"a {type(data).__name__}, not JSON text")
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise RecordError(f"{len(raw)} bytes, over the {max_bytes}-byte limit")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    try:  # Python's C parser raises RecursionError past the interpreter's limit (fast)
        value = json.loads(text, parse_int=_integer, parse_float=_finite,
                           parse_constant=_constant if not allow_nan else float)
    except RecordError:
        raise
    except RecursionError:
        raise RecordError(f"nested deeper than {max_depth} arrays/objects") from None
    except ValueError as e:
        raise RecordError(f"not JSON ({e})") from None
    _check_tree(value, max_depth)
    return value


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise RecordError(f"integer of {len(text.lstrip('-'))} digits (at most "
                          f"{MAX_INT_DIGITS})")
    return int(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RecordError(f"number {text[:40]} is out of range")
    return value


def _constant(text: str) -> Any:
    raise RecordError(f"{text} is not a JSON number")


def _check_tree(value: Any, max_depth: int) -> None:
    """Refuse nesting deeper than ``max_depth`` and strings (keys included) that are not valid
    Unicode (lone surrogates); iterative, so any depth Python's parser returned is walked."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise RecordError(f"string {node[:40]!r} is not valid Unicode") from None
        elif isinstance(node, (dict, list)):
            if depth >= max_depth:
                raise RecordError(f"nested deeper than {max_depth} arrays/objects")
            items = [x for kv in node.items() for x in kv] if isinstance(node, dict) else node
            stack.extend((item, depth + 1) for item in items)


_MISSING: Any = object()


def _get(body: dict[str, Any], name: str, default: Any) -> tuple[bool, Any]:
    if name in body:
        return True, body[name]
    if default is _MISSING:
        raise RecordError(f"required field {name!r} is missing")
    return False, default


def int_field(body: dict[str, Any], name: str, *, low: int = 0, high: int = INT64_LIMIT,
              default: Any = _MISSING) -> Any:
    """``body[name]``: an int (never a bool) with ``low <= value < high``; ``default`` when
    absent (required when no default is given).

    Raises:
        RecordError: missing, or not such an int (the field and the range named).
    """
    present, value = _get(body, name, default)
    if not present:
        return value
    if type(value) is not int or not low <= value < high:
        raise RecordError(f"field {name!r} must be an int in [{low}, {high}), got "
                          f"{_shown(value)}")
    return value


def number_field(body: dict[str, Any], name: str, *, low: float = 0.0,
                 high: float = UNIX_TIME_LIMIT_S, default: Any = _MISSING) -> Any:
    """``body[name]``: a finite int or float (never a bool) with ``low <= value < high``, as a
    float; ``default`` when absent.

    Raises:
        RecordError: missing, or not such a number (the field and the range named).
    """
    present, value = _get(body, name, default)
    if not present:
        return value
    if type(value) not in (int, float) or not math.isfinite(value) \
            or not low <= value < high:
        raise RecordError(f"field {name!r} must be a number in [{low:g}, {high:g}), got "
                          f"{_shown(value)}")
    return float(value)


def str_field(body: dict[str, Any], name: str, *, max_chars: int = 4096,
              default: Any = _MISSING) -> Any:
    """``body[name]``: a string of at most ``max_chars`` characters; ``default`` when absent.

    Raises:
        RecordError: missing, or not such a string.
    """
    present, value = _get(body, name, default)
    if not present:
        return value
    if not isinstance(value, str) or len(value) > max_chars:
        raise RecordError(f"field {name!r} must be a string of at most {max_chars} characters, "
                          f"got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A bounded rendering of a parsed value for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


__all__ = ["INT64_LIMIT", "MAX_DEPTH", "MAX_INT_DIGITS", "RecordError", "UNIX_TIME_LIMIT_S",
           "int_field", "number_field", "parse_json", "str_field"]
