"""Ranks agree on what to resume (DISTRIBUTED mode, node-local directories): they resume
together at the newest step the saver rank verifies, fall back together, or fail together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed
from ranks import run

WORKER = Path(__file__).with_name("agreement_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("agree")
    run(WORKER, 2, [str(base / "init"), str(base)], timeout_s=120)
    return [json.loads((base / f"report_rank{r}.json").read_text()) for r in range(2)]


def test_only_the_saver_ranks_node_local_disk_holds_snapshots(by_rank):
    assert by_rank[0]["listing"] == [".snapkeep", "snapshot_iter_1", "snapshot_iter_2",
                                     "snapshot_iter_3"]
    assert by_rank[1]["listing"] == []


def test_every_rank_resumes_the_newest_step_even_without_its_own_copy(by_rank):
    trained = by_rank[0]["trained"]
    for report in by_rank:
        assert report["newest"]["loaded"] == "snapshot_iter_3", report["newest"]
        assert report["newest"]["iteration"] == 3
        assert report["newest"]["weight"] == trained["3"]


def test_a_corrupt_newest_snapshot_makes_every_rank_fall_back_together(by_rank):
    trained = by_rank[0]["trained"]
    for report in by_rank:
        assert (report["fallback"]["loaded"], report["fallback"]["iteration"]) == (
            "snapshot_iter_2", 2), report["fallback"]
        assert report["fallback"]["weight"] == trained["2"]


def test_no_common_snapshot_is_the_same_clear_error_on_every_rank(by_rank):
    errors = [report["none"].get("error") for report in by_rank]
    assert errors[0] is not None and errors[0] == errors[1]
    assert errors[0].startswith("NoCommonSnapshotError")
    for step in (1, 2, 3):
        assert f"snapshot_iter_{step} (rank 0: " in errors[0]


def test_a_save_failing_on_the_saver_rank_raises_on_every_rank_naming_it(by_rank):
    for report in by_rank:
        failure = report["failing_save"]
        assert failure["iteration"] == 2, failure
        assert failure["error"].startswith("RankFailedError: snapshot at iteration 2"), failure
        assert "rank(s) [0]: rank 0: " in failure["error"] and "injected" in failure["error"]
