"""Per-snapshot manifests: the checksum and facts recorded when a snapshot commits.

A snapshot ``<dir>/<name>`` stays a plain ``torch.save`` file; its manifest is the small JSON file
``<dir>/.snapkeep/<name>.json`` committed right after it (same atomic protocol). The manifest is
what verification checks the file against. A snapshot without a manifest (written by ppe, or a crash
between the two commits) is loaded only after it reads back completely, with a warning.

Manifests are untrusted input: :func:`read_manifest` reads at most :data:`MAX_MANIFEST_BYTES` from a
regular file only (a FIFO, device or directory is refused without blocking) and validates the
versioned schema (:data:`FORMAT`): the type and size of every field, the checksum's format, a
non-negative size. Anything else is a :class:`ManifestError`, never a bare ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import types
import typing
from typing import Any

from snapkeep._core.errors import ManifestError, SnapshotStorageError
from snapkeep._core.format.checksum import ALGORITHM
from snapkeep._core.format.json_records import INT64_LIMIT, RecordError, parse_json

MANIFEST_DIR = ".snapkeep"
#: Appended to a snapshot's name to name its manifest (counted against NAME_MAX up front).
MANIFEST_SUFFIX = ".json"
#: Schema name and major version; a manifest of another major version is refused (unknown fields
#: of this version are ignored, so later minor additions stay readable).
FORMAT = "snapkeep.manifest/1"
#: Largest manifest read, in bytes (a real one is well under 4 KiB).
MAX_MANIFEST_BYTES = 1 << 20
#: Largest string field, in characters, and most entries in ``metrics``.
MAX_STRING_CHARS = 4096
MAX_METRICS = 1024
#: Most blobs one incremental snapshot's manifest may list.
MAX_BLOBS = 1 << 16
#: Hex digest length of each supported checksum algorithm.
CHECKSUM_HEX_CHARS = {"xxh3_128": 32}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """Facts about one committed snapshot.

    Attributes:
        name: file name relative to its directory.
        size_bytes: size of the committed file in bytes.
        checksum: hex digest of the whole file (``algorithm``).
        algorithm: checksum algorithm, ``'xxh3_128'``.
        step: training iteration of the snapshot, when known.
        created_unix_s: commit time (seconds since the epoch), informational only; never used to
            order snapshots.
        snapkeep_version: version that wrote it.
        run_id: identity of the training run lineage that wrote it (inherited on resume).
        metrics: observation values at save time (used by best-N retention); finite numbers
            only: JSON has no NaN or Infinity, so a non-finite value is left out of the file
            when it is written and dropped when an older file holding one is read.
        blobs: an incremental snapshot's blobs (:mod:`snapkeep._core.tiers.incremental`): the
            XXH3-128 digest (the blob's name) -> its size in bytes; empty for a plain file.
            What retention counts before it deletes a blob.
        blob_area: where those blobs are, relative to the snapshot's directory
            (``'.snapkeep/blobs/<template key>'``); empty for a plain file.
        door: the front door whose state layout the snapshot holds (``'checkpointer'``,
            ``'ppe'``, ``'lightning'``; empty: not recorded, e.g. written by an earlier
            snapkeep or by a writer called directly). A door's resume skips, naming
            it, a snapshot recording another door (:meth:`Session.own
            <snapkeep._core.session.session.Session.own>`).
    """

    name: str
    size_bytes: int
    checksum: str
    algorithm: str = ALGORITHM
    step: int | None = None
    created_unix_s: float = 0.0
    snapkeep_version: str = ""
    run_id: str | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    blobs: dict[str, int] = dataclasses.field(default_factory=dict)
    blob_area: str = ""
    door: str = ""

    def to_bytes(self) -> bytes:
        """The manifest as strict JSON (UTF-8; never ``NaN`` or ``Infinity``, which other JSON
        readers and ``snapkeep ls --json`` refuse: non-finite metrics are left out)."""
        body = {"format": FORMAT, **dataclasses.asdict(self)}
        body["metrics"] = finite_metrics(self.metrics)
        if not self.blobs:  # a plain file's manifest stays as before incremental snapshots
            del body["blobs"], body["blob_area"]
        if not self.door:  # not recorded: the file stays as before doors were recorded
            del body["door"]
        return json.dumps(body, sort_keys=True, indent=1, allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "manifest") -> Manifest:
        """Parse and validate a manifest (see the module docstring for the schema).

        Args:
            data: the file's bytes.
            source: what to call it in errors (its path).

        Raises:
            ManifestError: not valid UTF-8 JSON, not a ``snapkeep.manifest/1`` object, a required
                field missing, or a field of the wrong type, size or format (the field named).
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{source}: {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte "
                                "limit of a manifest")
        try:  # bounded (depth, numbers, strings); NaN metrics of older files are dropped below
            body = parse_json(data, max_bytes=MAX_MANIFEST_BYTES, allow_nan=True)
        except RecordError as e:
            raise ManifestError(f"{source}: not valid UTF-8 JSON ({e})") from None
        if not isinstance(body, dict):
            raise ManifestError(f"{source}: a JSON {type(body).__name__}, not an object")
        found = body.pop("format", None)
        if found != FORMAT:
            raise ManifestError(f"{source}: format {found!r}, this snapkeep reads {FORMAT!r}")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name not in body:
                if field.default is dataclasses.MISSING and \
                        field.default_factory is dataclasses.MISSING:
                    raise ManifestError(f"{source}: required field {field.name!r} is missing")
                continue
            value = body[field.name]
            problem = _type_problem(value, hints[field.name],
                                    MAX_BLOBS if field.name == "blobs" else MAX_METRICS)
            if problem is not None:
                raise ManifestError(f"{source}: field {field.name!r} {problem}")
            values[field.name] = value
        if "metrics" in values:  # Python's json reads NaN/Infinity; older snapkeep wrote them
            values["metrics"] = finite_metrics(values["metrics"])
        manifest = cls(**values)
        manifest._check_values(source)
        return manifest

    def _check_values(self, source: str) -> None:
        """Constraints beyond types (see :meth:`from_bytes`)."""
        if not self.name or "/" in self.name or "\0" in self.name:
            raise ManifestError(f"{source}: field 'name' {self.name!r} is not a file name")
        if not 0 <= self.size_bytes < INT64_LIMIT:
            raise ManifestError(f"{source}: field 'size_bytes' is out of range [0, 2**63) "
                                f"({self.size_bytes})")
        hex_chars = CHECKSUM_HEX_CHARS.get(self.algorithm)
        if hex_chars is None:
            raise ManifestError(f"{source}: field 'algorithm' {self.algorithm!r} is not one of "
                                f"{sorted(CHECKSUM_HEX_CHARS)}")
        if not re.fullmatch(f"[0-9a-f]{{{hex_chars}}}", self.checksum):
            raise ManifestError(f"{source}: field 'checksum' {self.checksum[:80]!r} is not "
                                f"{hex_chars} lowercase hex digits ({self.algorithm})")
        if self.step is not None and not 0 <= self.step < INT64_LIMIT:
            raise ManifestError(f"{source}: field 'step' is out of range [0, 2**63) "
                                f"({self.step})")
        if not math.isfinite(self.created_unix_s):
            raise ManifestError(f"{source}: field 'created_unix_s' is not finite")
        area = self.blob_area.split("/")
        if self.blob_area and (len(area) != 3 or area[:2] != [MANIFEST_DIR, "blobs"]
                               or area[2] in ("", ".", "..")):
            raise ManifestError(f"{source}: field 'blob_area' {self.blob_area[:80]!r} is not "
                                f"under {MANIFEST_DIR}/blobs")
        for digest, nbytes in self.blobs.items():
            if not re.fullmatch("[0-9a-f]{32}", digest) or not 0 <= nbytes < INT64_LIMIT:
                raise ManifestError(f"{source}: field 'blobs' entry {digest[:80]!r}: "
                                    f"{nbytes} is not a blob digest and size")


def finite_metrics(metrics: typing.Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``metrics`` that are finite numbers (``bool`` excluded), as floats.

    What a manifest records: a metric that is NaN or infinite (a diverged loss) says nothing
    best-N retention can rank, and JSON cannot hold it.
    """
    finite = {}
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        try:
            number = float(value)  # an integer beyond float's range overflows
        except OverflowError:
            continue
        if math.isfinite(number):
            finite[str(key)] = number
    return finite


def manifest_path(storage: Any, snapshot_path: str) -> str:
    """Where the manifest of ``snapshot_path`` lives on ``storage``."""
    name = storage.basename(snapshot_path) + MANIFEST_SUFFIX
    return storage.join(storage.dirname(snapshot_path), MANIFEST_DIR, name)


def now_unix_s() -> float:
    return time.time()


def _type_problem(value: Any, hint: Any, max_entries: int = MAX_METRICS) -> str | None:
    """Why ``value`` (parsed JSON) does not fit the annotation ``hint``; None when it does.

    Handles what manifest fields use: str, int, float, bool, None, unions and ``dict[str, X]``;
    ``bool`` is never accepted for a number, and strings and dicts are bounded in size.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, arg) for arg in typing.get_args(hint)]
        if any(p is None for p in problems):
            return None
        return f"is {_json_type(value)}, expected {_describe(hint)}"
    if hint is type(None):
        return None if value is None else f"is {_json_type(value)}, expected null"
    if hint is bool:
        return None if isinstance(value, bool) else f"is {_json_type(value)}, expected a boolean"
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return None
        return f"is {_json_type(value)}, expected an integer"
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"is {_json_type(value)}, expected a number"
        try:
            float(value)
        except OverflowError:
            return "is an integer beyond the range of a float"
        return None
    if hint is str:
        if not isinstance(value, str):
            return f"is {_json_type(value)}, expected a string"
        if len(value) > MAX_STRING_CHARS:
            return f"is a string of {len(value)} characters, over {MAX_STRING_CHARS}"
        return None
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            return f"is {_json_type(value)}, expected an object"
        if len(value) > max_entries:
            return f"has {len(value)} entries, over {max_entries}"
        for key, item in value.items():
            problem = _type_problem(key, key_hint) or _type_problem(item, value_hint)
            if problem is not None:
                return f"entry {str(key)[:80]!r} {problem}"
        return None
    if hint is Any:
        return None
    return f"has a type this snapkeep cannot check ({hint!r})"


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _describe(hint: Any) -> str:
    return " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a))
                       for a in typing.get_args(hint))


def read_manifest(storage: Any, path: str) -> Manifest | None:
    """Read and validate the manifest at ``path`` on ``storage``.

    Reads at most :data:`MAX_MANIFEST_BYTES` and only from a regular file (a symlink to one is
    followed): a FIFO, device, socket or directory is refused at once, never opened for a
    blocking read.

    Returns:
        The manifest, or ``None`` when there is no file at ``path``.

    Raises:
        ManifestError: the file is not a regular file, is too large, or fails validation (see
            :meth:`Manifest.from_bytes`); the message names ``path``.
        SnapshotStorageError: the store could not be reached (says nothing about the manifest).
    """
    try:
        data = storage.read_bytes(path, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    except SnapshotStorageError:
        raise
    except OSError as e:
        raise ManifestError(f"manifest {path}: {e}") from e
    return Manifest.from_bytes(data, source=f"manifest {path}")
