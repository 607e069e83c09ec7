"""``snapshot(snapshot_mode=SHARDED)`` with real gloo processes: FSDP2 state saved on 2 ranks
through torch.distributed.checkpoint, resumed on 2 ranks and resharded on 1 with identical
parameters and Adam state; a rank failing during a save fails every rank and leaves no marker.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed

from support.ranks import finish, reports, run, start

WORKER = Path(__file__).with_name("sharded_worker.py")
TIMEOUT_S = 150
MARKER = ".snapkeep-commit.json"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """3 iterations on 2 ranks, a sharded snapshot each (n_retains=2)."""
    base = tmp_path_factory.mktemp("sharded")
    out, rep = base / "out", base / "reports"
    rep.mkdir()
    run(WORKER, 2, [str(base / "init_train"), str(out), str(rep), "train", "3"],
        timeout_s=TIMEOUT_S)
    return out, rep


def _assert_same(resumed: dict, saved: dict) -> None:
    assert resumed["params"].keys() == saved["params"].keys()
    for key, value in saved["params"].items():
        assert torch.equal(resumed["params"][key], value), key
    for key, value in saved["exp_avg"].items():
        assert torch.equal(resumed["exp_avg"][key], value), key


def test_every_rank_writes_its_shards_and_rank_0_the_marker(trained):
    out, rep = trained
    assert [r.get("error") for r in reports(rep, "train", 2)] == [None, None]
    assert sorted(os.listdir(out)) == [".snapkeep", "snapshot_iter_2",
                                       "snapshot_iter_3"]  # n_retains=2; .snapkeep: the lock
    directory = out / "snapshot_iter_3"
    assert sorted(os.listdir(directory)) == [".metadata", MARKER, ".snapkeep-in-progress",
                                             "__0_0.distcp", "__1_0.distcp"]
    marker = json.loads((directory / MARKER).read_text())
    assert marker["world_size"] == 2 and marker["step"] == 3
    assert {n: f["rank"] for n, f in marker["files"].items()} == {
        ".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1}
    for name, record in marker["files"].items():
        assert (directory / name).stat().st_size == record["size_bytes"]


def test_dcp_tools_read_the_snapshot(trained, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out, rep = trained
    dcp_to_torch_save(out / "snapshot_iter_3", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    saved = torch.load(rep / "params_rank0.pt", weights_only=True)[3]
    for key, value in saved["params"].items():
        assert torch.equal(full["models"]["main"][key], value), key


@pytest.mark.parametrize("world_size", [1, 3])  # 2 -> 2: the fall-back test
def test_resume_reshards_with_identical_parameters(trained, tmp_path, world_size):
    out, rep = trained
    saved = torch.load(rep / "params_rank0.pt", weights_only=True)
    assert not torch.equal(saved[3]["params"]["0.weight"], saved[2]["params"]["0.weight"])
    run(WORKER, world_size, [str(tmp_path / "init"), str(out), str(tmp_path), "resume"],
        timeout_s=TIMEOUT_S)
    for report in reports(tmp_path, "resume", world_size):
        assert report.get("error") is None, report
        assert (report["loaded"], report["iteration"]) == ("snapshot_iter_3", 3)
    for rank in range(world_size):
        _assert_same(torch.load(tmp_path / f"resumed_rank{rank}.pt", weights_only=True),
                     saved[3])


def test_a_rank_failing_during_a_save_fails_every_rank_and_commits_nothing(tmp_path):
    out, rep = tmp_path / "out", tmp_path / "reports"
    rep.mkdir()
    run(WORKER, 2, [str(tmp_path / "init"), str(out), str(rep), "train", "3"],
        timeout_s=TIMEOUT_S, env={"SNAPKEEP_TEST_FAIL_RANK": "1"})
    errors = [r.get("error") for r in reports(rep, "train", 2)]
    for error in errors:
        assert error is not None and "rank(s) [1]" in error and "injected" in error, errors
    assert (out / "snapshot_iter_1" / MARKER).exists()
    assert not (out / "snapshot_iter_2" / MARKER).exists()


def test_a_corrupt_shard_makes_every_rank_fall_back_together(trained, tmp_path):
    out, rep = trained
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    shard = copy / "snapshot_iter_3" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    run(WORKER, 2, [str(tmp_path / "init"), str(copy), str(tmp_path), "resume"],
        timeout_s=TIMEOUT_S)
    saved = torch.load(rep / "params_rank0.pt", weights_only=True)
    for rank, report in enumerate(reports(tmp_path, "resume", 2)):
        assert (report["loaded"], report["iteration"]) == ("snapshot_iter_2", 2), report
        _assert_same(torch.load(tmp_path / f"resumed_rank{rank}.pt", weights_only=True),
                     saved[2])


def test_a_rank_that_dies_makes_the_others_fail_within_the_timeout(tmp_path):
    out, rep = tmp_path / "out", tmp_path / "reports"
    rep.mkdir()
    procs = start(WORKER, 2, [str(tmp_path / "init"), str(out), str(rep), "train", "3"],
                  env={"SNAPKEEP_TEST_DIE_RANK": "1", "SNAPKEEP_TEST_TIMEOUT_S": "10"})
    outputs = finish(procs, TIMEOUT_S)  # bounded: the survivor gives up after timeout_s
    assert procs[1].returncode == 3, outputs[1]
    assert procs[0].returncode == 0, outputs[0]
    error = json.loads((rep / "train_rank0.json").read_text()).get("error")
    assert error is not None and "snapshot_iter_3" in error, error
    assert error.startswith(("CollectiveTimeoutError", "RankFailedError")), error
    assert (out / "snapshot_iter_2" / MARKER).exists()
    assert not (out / "snapshot_iter_3" / MARKER).exists()


def test_sigterm_to_one_rank_snapshots_the_same_iteration_on_both_and_exits(tmp_path):
    out, rep = tmp_path / "out", tmp_path / "reports"
    rep.mkdir()
    procs = start(WORKER, 2, [str(tmp_path / "init"), str(out), str(rep), "preempt"])
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (rep / "ready").exists() and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        assert (rep / "ready").exists(), "rank 1 never reached iteration 3"
        procs[1].send_signal(signal.SIGTERM)
    finally:
        outputs = finish(procs, TIMEOUT_S)
    assert [p.returncode for p in procs] == [143, 143], outputs
    by_rank = reports(rep, "preempt", 2)
    step = by_rank[0]["iteration"]
    assert step >= 3 and [r["iteration"] for r in by_rank] == [step, step]
    assert (out / f"snapshot_iter_{step}" / MARKER).exists()
    # the rerun resumes from it on every rank
    run(WORKER, 2, [str(tmp_path / "init2"), str(out), str(tmp_path), "resume"],
        timeout_s=TIMEOUT_S)
    for report in reports(tmp_path, "resume", 2):
        assert (report["loaded"], report["iteration"]) == (f"snapshot_iter_{step}", step)
