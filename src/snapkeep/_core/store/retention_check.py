"""The retention input check a trainer makes before a snapshot is saved.

Retention runs after the commit, possibly on a writer thread, where a failure is only logged
(DESIGN invariant 5). A :class:`~snapkeep.retention.KeepBest` metric that no manifest records
(``val/loss`` where the observation holds ``val_loss``) is a configuration error, not an I/O
failure: it would make retention delete the best snapshots. So the snapshot extension checks the
policy here, in the trainer thread, before the save whose retention would delete anything, and
raises the :class:`ValueError` of :func:`snapkeep.retention.check_metrics` to the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from snapkeep._core.store.contract import StoreKind
from snapkeep._core.store.retention import (
    RetentionPolicy,
    SnapshotInfo,
    best_metrics,
    plan_deletions,
)


class MetricCheck:
    """Checks ``policy``'s ``KeepBest`` metrics until a snapshot records each of them.

    Until then, each save lists the template's snapshots once (their manifests' metrics);
    afterwards the check costs nothing.
    """

    def __init__(self, policy: RetentionPolicy | None) -> None:
        self._policy = policy
        self._pending = best_metrics(policy) if policy is not None else []
        self._saved: dict[str, SnapshotInfo] = {}  # this process's saves, maybe still in flight

    def before_save(
        self, store: StoreKind, lineage: frozenset[str | None], name: str, step: int,
        metrics: Mapping[str, float],
    ) -> None:
        """Call in the trainer thread before saving snapshot ``name`` (iteration ``step``) with
        ``metrics``; ``store`` is either kind (single files, or sharded directories on rank 0).

        Raises:
            ValueError: after this save, retention would delete a snapshot while a ``KeepBest``
                metric is recorded by none of this run's snapshots (this one and those still
                being written included). Nothing is written or deleted.
        """
        if not self._pending or self._policy is None:
            return
        infos = dict(self._saved)
        this = SnapshotInfo(name=name, key=(float(step), math.inf), step=step,
                            metrics=dict(metrics))
        infos[name] = this
        if any(m not in metrics for m in self._pending):
            for entry in store.entries():
                manifest = store.manifest(entry)
                if (manifest.run_id if manifest else None) not in lineage:
                    continue
                infos.setdefault(entry.name, SnapshotInfo(
                    name=entry.name, key=entry.key, step=entry.step,
                    metrics=dict(manifest.metrics) if manifest else {}))
            plan_deletions(self._policy, list(infos.values()))  # raises ValueError when it must
        self._pending = [m for m in self._pending
                         if not any(m in i.metrics for i in infos.values())]
        if self._pending:  # the next check counts this save even while it is in flight
            self._saved[name] = this
        else:
            self._saved.clear()
