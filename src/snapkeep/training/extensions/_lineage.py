"""The run lineage of a manager (:class:`snapkeep.store.RunLineage`, guarding against pointing
a new experiment at an old output directory), shared by the snapshot extensions of one manager,
and how the extensions find each other on it.
"""

from __future__ import annotations

import logging
from typing import Any

from snapkeep.store import RunLineage

logger = logging.getLogger(__name__)

LINEAGE_ATTRIBUTE = "_snapkeep_run_lineage"
"""Manager attribute holding the :class:`RunLineage` shared by its snapshot extensions."""

SNAPSHOT_MARKER = "_snapkeep_snapshot_extension"
"""Class attribute set on snapkeep's snapshot extensions (found without importing them)."""


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
