"""Retention policies: pure functions from the committed snapshots to the ones to keep.

A policy's ``select(snapshots)`` gets every committed snapshot of one template, oldest first, and
returns the names to keep. The caller (:func:`plan_deletions`) always adds the newest snapshot, so
no policy can delete it. Metrics for best-N come from the manifests recorded at commit, so the
best snapshots are still known after a restart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotInfo:
    """What a policy may look at.

    Attributes:
        name: file name relative to the output directory.
        key: sort key parsed from the name (iteration first).
        step: iteration (first key number) or None.
        metrics: values from ``manager.observation`` recorded at commit (may be empty).
    """

    name: str
    key: tuple[float, ...]
    step: int | None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class RetentionPolicy(Protocol):
    """``select(snapshots)`` -> names to keep. Called on the saver rank after each commit, in the
    trainer process; must be pure (no I/O) so it can be tested as a table."""

    def select(self, snapshots: Sequence[SnapshotInfo]) -> set[str]:
        ...


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class KeepLatest:
    """Keep the newest ``n`` snapshots by step (ppe's ``n_retains``)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "KeepLatest.n")

    def select(self, snapshots: Sequence[SnapshotInfo]) -> set[str]:
        ordered = sorted(snapshots, key=lambda s: (s.key, s.name))
        return {s.name for s in ordered[-self.n:]}


@dataclasses.dataclass(frozen=True)
class KeepEvery:
    """Keep every snapshot whose step is a multiple of ``every_steps`` (e.g. 1000)."""

    every_steps: int

    def __post_init__(self) -> None:
        _positive_int(self.every_steps, "KeepEvery.every_steps")

    def select(self, snapshots: Sequence[SnapshotInfo]) -> set[str]:
        return {s.name for s in snapshots if s.step is not None and s.step % self.every_steps == 0}


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` snapshots with the best ``metric`` (``mode='min'`` or ``'max'``).

    Snapshots without the metric (or with NaN) never count as best.
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _positive_int(self.n, "KeepBest.n")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest.metric must be a non-empty str, got {self.metric!r}")

    def select(self, snapshots: Sequence[SnapshotInfo]) -> set[str]:
        scored = [
            s for s in snapshots
            if isinstance(s.metrics.get(self.metric), (int, float))
            and not math.isnan(float(s.metrics[self.metric]))
        ]
        sign = 1.0 if self.mode == "min" else -1.0
        # ties: the newer snapshot wins
        scored.sort(key=lambda s: (sign * float(s.metrics[self.metric]), tuple(-k for k in s.key)))
        return {s.name for s in scored[: self.n]}


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """Keep a snapshot when any of ``policies`` keeps it."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("AnyOf needs at least one policy")
        for p in policies:
            if not callable(getattr(p, "select", None)):
                raise TypeError(f"AnyOf: {p!r} is not a retention policy (no select method)")
        object.__setattr__(self, "policies", tuple(policies))

    def select(self, snapshots: Sequence[SnapshotInfo]) -> set[str]:
        keep: set[str] = set()
        for p in self.policies:
            keep |= p.select(snapshots)
        return keep


def best_metrics(policy: object) -> list[str]:
    """The metric names the :class:`KeepBest` policies in ``policy`` rank by (inside
    :class:`AnyOf` too), in order, without repeats; ``[]`` for other policies."""
    if isinstance(policy, KeepBest):
        return [policy.metric]
    found: list[str] = []
    for inner in getattr(policy, "policies", ()) if isinstance(policy, AnyOf) else ():
        found.extend(m for m in best_metrics(inner) if m not in found)
    return found


def check_metrics(policy: RetentionPolicy, snapshots: Sequence[SnapshotInfo]) -> None:
    """Refuse a :class:`KeepBest` metric that none of ``snapshots`` records.

    Such a policy keeps nothing, so retention would delete the very snapshots it was meant to
    keep (a typo such as ``val/loss`` for ``val_loss``). Checked before anything is deleted.

    Args:
        policy: the retention policy.
        snapshots: the committed snapshots (their manifests' metrics). With none, nothing is
            checked.

    Raises:
        ValueError: a ``KeepBest`` metric is recorded by no snapshot; the message names the
            metrics the snapshots do record.
    """
    if not snapshots:
        return
    recorded = sorted({name for s in snapshots for name in s.metrics})
    missing = [m for m in best_metrics(policy) if not any(m in s.metrics for s in snapshots)]
    if not missing:
        return
    listed = ", ".join(repr(m) for m in recorded) if recorded else "none"
    raise ValueError(
        f"KeepBest metric {', '.join(repr(m) for m in missing)} is recorded by none of the "
        f"{len(snapshots)} snapshot manifest(s); the metrics they record: {listed}. Nothing "
        "was deleted. Metrics come from manager.observation at save time (finite numbers only), "
        "or Checkpointer.save(..., metrics={...})")


def plan_deletions(
    policy: RetentionPolicy, snapshots: Sequence[SnapshotInfo], *, protect: Sequence[str] = (),
) -> list[str]:
    """Names to delete: not kept by ``policy``, not the newest, not in ``protect``; oldest first.

    Raises:
        ValueError: something would be deleted while a :class:`KeepBest` metric is recorded by
            none of ``snapshots`` (see :func:`check_metrics`); nothing is planned then.
    """
    if not snapshots:
        return []
    ordered = sorted(snapshots, key=lambda s: (s.key, s.name))
    keep = set(policy.select(ordered)) | {ordered[-1].name} | set(protect)
    doomed = [s.name for s in ordered if s.name not in keep]
    if doomed:
        check_metrics(policy, ordered)
    return doomed


def keep_policy(keep: object) -> RetentionPolicy | None:
    """A door's ``keep`` argument as a policy: an int N keeps the newest N by step (Orbax's
    ``max_to_keep``, ppe's ``n_retains``), a policy is itself, ``None`` keeps everything.

    Raises:
        TypeError: ``keep`` is none of these (a bool included).
        ValueError: an int below 1.
    """
    if keep is None:
        return None
    if isinstance(keep, bool) or not (isinstance(keep, int) or callable(getattr(keep, "select",
                                                                                None))):
        raise TypeError(f"keep must be an int >= 1, a policy from snapkeep.retention, or None, "
                        f"got {keep!r}")
    if isinstance(keep, int):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (None keeps all), got {keep}")
        return KeepLatest(keep)
    policy: RetentionPolicy = keep  # type: ignore[assignment]
    return policy

