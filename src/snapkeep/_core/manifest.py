"""Per-snapshot manifests: the checksum and facts recorded when a snapshot commits.

A snapshot ``<dir>/<name>`` stays a plain ``torch.save`` file; its manifest is the small JSON file
``<dir>/.snapkeep/<name>.json`` committed right after it (same atomic protocol). The manifest is
what verification checks the file against. A snapshot without a manifest (written by ppe, or a crash
between the two commits) is loaded only after it reads back completely, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from snapkeep._core.checksum import ALGORITHM

MANIFEST_DIR = ".snapkeep"
#: Appended to a snapshot's name to name its manifest (counted against NAME_MAX up front).
MANIFEST_SUFFIX = ".json"
FORMAT = "snapkeep.manifest/1"


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
        metrics: observation values at save time (used by best-N retention).
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

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, **dataclasses.asdict(self)}
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse a manifest.

        Raises:
            ValueError: not a snapkeep manifest.
        """
        body = json.loads(data.decode())
        if not isinstance(body, dict) or body.pop("format", None) != FORMAT:
            raise ValueError("not a snapkeep manifest")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in fields})


class ManifestError(ValueError):
    """A manifest file exists but is not a valid snapkeep manifest."""


def read_manifest(storage: Any, path: str) -> Manifest | None:
    """The manifest at ``path`` on ``storage``; ``None`` when there is none.

    The one way manifests are read (autoload, verify, retention, CLI).

    Raises:
        ManifestError: the file is not a valid manifest (not JSON, not a snapkeep manifest, or
            a field of the wrong type); the message names ``path``.
        SnapshotStorageError: the store could not be reached.
    """
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        manifest = Manifest.from_bytes(data)
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise ManifestError(f"manifest {path}: {e}") from e
    problems = _type_problems(manifest)
    if problems:
        raise ManifestError(f"manifest {path}: {'; '.join(problems)}")
    return manifest


def _type_problems(m: Manifest) -> list[str]:
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    out = []
    if not isinstance(m.name, str):
        out.append("name must be a string")
    if not is_int(m.size_bytes) or m.size_bytes < 0:
        out.append("size_bytes must be an int >= 0")
    if not isinstance(m.checksum, str) or not isinstance(m.algorithm, str):
        out.append("checksum and algorithm must be strings")
    if m.step is not None and not is_int(m.step):
        out.append("step must be an int or null")
    if m.run_id is not None and not isinstance(m.run_id, str):
        out.append("run_id must be a string or null")
    if not isinstance(m.metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            for k, v in m.metrics.items()):
        out.append("metrics must map strings to numbers")
    return out


def manifest_path(storage: Any, snapshot_path: str) -> str:
    """Where the manifest of ``snapshot_path`` lives on ``storage``."""
    name = storage.basename(snapshot_path) + MANIFEST_SUFFIX
    return storage.join(storage.dirname(snapshot_path), MANIFEST_DIR, name)


def now_unix_s() -> float:
    return time.time()
