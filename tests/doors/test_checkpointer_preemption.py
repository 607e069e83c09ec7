"""The Checkpointer's preemption and run status (issue 24: every capability through every door):
a SIGTERM or SIGUSR1 becomes a committed snapshot of the next step on every rank, the status
``preempted`` and exit code 143; a rerun resumes from it and ends as the uninterrupted run.
Before, the Checkpointer had no preemption and ``snapkeep status`` said "no run status" for
every Checkpointer directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import snapkeep
from snapkeep.cli import cli
from support import ranks

WORKER = Path(__file__).with_name("checkpointer_preemption_worker.py")
BOUND_S = 120
STEPS = 12


def _final(output: str) -> str:
    return [line for line in output.splitlines() if line.startswith("final ")][-1]


def _status(out: Path) -> snapkeep.session.RunStatus:
    status = snapkeep.session.run_status(str(out))
    assert status is not None
    return status


def _start(tmp_path: Path, out: Path, world_size: int, pause_at: int
           ) -> list[subprocess.Popen[str]]:
    """Start the ranks with a stdin to release them after step ``pause_at``."""
    return [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world_size),
                              str(tmp_path / "init"), str(out), str(STEPS)],
                             env=ranks.rank_env({"PAUSE_AT": str(pause_at)}),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for rank in range(world_size)]


def _signal_at_pause(procs: list[subprocess.Popen[str]], pause_at: int, target: int,
                     sig: signal.Signals) -> list[str]:
    """Wait until every rank paused after step ``pause_at``, signal rank ``target``, let them
    all go on; return their outputs."""
    try:
        for proc in procs:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip() == f"step {pause_at}":
                    break
        os.kill(procs[target].pid, sig)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
    finally:
        outputs = ranks.finish(procs, BOUND_S)
    return outputs


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_snapshots_the_next_step_and_the_rerun_ends_as_uninterrupted(
        tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "ckpt"
    procs = _start(tmp_path, out, 1, pause_at=6)
    rest = _signal_at_pause(procs, 6, 0, sig)[0]
    assert procs[0].returncode == 143, rest
    assert "step 7" in rest and "step 8" not in rest, rest
    assert sorted(os.listdir(out)) == [".snapkeep", "ckpt_4", "ckpt_7"]
    status = _status(out)
    assert (status.state, status.step, status.snapshots) == ("preempted", 7, ("ckpt_7",))
    assert status.reason == f"signal {sig.name}"
    result = CliRunner().invoke(cli, ["status", str(out)])
    assert result.exit_code == 75 and "preempted" in result.output, result.output
    if sig is not signal.SIGTERM:
        return  # the rerun is the same for either signal
    rerun = ranks.run(WORKER, 1, [str(tmp_path / "init"), str(out), str(STEPS)],
                      timeout_s=BOUND_S)[0]
    assert "resumed at 7" in rerun
    straight = ranks.run(WORKER, 1, [str(tmp_path / "init2"), str(tmp_path / "straight"),
                                     str(STEPS)], timeout_s=BOUND_S)[0]
    assert _final(rerun) == _final(straight)
    status = _status(out)
    assert (status.state, status.step) == ("finished", STEPS)


def test_a_loop_that_raises_is_recorded_failed(tmp_path: Path) -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with snapkeep.Checkpointer(tmp_path) as ckpt:
            ckpt.load(into={"model": model})
            ckpt.save(1, {"model": model})
            raise RuntimeError("boom")
    status = _status(tmp_path)
    assert (status.state, status.step, status.reason) == ("failed", 1, "RuntimeError: boom")


@pytest.mark.timeout(2 * BOUND_S)
def test_two_ranks_snapshot_the_same_step_when_one_rank_is_signalled(tmp_path: Path) -> None:
    """Only rank 1 gets SIGTERM: both ranks agree at the next save, both commit that sharded
    snapshot and exit 143; the status names the signal and the rank."""
    out = tmp_path / "ckpt"
    procs = _start(tmp_path, out, 2, pause_at=5)
    outputs = _signal_at_pause(procs, 5, 1, signal.SIGTERM)
    assert [p.returncode for p in procs] == [143, 143], outputs
    assert "ckpt_6" in os.listdir(out)
    assert ".snapkeep-commit.json" in os.listdir(out / "ckpt_6")
    status = _status(out)
    assert (status.state, status.step, status.reason) == ("preempted", 6,
                                                          "signal SIGTERM on rank 1")
    rerun = ranks.run(WORKER, 2, [str(tmp_path / "init2"), str(out), str(STEPS)],
                      timeout_s=BOUND_S)
    assert all("resumed at 6" in o for o in rerun), rerun
