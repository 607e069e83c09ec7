"""The run control every door records its run with (``Session.run_control``): ``running`` once at
the first step, one final state, the preemption hook only when asked for, bad ``preemption=``
input refused naming the argument."""

from __future__ import annotations

import os
import pathlib
import signal

import pytest

from snapkeep.session import RunControl, Session, preemption_signals, run_status
from snapkeep.store import FilenameTemplate, SnapshotStore, resolve_storage


def _session(directory: pathlib.Path) -> Session:
    storage, path = resolve_storage(str(directory))
    return Session(SnapshotStore(storage, path, FilenameTemplate("ckpt_{step}")))


def _preemptible(directory: pathlib.Path, **arguments: object) -> tuple[Session, RunControl]:
    """An opened session and its run control catching SIGTERM and SIGUSR1."""
    session = _session(directory)
    session.open()
    return session, session.run_control(signals=preemption_signals(True), **arguments)


def test_running_once_then_one_final_state(tmp_path: pathlib.Path) -> None:
    session = _session(tmp_path)
    session.open()
    run = session.run_control()
    assert run_status(str(tmp_path)) is None  # nothing recorded before the first step
    run.at(5)
    run.at(6)
    status = run_status(str(tmp_path))
    assert status is not None and (status.state, status.step) == ("running", 5)
    run.failed(ValueError("boom\nsecond line"))
    run.finished()  # after a final state: nothing more
    status = run_status(str(tmp_path))
    assert status is not None and (status.state, status.step, status.reason) == (
        "failed", 6, "ValueError: boom")
    session.close()


def test_preemption_hook_catches_the_signal_and_close_puts_the_handler_back(
        tmp_path: pathlib.Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    session = _session(tmp_path)
    session.open()
    run = session.run_control(signals=preemption_signals(True))
    assert run.agree() == 0
    os.kill(os.getpid(), signal.SIGUSR1)
    agreed = run.agree()
    assert agreed != 0
    run.at(3)
    run.preempted(3, "ckpt_3", agreed)
    with pytest.raises(SystemExit) as exit_info:
        run.exit_preempted(3)
    assert exit_info.value.code == 143
    status = run_status(str(tmp_path))
    assert status is not None and status.state == "preempted" and "SIGUSR1" in status.reason
    assert status.snapshots == ("ckpt_3",)
    session.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_no_preemption_hook_without_signals(tmp_path: pathlib.Path) -> None:
    run = RunControl(*resolve_storage(str(tmp_path)))
    assert run.watch is None and run.agree() == 0
    assert preemption_signals(False) == ()


@pytest.mark.parametrize("bad, error", [("SIGTERM", TypeError), (7.5, TypeError),
                                        ([signal.SIGKILL], ValueError)])
def test_a_bad_preemption_argument_is_refused_naming_it(bad: object, error: type) -> None:
    with pytest.raises(error, match="preemption|signals"):
        preemption_signals(bad)  # type: ignore[arg-type]


def test_the_sessions_saves_are_timed_and_a_short_grace_decides_no_durable_write(
        tmp_path: pathlib.Path) -> None:
    """One shape for every door: the session times each durable save it makes (the deadline's
    estimate), the plan says where the preemption step goes (no tier: nowhere, with one: RAM),
    its record lands in the status, and the exit code says it (79)."""
    import torch

    from snapkeep._core.session.run_control import exit_code
    from snapkeep.writing import ThreadWriter

    session, run = _preemptible(tmp_path, grace_s=0.5)
    assert run.times.estimate().durable_s is None  # nothing measured yet
    writer = ThreadWriter()
    handle = session.save(writer, "ckpt_1", str(tmp_path), {"w": torch.zeros(4)}, step=1,
                          metrics={})
    handle.wait()
    writer.finalize()
    measured = run.times.estimate()
    assert measured.stage_s is not None and measured.commit_s is not None
    assert measured.durable_s is not None and measured.durable_s >= 1.0  # + the exit's 1 s
    os.kill(os.getpid(), signal.SIGTERM)
    agreed = run.agree()
    assert agreed != 0
    plan = run.plan(tier=False)  # 0.5 s of grace, at least 1 s to write: does not fit
    assert plan.where == "none" and exit_code(plan) == 79
    assert run.plan(tier=True).where == "ram"
    run.preempted(1, (), agreed, plan)
    status = run_status(str(tmp_path))
    assert status is not None and status.state == "preempted" and not status.durable
    assert status.preemption["committed_to"] == "none"
    assert status.preemption["deadline_from"] == "grace_s="
    assert status.preemption["durable_estimate_s"] == pytest.approx(measured.durable_s, abs=1e-3)
    assert status.snapshots == () and status.reason == "signal SIGTERM"
    session.close()  # during a preemption the handlers stay until the exit, as a door's
    with pytest.raises(SystemExit) as exit_info:
        run.exit_preempted(1, plan)
    assert exit_info.value.code == 79


def test_a_grace_that_fits_commits_to_storage_and_the_handlers_stay_until_the_exit(
        tmp_path: pathlib.Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    session, run = _preemptible(tmp_path, grace_s=600)
    run.times.staged(run.times.start(), _done())
    os.kill(os.getpid(), signal.SIGTERM)
    agreed = run.agree()
    plan = run.plan(tier=True)
    assert plan.where == "storage" and plan.remaining_s <= 600
    run.requested(3, plan)
    session.close()  # a door's close during the preemption: the handlers stay ...
    assert signal.getsignal(signal.SIGTERM) != before
    run.preempted(3, "ckpt_3", agreed, plan)
    with pytest.raises(SystemExit) as exit_info:
        run.exit_preempted(3, plan)
    assert exit_info.value.code == 143
    assert signal.getsignal(signal.SIGTERM) == before  # ... until the exit
    status = run_status(str(tmp_path))
    assert status is not None and status.durable and status.snapshots == ("ckpt_3",)


def test_without_a_deadline_the_step_always_goes_to_storage(tmp_path: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.delenv("SNAPKEEP_GRACE_S", raising=False)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    session, run = _preemptible(tmp_path)
    os.kill(os.getpid(), signal.SIGTERM)
    assert run.agree() != 0
    assert run.plan(tier=False).where == "storage"
    session.close()


def _done() -> object:
    import concurrent.futures

    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.set_result(None)
    return future
