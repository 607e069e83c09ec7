"""Ranks agree on what to resume (DISTRIBUTED mode, node-local directories): they resume
together at the newest step the saver rank verifies, fall back together, or fail together; a
save failing on the saver rank raises on every rank. Run twice: 2 spawned gloo processes, and
2 torchrun agents with ``--nnodes 2`` and a c10d rendezvous on 127.0.0.1 (a 2-node layout)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

from support.ranks import finish, rank_env, run

WORKER = Path(__file__).with_name("agreement_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


def _two_nodes(base: Path) -> None:
    """Two torchrun agents (``--nnodes 2``, one process each) meeting through a c10d
    rendezvous on 127.0.0.1, like two machines, each rank with its own directory."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "snapkeep-agree",
         str(WORKER), "env", str(base)],
        env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True) for n in range(2)]
    outputs = finish(agents, 180)
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output


@pytest.fixture(scope="module", params=["spawned", "torchrun --nnodes 2"])
def by_rank(request, tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("agree")
    if request.param == "spawned":
        run(WORKER, 2, [str(base / "init"), str(base)], timeout_s=120)
    else:
        _two_nodes(base)
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
