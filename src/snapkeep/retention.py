"""Retention policies for ``snapshot(retention=...)``: keep latest N, every K steps, best N by a
metric, or any of several. See :mod:`snapkeep._core.store.retention` for the semantics."""

from snapkeep._core.store.retention import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepLatest,
    RetentionPolicy,
    SnapshotInfo,
    best_metrics,
    check_metrics,
    keep_policy,
    plan_deletions,
)

__all__ = [
    "AnyOf", "KeepBest", "KeepEvery", "KeepLatest", "RetentionPolicy", "SnapshotInfo",
    "best_metrics", "check_metrics", "keep_policy", "plan_deletions",
]
