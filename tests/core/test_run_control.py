"""The run control every door records its run with (``Session.track_run``): ``running`` once at
the first step, one final state, the preemption hook only when asked for, bad ``preemption=``
input refused naming the argument."""

from __future__ import annotations

import os
import pathlib
import signal

import pytest

from snapkeep.store import (
    FilenameTemplate,
    RunControl,
    Session,
    SnapshotStore,
    preemption_signals,
    resolve_storage,
    run_status,
)


def _session(directory: pathlib.Path) -> Session:
    storage, path = resolve_storage(str(directory))
    return Session(SnapshotStore(storage, path, FilenameTemplate("ckpt_{.iteration}")))


def test_running_once_then_one_final_state(tmp_path: pathlib.Path) -> None:
    session = _session(tmp_path)
    session.open()
    run = session.track_run()
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
    run = session.track_run(signals=preemption_signals(True))
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
