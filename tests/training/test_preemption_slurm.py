"""``preemption(requeue=True)`` as SLURM runs it: SIGUSR1 ahead of the time limit
(``--signal=USR1@<s>``), a committed snapshot of that iteration, then ``scontrol requeue
$SLURM_JOB_ID`` (a stand-in ``scontrol`` on ``PATH`` records its arguments) and exit 143."""

from __future__ import annotations

import logging
import os
import signal
import stat
from typing import Any

import pytest
import torch

from snapkeep import load_latest, writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def _fake_scontrol(tmp_path: Any, monkeypatch: Any, rc: int) -> Any:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "slurm says no" >&2\nexit {rc}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def _assert_committed_at_7(out: str) -> None:
    assert os.path.exists(os.path.join(out, ".snapkeep", "snapshot_iter_7.json"))  # manifest
    state = load_latest(out)  # verified against that manifest
    assert state is not None and state["_start_iteration"] == 7


def _train_until_signalled(out: str) -> int:
    model = torch.nn.Linear(3, 2)
    manager = ExtensionsManager(model, {}, 1, iters_per_epoch=50, out_dir=out,
                                writer=writing.SimpleWriter(out_dir=out))
    manager.extend(ext.snapshot(autoload=True), trigger=(100, "iteration"))
    manager.extend(ext.preemption(requeue=True))
    with pytest.raises(SystemExit) as info:
        while not manager.stop_trigger:
            with manager.run_iteration():
                if manager.iteration + 1 == 7:
                    os.kill(os.getpid(), signal.SIGUSR1)
    return int(info.value.code)  # type: ignore[arg-type]


@pytest.mark.parametrize("scontrol_rc", [0, 1])
def test_sigusr1_commits_then_requeues_the_job(tmp_path: Any, monkeypatch: Any, caplog: Any,
                                               scontrol_rc: int) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch, scontrol_rc)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    out = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="snapkeep"):
        assert _train_until_signalled(out) == 143
    assert calls.read_text().split() == ["requeue", "4242"]
    _assert_committed_at_7(out)  # before the requeue
    if scontrol_rc == 0:
        assert "requeued SLURM job 4242" in caplog.text
    else:  # a failed requeue is reported, with scontrol's own words; the exit code stays
        assert "scontrol requeue 4242 failed" in caplog.text
        assert "slurm says no" in caplog.text and "resubmit the job" in caplog.text


def test_requeue_outside_slurm_only_warns(tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch, 0)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="snapkeep"):
        assert _train_until_signalled(out) == 143
    assert not calls.exists()
    assert "SLURM_JOB_ID is not set; not requeued" in caplog.text
    _assert_committed_at_7(out)
