"""The run lineage of a manager (:class:`snapkeep.session.RunLineage`, guarding against pointing
a new experiment at an old output directory), shared by the snapshot extensions of one manager,
and how the extensions find each other on it: :func:`registered_extensions` is the one place
that reads a manager's registry (snapkeep's manager and ppe's keep it in ``_extensions``, and
ppe's has no public listing); the snapshot and memory-tier extensions carry a class marker, so
they are found without importing each other.
"""

from __future__ import annotations

import logging
from typing import Any

from snapkeep.session import RunLineage

logger = logging.getLogger(__name__)

LINEAGE_ATTRIBUTE = "_snapkeep_run_lineage"
"""Manager attribute holding the :class:`RunLineage` shared by its snapshot extensions."""

SNAPSHOT_MARKER = "_snapkeep_snapshot_extension"
"""Class attribute set on snapkeep's snapshot extensions (found without importing them)."""

MEMORY_TIER_MARKER = "_snapkeep_memory_tier"
"""Class attribute set on the memory-tier extension (found without importing it)."""


def registered_extensions(manager: Any) -> list[Any]:
    """The extensions registered on ``manager`` (snapkeep's ``ExtensionsManager`` or ppe's), in
    registration order; empty for an object without a registry."""
    entries = getattr(manager, "_extensions", None) or {}
    return [e.extension for e in entries.values() if hasattr(e, "extension")]


def snapshot_extensions(manager: Any) -> list[Any]:
    """snapkeep's snapshot extensions registered on ``manager`` (every mode), in order."""
    return [x for x in registered_extensions(manager) if getattr(x, SNAPSHOT_MARKER, False)]


def recover_before_autoload(manager: Any) -> Any:
    """Initialize (and so recover) the manager's memory tier now, before a snapshot extension's
    autoload reads storage; the snapshot extensions call it first thing in their ``initialize``
    (the tier is registered after them, see :mod:`._memory_tier`). Returns what the tier
    restored from RAM (:class:`snapkeep.tiers.Restored`: the extension then skips its autoload)
    or None."""
    for tier in registered_extensions(manager):
        if getattr(tier, MEMORY_TIER_MARKER, False):
            tier.initialize(manager)  # once: later calls return at once
            if tier.restored is not None:
                return tier.restored
    return None


def shared_lineage(manager: Any, own: RunLineage) -> RunLineage:
    """The lineage of ``manager`` (``own`` becomes it when the manager has none yet)."""
    shared = getattr(manager, LINEAGE_ATTRIBUTE, None)
    if isinstance(shared, RunLineage):
        return shared
    setattr(manager, LINEAGE_ATTRIBUTE, own)
    return own


def has_autoloading_snapshot(manager: Any) -> bool:
    """Whether a snapshot extension of ``manager`` resumes the run (``autoload=True``)."""
    return any(getattr(x, "autoload", False) for x in snapshot_extensions(manager))
