"""What a snapshot store removes: a snapshot with its manifest (:meth:`~StoreRemoval.delete`),
what a retention policy does not keep (:meth:`~StoreRemoval.retain`, the last stage of the save
path), and what crashes leave behind (:meth:`~StoreRemoval.sweep`: stale temps and manifests whose
snapshot is gone).

:class:`StoreRemoval` is a base of :class:`~snapkeep._core.store.SnapshotStore`; the store's
``__init__`` sets the attributes it declares and the store provides the listing methods it uses.
A failed delete is logged, not raised (DESIGN 5); retention never deletes the newest snapshot, a
protected one, or one of another run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from snapkeep._core.manifest import (
    MANIFEST_DIR,
    Manifest,
    ManifestError,
    manifest_path,
    read_manifest,
)
from snapkeep._core.naming import FilenameTemplate
from snapkeep._core.retention import RetentionPolicy, SnapshotInfo, plan_deletions
from snapkeep._core.storage import Storage

if TYPE_CHECKING:
    from snapkeep._core.store import Entry

logger = logging.getLogger(__name__)


class StoreRemoval:
    """Deletion, retention and sweeping of one store's files (see the module docstring).

    Attributes (set by the store's ``__init__``):
        storage: where the snapshots live.
        directory: the output directory on ``storage``.
        template: the filename template.
        _committed: paths this process committed (retention treats them as this run's).
    """

    storage: Storage
    directory: str
    template: FilenameTemplate
    _committed: set[str]

    if TYPE_CHECKING:
        def entries(self) -> list[Entry]: ...

        def manifest(self, entry: Entry) -> Manifest | None: ...

        def _subdir(self, sub: str) -> str: ...

        def _split(self) -> tuple[str, str] | None: ...

    # -- deletion and retention --------------------------------------------------------------------
    def delete(self, entry: Entry, *, by: str = "snapkeep", strict: bool = False) -> bool:
        """Delete a snapshot and then its manifest (a kill between the two leaves an orphan
        manifest, removed by :meth:`sweep`). The one delete of single-file snapshots: retention,
        ``snapkeep prune`` and the ppe file view use it. A file already gone is not an error.

        Args:
            entry: the snapshot.
            by: who deletes, for the log (``'retention'``).
            strict: raise a failed delete (``snapkeep prune`` reports it) instead of logging it
                (retention: DESIGN 5). The manifest is then kept.

        Returns:
            True when the snapshot file is gone.

        Raises:
            OSError: only with ``strict``, the snapshot could not be deleted.
        """
        gone = True
        for path in (entry.path, manifest_path(self.storage, entry.path)):
            if not gone:
                break  # the snapshot stays: so does its manifest
            try:
                self.storage.remove(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                if strict:
                    raise
                gone = gone and path != entry.path
                logger.warning("%s could not delete %s (step %s): %s", by, path, entry.step, e)
            else:
                logger.debug("deleted %s (step %s)", path, entry.step)
        self._committed.discard(entry.path)
        return gone

    def retain(
        self, policy: RetentionPolicy, lineage: frozenset[str | None] | set[str | None], *,
        protect: Sequence[str] = (),
    ) -> list[Entry]:
        """Delete what ``policy`` does not keep among the snapshots of the run ``lineage``.

        The last stage of the save path (the saver calls it after each commit, on the saver rank,
        in the trainer process). A snapshot belongs to the lineage when its manifest's run id is
        in ``lineage`` (``None`` in it: manifest-less snapshots), or when this process committed
        it (even if its manifest is missing or invalid). Snapshots of other runs are never
        deleted; neither is the newest one, nor one whose path is in ``protect``.

        Args:
            policy: a pure policy from :mod:`snapkeep.retention`.
            lineage: run ids whose snapshots may be deleted.
            protect: paths never to delete (the snapshot just committed).

        Returns:
            The entries deleted.
        """
        entries: list[Entry] = []
        infos: list[SnapshotInfo] = []
        foreign = 0
        listed = self.entries()
        for entry in listed:
            manifest = self.manifest(entry)
            ours = entry.path in self._committed
            if not ours and (manifest.run_id if manifest is not None else None) not in lineage:
                foreign += 1
                continue
            entries.append(entry)
            metrics = dict(manifest.metrics) if manifest is not None else {}
            infos.append(SnapshotInfo(name=entry.name, key=entry.key, step=entry.step,
                                      metrics=metrics))
        if foreign:
            logger.debug("retention in %s leaves %d snapshot(s) of other runs alone",
                         self.directory, foreign)
        by_name = {e.name: e for e in entries}
        keep = [e.name for e in entries if e.path in set(protect)]
        deleted = []
        for name in plan_deletions(policy, infos, protect=keep):
            entry = by_name[name]
            if self.delete(entry, by="retention"):
                deleted.append(entry)
                logger.debug("retention deleted %s (step %s)", entry.path, entry.step)
        self._remove_orphan_manifests(listed, lineage)
        return deleted

    # -- sweeping ------------------------------------------------------------------------------
    def sweep(self, lineage: frozenset[str | None] | None = None) -> list[str]:
        """Remove temporary files of crashed writers (see ``Storage.remove_stale_temps``) from
        this template's directory and its manifest directory, and manifests whose snapshot is
        gone (of run ``lineage`` only, or of any run when None); return the removed paths."""
        split = self._split()
        if split is None:
            return []
        directory = self._subdir(split[0])
        removed = self.storage.remove_stale_temps(directory)
        removed += self.storage.remove_stale_temps(self.storage.join(directory, MANIFEST_DIR))
        removed += self._remove_orphan_manifests(None, lineage)
        return removed

    def orphan_manifests(self, entries: list[Entry] | None = None) -> list[str]:
        """Paths of this template's manifests whose snapshot file is gone (a process killed
        between deleting a snapshot and deleting its manifest); ``entries`` is the current
        listing (default :meth:`entries`)."""
        split = self._split()
        if split is None:
            return []
        sub, base = split
        present = {e.name for e in (self.entries() if entries is None else entries)}
        base_template = FilenameTemplate(base)
        manifest_dir = self.storage.join(self._subdir(sub), MANIFEST_DIR)
        orphans = []
        for name in self.storage.list_names(manifest_dir):
            snapshot, dot, ext = name.rpartition(".")
            if not dot or ext != "json" or base_template.parse(snapshot) is None:
                continue
            if (f"{sub}/{snapshot}" if sub else snapshot) not in present:
                orphans.append(self.storage.join(manifest_dir, name))
        return orphans

    def _remove_orphan_manifests(
        self, listed: list[Entry] | None, lineage: frozenset[str | None] | set[str | None] | None,
    ) -> list[str]:
        """Delete orphan manifests (of ``lineage`` when given). A snapshot committed after
        ``listed`` was taken (an async writer's next one) is found by the existence check: its
        file precedes its manifest."""
        storage = self.storage
        removed = []
        for path in self.orphan_manifests(listed):
            snapshot = storage.join(storage.dirname(storage.dirname(path)),
                                    storage.basename(path)[:-len(".json")])
            try:
                if storage.exists(snapshot):
                    continue
            except OSError as e:
                logger.debug("leaving manifest %s: cannot check its snapshot (%s)", path, e)
                continue
            if lineage is not None:
                try:
                    manifest = read_manifest(storage, path)
                except (OSError, ManifestError) as e:
                    logger.debug("leaving invalid orphan manifest %s: %s", path, e)
                    continue
                if manifest is None or manifest.run_id not in lineage:
                    continue
            try:
                storage.remove(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                logger.warning("could not delete the orphan manifest %s: %s", path, e)
                continue
            removed.append(path)
            logger.info("removed manifest %s, whose snapshot was already deleted", path)
        return removed
