"""``snapshot(saver_rank=...)`` with two real processes on the gloo backend: only the saver rank
writes (and runs retention); every rank autoloads the snapshot the saver rank chose.

ppe's own distributed snapshot test needs MPI, NCCL and GPUs; this is its CPU equivalent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

from snapkeep.training import extensions as ext

WORKER = Path(__file__).with_name("distributed_snapshot_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> tuple[Path, list[dict]]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    base = tmp_path_factory.mktemp("dist")
    out_dir, report_dir = base / "out", base / "reports"
    report_dir.mkdir()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(WORLD_SIZE), str(base / "store"),
             str(out_dir), str(report_dir)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"
    return out_dir, [json.loads((report_dir / f"rank{r}.json").read_text())
                     for r in range(WORLD_SIZE)]


def test_only_the_saver_rank_writes(reports):
    out_dir, by_rank = reports
    assert [r["writer_calls"] for r in by_rank] == [0, 3]
    expected = [".snapkeep", "snapshot_iter_2", "snapshot_iter_3"]  # n_retains=2
    assert [r["listing"] for r in by_rank] == [expected, expected]
    assert sorted(n for n in os.listdir(out_dir / ".snapkeep") if not n.endswith(".lock")) == [
        "snapshot_iter_2.json", "snapshot_iter_3.json"]


def test_every_rank_loads_the_saver_ranks_snapshot(reports):
    _, by_rank = reports
    for report in by_rank:
        assert report["differs_before"], report
        assert report["loaded"] == "snapshot_iter_3", report
        assert report["iteration"] == 3, report
        assert report["equal_after"], report


def test_each_rank_resumes_its_own_random_stream(reports):
    _, by_rank = reports
    for report in by_rank:
        assert report["draw_after_resume"] == report["draw_after_snapshot"], report
    # the streams differ between ranks, so restoring the saver's state everywhere would fail
    assert by_rank[0]["draw_after_snapshot"] != by_rank[1]["draw_after_snapshot"]


def test_saver_rank_out_of_range_names_the_argument(reports):
    _, by_rank = reports
    for report in by_rank:
        assert report["bad_saver_rank_error"].startswith("saver_rank must be an int in [0, 2)")


def test_saver_rank_without_a_process_group_is_an_error():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="requires torch.distributed to be initialized"):
        ext.snapshot(saver_rank=0)
