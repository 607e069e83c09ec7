"""Preemption with a deadline (issue 33, item 1): the grace period from the argument, the
environment or SLURM's end time; this run's measured durable write decides between storage and
the memory tier; tested with a real SIGTERM to a real trainer on a really slow storage and a
real grace timer that SIGKILLs its process group (tests/support/deadline_trials.py, which also
runs the 20 + 20 trials)."""

from __future__ import annotations

import math
import os
import pathlib
import signal
import threading
from typing import Any

import pytest
import torch

import snapkeep
from snapkeep._core.session.deadline import decide
from snapkeep.session import Estimate, Grace, SaveTimes, grace_from
from support import deadline_trials, ranks

WORKER = pathlib.Path(__file__).with_name("deadline_worker.py")


@pytest.mark.parametrize(("remaining_s", "durable_s", "tier", "where"), [
    (math.inf, 100.0, True, "storage"),  # no deadline known: storage, however long
    (math.inf, None, False, "storage"),
    (10.0, 4.0, True, "storage"),  # fits
    (10.0, 10.0, False, "storage"),
    (3.0, 4.0, True, "ram"),  # does not fit: the tier
    (3.0, 4.0, False, "none"),  # nor a tier: nothing new (never a write that cannot finish)
    (-1.0, 0.5, True, "ram"),  # the deadline has passed
    (30.0, None, True, "ram"),  # nothing measured yet: never a durable write it cannot time
    (30.0, None, False, "storage"),  # ... unless it is the only way to keep the step
])
def test_decide(remaining_s: float, durable_s: float | None, tier: bool, where: str) -> None:
    assert decide(remaining_s, durable_s, tier=tier) == where


def test_grace_from_argument_environment_and_slurm(tmp_path: pathlib.Path) -> None:
    assert grace_from(7, {"SNAPKEEP_GRACE_S": "3", "SLURM_JOB_END_TIME": "100"}) == Grace(
        grace_s=7.0, source="grace_s=")
    assert grace_from(None, {"SNAPKEEP_GRACE_S": "3", "SLURM_JOB_END_TIME": "100"}) == Grace(
        grace_s=3.0, source="$SNAPKEEP_GRACE_S")
    slurm = grace_from(None, {"SLURM_JOB_END_TIME": "1000"})
    assert slurm == Grace(end_unix_s=1000.0, source="$SLURM_JOB_END_TIME")
    assert grace_from(None, {}) == Grace()
    # SLURM: the end time, for a signal that came before it (--signal=USR1@secs) ...
    assert slurm.remaining_s(signalled_mono_s=50.0, now_mono_s=60.0, now_unix_s=940.0) == 60.0
    # ... not for the time limit's own SIGTERM, after it (KillWait is not exported)
    assert math.isinf(slurm.remaining_s(signalled_mono_s=50.0, now_mono_s=51.0,
                                        now_unix_s=1001.0))
    # a grace runs from the first signal; a rank that got none has no deadline of its own
    g = Grace(grace_s=10.0, source="grace_s=")
    assert g.remaining_s(signalled_mono_s=100.0, now_mono_s=104.0, now_unix_s=0.0) == 6.0
    assert math.isinf(g.remaining_s(signalled_mono_s=None, now_mono_s=104.0, now_unix_s=0.0))
    for bad in ("0", "-3", "soon", "nan"):
        with pytest.raises(ValueError, match="SNAPKEEP_GRACE_S must be a number of seconds"):
            grace_from(None, {"SNAPKEEP_GRACE_S": bad})
    with pytest.raises(ValueError, match="grace_s must be a number of seconds"):
        snapkeep.Checkpointer(tmp_path / "run", preemption=True, grace_s=0)
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_save_times_estimate_from_measured_saves() -> None:
    import concurrent.futures

    now = [0.0]
    times = SaveTimes(clock=lambda: now[0])
    assert times.estimate() == Estimate(stage_s=None, commit_s=None, pending_s=0.0,
                                        durable_s=None)
    committed: concurrent.futures.Future[Any] = concurrent.futures.Future()
    started = times.start()
    now[0] = 0.5  # staged after 0.5 s
    times.staged(started, committed)
    now[0] = 4.5
    committed.set_result(None)  # committed 4 s later
    est = times.estimate()
    assert (est.stage_s, est.commit_s, est.pending_s) == (0.5, 4.0, 0.0)
    assert est.durable_s == pytest.approx((0.5 + 4.0) * 1.25 + 1.0)
    in_flight: concurrent.futures.Future[Any] = concurrent.futures.Future()
    times.staged(times.start(), in_flight)  # one more in flight for 1 s: 3 s of it left
    now[0] = 5.5
    assert times.estimate().pending_s == pytest.approx(3.0)
    in_flight.set_exception(OSError("lost"))  # a failed commit is not counted
    assert times.estimate().commit_s == 4.0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("grace_s", [deadline_trials.SHORT_GRACE_S,
                                     deadline_trials.LONG_GRACE_S], ids=["short", "fits"])
def test_real_signal_real_grace_timer(tmp_path: pathlib.Path, grace_s: float,
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """A grace shorter than this run's durable write (~8 s on the slow storage): the step goes
    to RAM, no durable write starts, nothing torn, exit 79, the status says so and the rerun
    resumes it bit-identical. A grace that fits: committed to storage before the kill, 143.
    (Each run is forked by the zygote of tests/support/zygote.py: a real process, real
    signals, without its own torch import.)"""
    forks = deadline_trials.zygote_for_worker()
    if "worker" not in _REFERENCES:  # the uninterrupted run, once per session
        reference = tmp_path_factory.mktemp("reference")
        (reference / "shm").mkdir(mode=0o700)
        done = deadline_trials.run_to_end(reference, zygote=forks)
        assert done.returncode == 0, done.stderr[-3000:]
        _REFERENCES["worker"] = deadline_trials.final_model(reference)
    root = tmp_path / "preempted"
    root.mkdir()
    assert deadline_trials.trial(root, grace_s, _REFERENCES["worker"], forks) == ""
    status = snapkeep.session.run_status(str(root / "out"))
    assert status is not None  # the rerun finished: its own status now
    assert status.state == "finished"


#: The uninterrupted runs' final models, once per session: the single-process worker's, and the
#: 2-rank torchrun job's (the same for both of that test's cases: the storage interval decides
#: where snapshots go, never what is trained).
_REFERENCES: dict[str, dict[str, Any]] = {}


def _torchrun_to_end(root: pathlib.Path, env: dict[str, str]) -> str:
    proc = ranks.torchrun(WORKER, [str(root / "out"), str(root / "shm"), "12"], env=env)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("every", "where", "code"), [("1000", "ram", 79),
                                                       ("4", "storage", 143)])
def test_torchrun_signal_to_one_rank_same_outcome_on_both(
        tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, every: str,
        where: str, code: int) -> None:
    """2 ranks (torchrun --standalone, gloo, sharded snapshots, the memory tier with one peer
    copy): SIGTERM to rank 1 only; the ranks agree on the smallest remaining time and the
    largest estimate, so both commit the same step to the same place and exit with the same
    code. EVERY=1000: no durable save measured yet -> the memory tier; EVERY=4: measured, and
    the 60 s grace fits -> storage."""
    env = {"EVERY": every, "SNAPKEEP_GRACE_S": "60"}
    if "torchrun" not in _REFERENCES:
        reference = tmp_path_factory.mktemp("reference-torchrun")
        (reference / "shm").mkdir(parents=True, mode=0o700)
        # the same ranks, forked with torchrun's environment (torchrun is what the preempted
        # run and its rerun go through)
        ranks.run_torchrun_forked(WORKER, [str(reference / "out"), str(reference / "shm"), "12"],
                                  env=env, timeout_s=300)
        _REFERENCES["torchrun"] = torch.load(reference / "final.pt", weights_only=True)
    root = tmp_path / "preempted"
    (root / "shm").mkdir(parents=True, mode=0o700)
    go = root / "go"
    proc = ranks.torchrun(WORKER, [str(root / "out"), str(root / "shm"), "12"],
                          env={**env, "PAUSE_AT": "6", "GO_FILE": str(go)})
    timer = threading.Timer(60, lambda: os.killpg(proc.pid, signal.SIGKILL))
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        pids = {}
        for line in proc.stdout:
            lines.append(line)
            words = line.split()
            if line.startswith("paused 6 "):
                pids[int(words[3])] = int(words[5])
                if len(pids) == 2:
                    break
        assert len(pids) == 2, "".join(lines)[-4000:]  # both ranks paused, or what they said
        os.kill(pids[1], signal.SIGTERM)
        timer.start()
        go.touch()
        lines.extend(proc.stdout)
        proc.wait(timeout=300)
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = "".join(lines)
    assert output.count(f"exiting with {code}") >= 2, output[-4000:]  # both ranks
    assert "exiting with 143" not in output or code == 143
    status = snapkeep.session.run_status(str(root / "out"))
    assert status is not None and status.state == "preempted", output[-3000:]
    assert status.preemption["committed_to"] == where
    assert status.world_size == 2 and "on rank 1" in status.reason or "SIGTERM" in status.reason
    names = sorted(p.name for p in (root / "out").iterdir() if not p.name.startswith("."))
    assert names == (["ckpt_4", "ckpt_7"] if where == "storage" else [])
    rerun = _torchrun_to_end(root, env)
    assert "resumed at 7" in rerun, rerun[-3000:]
    a = torch.load(root / "final.pt", weights_only=True)
    b = _REFERENCES["torchrun"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)



def test_status_says_where_a_preempted_step_went(tmp_path: pathlib.Path) -> None:
    from click.testing import CliRunner

    from snapkeep.cli import cli
    from snapkeep.session import write_run_status
    from snapkeep.store import resolve_storage

    storage, path = resolve_storage(str(tmp_path))
    record = {"committed_to": "ram", "remaining_s": 5.0, "durable_estimate_s": 11.5,
              "deadline_from": "$SNAPKEEP_GRACE_S", "stage_s": 0.1, "commit_s": 8.1,
              "pending_s": 0.0}
    write_run_status(storage, path, state="preempted", step=7, reason="signal SIGTERM",
                     preemption=record)
    result = CliRunner().invoke(cli, ["status", str(tmp_path)])
    assert result.exit_code == 79, result.output
    assert "committed to the memory tier only (durable write skipped): 5.0 s left (deadline " \
           "from $SNAPKEEP_GRACE_S), durable write estimated at 11.5 s" in result.output
    as_json = CliRunner().invoke(cli, ["status", str(tmp_path), "--json"])
    assert as_json.exit_code == 79 and '"committed_to": "ram"' in as_json.output
    write_run_status(storage, path, state="preempted", step=7, reason="signal SIGTERM",
                     preemption={**record, "committed_to": "storage"})
    assert CliRunner().invoke(cli, ["status", str(tmp_path)]).exit_code == 75
