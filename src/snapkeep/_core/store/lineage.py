"""Run lineage: which snapshots of a template belong to the training that writes them now.

Each trainer (a snapshot extension's manager, a Checkpointer) has a ``run_id`` recorded in every
snapshot's manifest. A resume adopts the run id of the snapshot it resumed from (for a
manifest-less snapshot, that of the newest older snapshot with a manifest, and the manifest-less
files join the lineage), so a resumed run keeps one id across restarts. Retention only ever
counts and deletes snapshots of the current lineage (and files this process committed, even when
their manifest is missing); snapshots of any other run, and manifest-less files that were not
resumed through (junk, another tool's files named like snapshots) are never counted or deleted.
"""

from __future__ import annotations

import dataclasses
import uuid

from snapkeep._core.store.files import Entry, SnapshotStore
from snapkeep._core.user_warnings import warn_user


@dataclasses.dataclass
class RunLineage:
    """The run id written into manifests and the ids whose snapshots retention may delete.

    Attributes:
        run_id: 16 hex digits, recorded in each manifest this run commits.
        members: run ids (``None``: manifest-less snapshots resumed through) of this lineage.
    """

    run_id: str
    members: frozenset[str | None]

    @classmethod
    def named(cls, run_id: str) -> RunLineage:
        """The lineage of every run with this fixed id (the plain-loop Checkpointer's
        ``'checkpointer'``: a directory is one run, as Orbax's ``max_to_keep`` counts it, while
        snapshots of other runs, such as a manager's, and files without a manifest are never
        counted nor deleted)."""
        return cls(run_id=run_id, members=frozenset({run_id}))

    @classmethod
    def fresh(cls) -> RunLineage:
        """A new lineage with a random run id (a first run)."""
        run_id = uuid.uuid4().hex[:16]
        return cls(run_id=run_id, members=frozenset({run_id}))

    def adopt(self, store: SnapshotStore, candidates: list[Entry], loaded: Entry) -> None:
        """Continue the lineage of the snapshot ``loaded`` (see the module docstring); reads
        the manifests of ``candidates`` at or before it, newest first, until one has a run
        id."""
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
        # union: another door of this trainer may have resumed (and adopted) already; the fresh
        # id of this process wrote nothing yet, so keeping it deletes nothing extra
        self.members = frozenset(lineage | self.members)

    def continue_run(self, run_id: str | None) -> None:
        """Continue the run ``run_id`` (a sharded snapshot's marker records it): it becomes
        this lineage's id and a member. ``None`` (a marker without one) changes nothing."""
        if run_id is not None:
            self.run_id = run_id
            self.members = frozenset(self.members | {run_id})


def warn_about_existing(store: SnapshotStore, run_id: str) -> None:
    """A trainer that does not resume beside existing snapshots of its template: say so, once
    (a ``UserWarning`` at the user's call site)."""
    entries = store.entries()
    if not entries:
        return
    run_ids = sorted({str(m.run_id) if (m := store.manifest(e)) else "unknown"
                      for e in entries})
    message = (
        f"{store.directory!r} already holds {len(entries)} snapshot(s) of "
        f"{store.template.text!r} (steps {entries[0].step}..{entries[-1].step}, run ids "
        f"{', '.join(run_ids[:5])}) and autoload=False: this run (run id {run_id}) "
        "starts fresh. Retention will not delete them, but a snapshot of this run with the "
        "same name replaces the old file; use another output directory or autoload=True to "
        "resume.")
    warn_user(message, UserWarning)  # once, at the user's call site; no duplicate log line
