"""``extensions.preemption`` with ``snapshot(saver_rank=0)`` (DISTRIBUTED mode) on 2 gloo ranks:
SIGTERM to one rank makes both agree on one iteration, the saver rank commits that iteration's
snapshot, both exit with EXIT_CODE_PREEMPTED, and a rerun resumes from it on every rank."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch.distributed

from snapkeep.session import run_status
from snapkeep.training.extensions import EXIT_CODE_PREEMPTED
from support.ranks import finish, reports, run, start

WORKER = Path(__file__).with_name("preemption_worker.py")
TIMEOUT_S = 120

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


@pytest.mark.parametrize("signalled", [1, 0], ids=["non-saver", "saver"])
def test_sigterm_to_one_rank_snapshots_one_iteration_exits_and_the_rerun_resumes(
        tmp_path, signalled):
    out, rep = tmp_path / "out", tmp_path / "reports"
    rep.mkdir()
    procs = start(WORKER, 2, [str(tmp_path / "init"), str(out), str(rep), "preempt"])
    try:
        deadline = time.monotonic() + TIMEOUT_S
        ready = [rep / f"ready_rank{r}" for r in range(2)]
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        assert all(r.exists() for r in ready), "the ranks never reached iteration 3"
        procs[signalled].send_signal(signal.SIGTERM)
    finally:
        outputs = finish(procs, TIMEOUT_S)
    assert [p.returncode for p in procs] == [EXIT_CODE_PREEMPTED] * 2, outputs
    # the process groups were destroyed before interpreter teardown (a gloo group left to it
    # can abort with "terminate called without an active exception", exit -6)
    assert [(rep / f"atexit_rank{r}").read_text() for r in range(2)] == ["destroyed"] * 2
    by_rank = reports(rep, "preempt", 2)
    step = by_rank[0]["iteration"]
    assert step >= 3 and [r["iteration"] for r in by_rank] == [step, step]
    assert [r["exit_code"] for r in by_rank] == [EXIT_CODE_PREEMPTED] * 2
    assert by_rank[0]["params"] == by_rank[1]["params"]  # same data on both ranks
    # only the saver rank wrote, exactly the preempted iteration (the trigger is 1000 away)
    snapshots = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert snapshots == [f"snapshot_iter_{step}"]  # ".snapkeep": the job's lock and state
    recorded = run_status(str(out))  # rank 0 records it, naming where the signal came
    assert recorded is not None and recorded.reason == (
        "signal SIGTERM" if signalled == 0 else "signal SIGTERM on rank 1"), recorded

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    run(WORKER, 2, [str(tmp_path / "init2"), str(out), str(resumed_dir), "resume"],
        timeout_s=TIMEOUT_S)
    for report in reports(resumed_dir, "resume", 2):
        assert (report["loaded"], report["iteration"]) == (f"snapshot_iter_{step}", step), report
        assert report["params"] == by_rank[0]["params"]
