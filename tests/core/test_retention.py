"""Retention policies as tables: snapshots in, names to delete out (pure functions)."""

from __future__ import annotations

import math

import pytest

from snapkeep.retention import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepLatest,
    SnapshotInfo,
    best_metrics,
    check_metrics,
    plan_deletions,
)


def snaps(*steps: int, loss: dict[int, float] | None = None) -> list[SnapshotInfo]:
    loss = loss or {}
    return [
        SnapshotInfo(name=f"s_{s}", key=(float(s),), step=s,
                     metrics={"loss": loss[s]} if s in loss else {})
        for s in steps
    ]


def names(*steps: int) -> list[str]:
    return [f"s_{s}" for s in steps]


LOSS = {10: 0.9, 20: 0.3, 30: 0.5, 40: 0.1, 50: 0.7}

TABLE = [
    # (id, policy, snapshots, protect, expected deletions oldest first)
    ("latest-none", KeepLatest(3), snaps(), (), []),
    ("latest-fewer", KeepLatest(3), snaps(1, 2), (), []),
    ("latest-3-of-5", KeepLatest(3), snaps(1, 2, 3, 4, 5), (), names(1, 2)),
    ("latest-1", KeepLatest(1), snaps(1, 2, 3), (), names(1, 2)),
    ("latest-unordered-input", KeepLatest(2), snaps(5, 1, 3), (), names(1)),
    ("latest-by-step-not-name", KeepLatest(1), snaps(999, 1000), (), names(999)),
    ("every-10", KeepEvery(10), snaps(5, 10, 15, 20, 25), (), names(5, 15)),
    ("every-newest-kept-anyway", KeepEvery(10), snaps(10, 15, 17), (), names(15)),
    ("every-step-0", KeepEvery(3), snaps(0, 1, 2, 3), (), names(1, 2)),
    ("best-2-min", KeepBest(2, "loss"), snaps(10, 20, 30, 40, 50, loss=LOSS), (),
     names(10, 30)),
    ("best-2-max", KeepBest(2, "loss", "max"), snaps(10, 20, 30, 40, 50, loss=LOSS), (),
     names(20, 30, 40)),
    ("best-missing-metric-never-best", KeepBest(1, "loss"),
     snaps(10, 20, 30, loss={20: 0.5, 30: 0.9}), (), names(10)),
    ("best-nan-never-best", KeepBest(1, "loss"),
     snaps(10, 20, 30, loss={10: math.nan, 20: 0.5, 30: 0.9}), (), names(10)),
    ("best-tie-newer-wins", KeepBest(1, "loss"),
     snaps(10, 20, 30, loss={10: 0.5, 20: 0.5, 30: 0.9}), (), names(10)),
    ("best-no-metrics-nothing-to-delete", KeepBest(2, "loss"), snaps(1), (), []),
    ("best-metric-on-one-snapshot-enough", KeepBest(1, "loss"),
     snaps(1, 2, 3, loss={1: 0.5}), (), names(2)),
    ("anyof-latest-or-best", AnyOf(KeepLatest(1), KeepBest(1, "loss")),
     snaps(10, 20, 30, 40, 50, loss=LOSS), (), names(10, 20, 30)),
    ("anyof-every-or-latest", AnyOf(KeepEvery(20), KeepLatest(2)),
     snaps(10, 20, 30, 40, 50), (), names(10, 30)),
    ("anyof-single", AnyOf(KeepLatest(2)), snaps(1, 2, 3), (), names(1)),
    ("protect-kept", KeepLatest(1), snaps(1, 2, 3), ("s_1",), names(2)),
]


@pytest.mark.parametrize(("policy", "snapshots", "protect", "expected"),
                         [t[1:] for t in TABLE], ids=[t[0] for t in TABLE])
def test_plan_deletions(policy, snapshots, protect, expected):
    assert plan_deletions(policy, snapshots, protect=protect) == expected


class KeepNothing:
    def select(self, snapshots):
        return set()


@pytest.mark.parametrize("steps", [(1,), (1, 2, 3), (7, 3, 5)])
def test_the_newest_is_never_deleted(steps):
    deleted = plan_deletions(KeepNothing(), snaps(*steps))
    assert f"s_{max(steps)}" not in deleted
    assert len(deleted) == len(steps) - 1


def test_select_is_pure_and_order_independent():
    s = snaps(10, 20, 30, 40, 50, loss=LOSS)
    policy = AnyOf(KeepLatest(2), KeepEvery(20), KeepBest(1, "loss"))
    first = policy.select(s)
    assert policy.select(list(reversed(s))) == first == {"s_20", "s_40", "s_50"}
    assert s == snaps(10, 20, 30, 40, 50, loss=LOSS)


def test_multi_field_keys_order_by_iteration_first():
    s = [SnapshotInfo(name=f"e{e}_i{i}", key=(float(i), float(e)), step=i)
         for e, i in ((2, 10), (1, 5), (3, 15))]
    assert plan_deletions(KeepLatest(1), s) == ["e1_i5", "e2_i10"]


BAD = [
    (lambda: KeepLatest(0), ValueError, "KeepLatest.n"),
    (lambda: KeepLatest(True), ValueError, "KeepLatest.n"),
    (lambda: KeepLatest(2.0), ValueError, "KeepLatest.n"),
    (lambda: KeepEvery(0), ValueError, "KeepEvery.every_steps"),
    (lambda: KeepBest(0, "loss"), ValueError, "KeepBest.n"),
    (lambda: KeepBest(1, "loss", "median"), ValueError, "KeepBest.mode"),
    (lambda: KeepBest(1, ""), ValueError, "KeepBest.metric"),
    (lambda: AnyOf(), ValueError, "at least one"),
    (lambda: AnyOf(KeepLatest(1), "latest"), TypeError, "not a retention policy"),
]


@pytest.mark.parametrize(("make", "error", "match"), BAD, ids=[b[2] + str(i) for i, b in
                                                              enumerate(BAD)])
def test_bad_arguments_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


# -- a KeepBest metric no manifest records is refused before anything is deleted ---------------

MISSING = [
    # (id, policy, snapshots, the message names)
    ("typo-alone", KeepBest(2, "val/loss"), snaps(1, 2, 3, loss={1: 0.5, 2: 0.4}),
     ["'val/loss'", "'loss'"]),
    ("typo-inside-anyof", AnyOf(KeepLatest(1), KeepBest(1, "val/loss")),
     snaps(1, 2, 3, loss={1: 0.5}), ["'val/loss'", "'loss'"]),
    ("no-metrics-at-all", KeepBest(2, "loss"), snaps(1, 2, 3), ["'loss'", "record: none"]),
]


@pytest.mark.parametrize(("policy", "snapshots", "named"), [m[1:] for m in MISSING],
                         ids=[m[0] for m in MISSING])
def test_missing_best_metric_is_a_value_error_naming_the_recorded_ones(policy, snapshots, named):
    with pytest.raises(ValueError, match="recorded by none of the 3 snapshot") as info:
        plan_deletions(policy, snapshots)
    for text in named:
        assert text in str(info.value)
    with pytest.raises(ValueError, match="Nothing was deleted"):
        check_metrics(policy, snapshots)


def test_missing_metric_with_nothing_to_delete_plans_nothing_but_check_refuses():
    policy = AnyOf(KeepLatest(5), KeepBest(1, "val/loss"))
    assert plan_deletions(policy, snaps(1, 2, 3)) == []
    with pytest.raises(ValueError, match="'val/loss'"):
        check_metrics(policy, snaps(1, 2, 3))
    check_metrics(policy, [])  # nothing committed yet: nothing to check


def test_best_metrics_of_nested_policies():
    policy = AnyOf(KeepBest(1, "a"), AnyOf(KeepLatest(1), KeepBest(2, "b"), KeepBest(3, "a")))
    assert best_metrics(policy) == ["a", "b"]
    assert best_metrics(KeepLatest(1)) == []
