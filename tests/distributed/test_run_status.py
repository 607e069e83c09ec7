"""A job script can tell a preemption from a crash: torchrun with 2 gloo ranks is SIGTERMed
(as SLURM signals the job step), the ranks commit one snapshot and rank 0 records ``preempted``
in ``.snapkeep/status.json``; ``snapkeep status`` exits 75 and names the step and snapshot. The
rerun finishes and ``snapkeep status`` exits 0. In-process: an error records ``failed``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed
from click.testing import CliRunner

from snapkeep import writing
from snapkeep.cli import cli
from snapkeep.session import run_status, write_run_status
from snapkeep.store import resolve_storage
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext
from support.ranks import rank_env, torchrun

WORKER = Path(__file__).with_name("status_worker.py")
TIMEOUT_S = 120


def _torchrun(out: Path, ready: Path, iterations: int) -> subprocess.Popen[str]:
    return torchrun(WORKER, [str(out), str(ready), str(iterations)])


def _status(out: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["status", str(out), *args])
    return result.exit_code, result.output


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_sigterm_to_torchrun_is_recorded_as_preempted_and_the_rerun_as_finished(tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"
    job = _torchrun(out, ready, 1_000_000)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the job never reached iteration 3"
        job.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to its workers
        output = job.communicate(timeout=TIMEOUT_S)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0, output  # torchrun reports it as a failure: the status tells
    # the resume notice, once per job (rank 0), not once per rank
    assert [line for line in output.splitlines() if "snapkeep:" in line] == [
        f"snapkeep: no snapshot of 'snapshot_iter_{{.iteration}}' in {out}, starting fresh"]
    recorded = run_status(str(out))
    assert recorded is not None and recorded.state == "preempted", output
    step = recorded.step
    assert step >= 3 and recorded.snapshots == (f"snapshot_iter_{step}",)
    assert recorded.world_size == 2 and recorded.reason == "signal SIGTERM"
    assert (out / f"snapshot_iter_{step}").is_file()
    code, text = _status(out)
    assert code == 75, text
    assert text.startswith(f"preempted at step {step} (") and text.rstrip().endswith(
        f"2 rank(s)): signal SIGTERM; snapshot snapshot_iter_{step}"), text

    rerun = _torchrun(out, tmp_path / "ready2", step + 3)
    output = rerun.communicate(timeout=TIMEOUT_S)[0]
    assert rerun.returncode == 0, output
    assert [line for line in output.splitlines() if "snapkeep:" in line] == [
        f"snapkeep: resuming from snapshot_iter_{step} (step {step}) in {out}"]
    code, text = _status(out, "--json")
    assert code == 0, text
    got = json.loads(text)
    assert (got["state"], got["step"], got["world_size"]) == ("finished", step + 3, 2)


def _run(out: Path, fail_at: int | None) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=4, out_dir=str(out),
                                writer=writing.SimpleWriter(out_dir=str(out)))
    manager.extend(ext.snapshot(quiet=True))
    manager.extend(ext.preemption())
    with manager:
        while not manager.stop_trigger:
            with manager.run_iteration():
                if manager.iteration == fail_at:
                    raise RuntimeError("loss is nan\nsecond line")
                optimizer.step()


def test_status_of_a_failed_run_a_running_one_and_none(tmp_path):
    out = tmp_path / "out"
    assert _status(out)[0] == 1  # no status file
    with pytest.raises(RuntimeError, match="loss is nan"):
        _run(out, fail_at=2)
    recorded = run_status(str(out))
    assert (recorded.state, recorded.step, recorded.reason) == (
        "failed", 2, "RuntimeError: loss is nan")
    code, text = _status(out)
    assert code == 1 and text.startswith("failed at step 2 ("), text
    _run(out, fail_at=None)
    assert (run_status(str(out)).state, _status(out)[0]) == ("finished", 0)
    (out / ".snapkeep" / "status.json").write_text("{}")
    code, text = _status(out)
    assert code == 1 and "invalid status file" in text


def test_a_run_killed_without_a_word_stays_running_and_status_says_not_done(tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"
    script = (
        "import sys, torch\n"
        "from snapkeep import writing\n"
        "from snapkeep.training import ExtensionsManager, extensions as ext\n"
        "model = torch.nn.Linear(2, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "m = ExtensionsManager(model, opt, 10**6, iters_per_epoch=10, out_dir=sys.argv[1],\n"
        "                      writer=writing.SimpleWriter(out_dir=sys.argv[1]))\n"
        "m.extend(ext.snapshot(quiet=True))\n"
        "m.extend(ext.preemption())\n"
        "while not m.stop_trigger:\n"
        "    with m.run_iteration():\n"
        "        opt.step()\n"
        "    if m.iteration == 3:\n"
        "        open(sys.argv[2], 'w').close()\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(out), str(ready)],
                            env=rank_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the run never reached iteration 3"
        host = socket.gethostname()
        code, text = _status(out)  # the run is alive: said so, still not done
        assert code == 1 and text.startswith(
            f"running (pid {proc.pid} on {host}) started at step 0 ("), \
            text
        body = json.loads(_status(out, "--json")[1])
        assert (body["pid"], body["host"], body["alive"]) == (proc.pid, host, True)
    finally:
        proc.kill()  # SIGKILL: nothing can record anything
        proc.wait()
    recorded = run_status(str(out))
    assert (recorded.state, recorded.step, recorded.world_size) == ("running", 0, 1)
    code, text = _status(out)
    assert code == 1 and text.startswith(
        f"died (not running: pid {proc.pid} on {host} is gone) without recording an outcome "
        "(killed, out of memory, node lost) started at step 0 ("), text
    assert json.loads(_status(out, "--json")[1])["alive"] is False
    # the SIGKILL may land mid-save: a restart sweeps such temp files; here the test does
    storage, directory = resolve_storage(str(out))
    for where in (directory, storage.join(directory, ".snapkeep")):
        storage.remove_stale_temps(where)


def test_status_of_a_running_state_written_elsewhere_or_by_a_reused_pid(tmp_path):
    """Liveness is checked only on the host that wrote the status, and a pid now used by
    another process (this one, started later than the recorded start token) is not the run."""
    out = tmp_path / "out"
    storage, directory = resolve_storage(str(out))
    write_run_status(storage, directory, state="running", step=7)  # written by this process
    path = out / ".snapkeep" / "status.json"
    raw = json.loads(path.read_text())
    assert (raw["pid"], raw["host"]) == (os.getpid(), socket.gethostname())
    assert _status(out)[1].startswith(f"running (pid {os.getpid()} on ")
    path.write_text(json.dumps({**raw, "start_token": raw["start_token"] + "0"}))
    code, text = _status(out)
    assert code == 1 and text.startswith(f"died (not running: pid {os.getpid()} on "), text
    path.write_text(json.dumps({**raw, "host": "another-node-of-the-job"}))
    code, text = _status(out)
    assert code == 1 and "cannot be checked from this host" in text, text
    assert json.loads(_status(out, "--json")[1])["alive"] is None
