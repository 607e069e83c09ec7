"""Run lineage of the snapshot extension (guards against pointing a new experiment at an old
output directory).

Each extension instance has a ``run_id`` that is recorded in every snapshot's manifest.
``autoload`` adopts the run id of the snapshot it resumes from (for a manifest-less snapshot, that
of the newest older snapshot with a manifest, and the manifest-less files join the lineage), so a
resumed run keeps one id across restarts. Retention only ever deletes snapshots of the current
lineage (and files this process committed, even when their manifest is missing); snapshots of any
other run (or manifest-less ones, unless resumed from) are kept. One lineage is shared by the
snapshot extensions of one manager.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

from snapkeep.store import Entry, SnapshotStore, warn_user

logger = logging.getLogger(__name__)

LINEAGE_ATTRIBUTE = "_snapkeep_run_lineage"
"""Manager attribute holding the :class:`RunLineage` shared by its snapshot extensions."""

SNAPSHOT_MARKER = "_snapkeep_snapshot_extension"
"""Class attribute set on snapkeep's snapshot extensions (found without importing them)."""


@dataclasses.dataclass
class RunLineage:
    """The run id written into manifests and the ids whose snapshots retention may delete;
    shared by the snapshot extensions of one manager."""

    run_id: str
    members: frozenset[str | None]

    @classmethod
    def fresh(cls) -> RunLineage:
        run_id = uuid.uuid4().hex[:16]
        return cls(run_id=run_id, members=frozenset({run_id}))

    def adopt(self, store: SnapshotStore, candidates: list[Entry], loaded: Entry) -> None:
        """Continue the lineage of the snapshot ``loaded`` (see the module docstring)."""
        older = [e for e in candidates if e.key <= loaded.key]
        lineage: set[str | None] = set()
        for entry in reversed(older):
            manifest = store.manifest(entry)
            run_id = manifest.run_id if manifest is not None else None
            if run_id is None:
                lineage.add(None)  # a manifest-less (ppe) snapshot we resumed through
                continue
            self.run_id = run_id
            break
        lineage.add(self.run_id)
        # union: another extension of this manager may have resumed (and adopted) already; the
        # fresh id of this process wrote nothing yet, so keeping it deletes nothing extra
        self.members = frozenset(lineage | self.members)


def shared_lineage(manager: Any, own: RunLineage) -> RunLineage:
    """The lineage of ``manager`` (``own`` becomes it when the manager has none yet)."""
    shared = getattr(manager, LINEAGE_ATTRIBUTE, None)
    if isinstance(shared, RunLineage):
        return shared
    setattr(manager, LINEAGE_ATTRIBUTE, own)
    return own


def has_autoloading_snapshot(manager: Any) -> bool:
    """Whether a snapshot extension of ``manager`` resumes the run (``autoload=True``)."""
    entries = getattr(manager, "_extensions", {})
    return any(getattr(getattr(e, "extension", None), SNAPSHOT_MARKER, False)
               and getattr(e.extension, "autoload", False) for e in entries.values())


def warn_about_existing(store: SnapshotStore, run_id: str) -> None:
    """``autoload=False`` beside existing snapshots of the template: say so, once."""
    entries = store.entries()
    if not entries:
        return
    run_ids = sorted({str(m.run_id) if (m := store.manifest(e)) else "unknown"
                      for e in entries})
    message = (
        f"{store.directory!r} already holds {len(entries)} snapshot(s) of "
        f"{store.template.template!r} (steps {entries[0].step}..{entries[-1].step}, run ids "
        f"{', '.join(run_ids[:5])}) and autoload=False: this run (run id {run_id}) "
        "starts fresh. Retention will not delete them, but a snapshot of this run with the "
        "same name replaces the old file; use another out_dir or autoload=True to resume.")
    warn_user(message, UserWarning)  # once, at the user's call site; no duplicate log line
