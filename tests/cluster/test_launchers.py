"""The launchers' recipes of docs/cluster.md, end to end with real processes and real signals
(issue 33, item 2).

SLURM: there is no slurmctld here. The test runs the documented job script
(docs/examples/slurm_job.sh) verbatim with ``srun`` (runs its arguments), ``scontrol`` (records
a requeue) and ``snapkeep`` on PATH, and emulates what Slurm documents for a job with
``--time``, ``--signal=USR1@S`` and ``--requeue``: the environment (``SLURM_JOB_ID``,
``SLURM_JOB_END_TIME``, ``SLURM_RESTART_COUNT`` from the first requeue on), SIGUSR1 to the
job step's tasks S seconds before the end, SIGTERM to everything at the end and SIGKILL
``KillWait`` seconds later, and a requeued job started again.

Kubernetes: ``snapkeep flush DIR`` as the preStop hook of a live trainer, with a real grace
timer (terminationGracePeriodSeconds) that SIGKILLs the trainer's process group.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import snapkeep
from support import deadline_trials

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = pathlib.Path(__file__).resolve().parents[2]
JOB_SCRIPT = ROOT / "docs" / "examples" / "slurm_job.sh"
WORKER = pathlib.Path(__file__).with_name("deadline_worker.py")
STEPS = 250
STEP_SLEEP_S = "0.12"  # >= 30 s of training in the first start: the signal lands mid-training
LIMIT_S = 30.0  # --time of the first start
SIGNAL_S = 25.0  # --signal=USR1@25: 5 s after the start, and never before the task's step 40
# (>= 4.8 s of training with STEP_SLEEP_S: durable saves of steps 4, 8, ... were measured, so
# the deadline decides on a known write time; 210 slowed steps are still ahead)
SIGNAL_AFTER_STEP = 40
RESTART_LIMIT_S = 60.0  # --time of a requeued start (fast steps): USR1 35 s after its start
KILL_WAIT_S = 5.0  # slurm.conf KillWait
BOUND_S = 300

_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}


def _reference(factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final model (once per session, forked by the worker's zygote:
    tests/support/zygote.py)."""
    if "worker" not in _REFERENCES:
        ref = factory.mktemp("reference")
        (ref / "shm").mkdir(parents=True, mode=0o700)
        done = deadline_trials.run_to_end(ref, STEPS, deadline_trials.zygote_for_worker())
        assert done.returncode == 0, done.stderr[-3000:]
        _REFERENCES["worker"] = deadline_trials.final_model(ref)
    return _REFERENCES["worker"]


def _fake_bin(tmp_path: pathlib.Path) -> pathlib.Path:
    """srun (runs its arguments), scontrol (records 'requeue JOBID'), python and snapkeep."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": 'exec "$@"\n',
        "scontrol": 'echo "$@" >> "$REQUEUE_LOG"\n',
        "python": f'exec {sys.executable} "$@"\n',
        "snapkeep": f'exec {sys.executable} -m snapkeep "$@"\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    return bin_dir


def _tasks(shell: psutil.Process) -> list[psutil.Process]:
    """The job step's tasks: the processes running ``train.py`` (not ``snapkeep status``).
    Matched by the script's name, not by "snapkeep" in the command line: a checkout's path
    (``.../snapkeep/.venv/bin/python``) has it too, which once left no task to signal."""
    tasks = []
    try:
        children = shell.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for child in children:
        try:
            if any(pathlib.Path(arg).name == "train.py" for arg in child.cmdline()):
                tasks.append(child)
        except psutil.NoSuchProcess:
            continue
    return tasks


def _signal_all(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _slurm_job(work: pathlib.Path, bin_dir: pathlib.Path, restart: int) -> tuple[int, str]:
    """One start of the batch job, with Slurm's environment, signals and time limit. SIGUSR1
    comes ``LIMIT_S - SIGNAL_S`` after the start, but not before the task reported step
    ``SIGNAL_AFTER_STEP`` (a loaded machine may take longer to import torch: the signal lands
    mid-training, after durable saves were measured; a requeued start: after its first step).
    The first start's steps are slowed (``STEP_SLEEP_S``) so that it is still training then; a
    requeued start runs its steps at full speed, with a longer time limit (it finishes
    first)."""
    limit_s = RESTART_LIMIT_S if restart else LIMIT_S
    env = deadline_trials.env({
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": "out",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_END_TIME": str(int(time.time() + limit_s)),
        "REQUEUE_LOG": str(work / "requeue.log")})
    env.pop("SNAPKEEP_GRACE_S", None)
    if restart:
        env["SLURM_RESTART_COUNT"] = str(restart)
    else:
        env["STEP_SLEEP_S"] = STEP_SLEEP_S
    start = time.monotonic()
    proc = subprocess.Popen(["bash", str(JOB_SCRIPT)], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    shell = psutil.Process(proc.pid)
    output: list[str] = []
    training = threading.Event()

    def read() -> None:
        for line in proc.stdout or []:
            output.append(line)
            if line.startswith(f"step {SIGNAL_AFTER_STEP}\n") or \
                    line.startswith("step ") and restart:
                training.set()
        training.set()  # the output ended: nothing more to wait for

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        phases = [(limit_s - SIGNAL_S, "usr1"), (limit_s, "term"),
                  (limit_s + KILL_WAIT_S, "kill")]
        for at, what in phases:
            while proc.poll() is None and time.monotonic() - start < at:
                time.sleep(0.05)
            if what == "usr1":
                training.wait(timeout=BOUND_S)
            if proc.poll() is not None:
                break
            if what == "usr1":  # --signal without B: the job step's tasks only
                for task in _tasks(shell):
                    try:
                        task.send_signal(signal.SIGUSR1)
                    except psutil.NoSuchProcess:
                        pass
            else:
                _signal_all(proc.pid, signal.SIGTERM if what == "term" else signal.SIGKILL)
        code = proc.wait(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            _signal_all(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    return code, "".join(output)


def test_slurm_requeue_recipe(tmp_path: pathlib.Path,
                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """The documented job script under emulated Slurm: SIGUSR1 mid-training -> the step is
    committed (the deadline from SLURM_JOB_END_TIME fits this fast storage), exit 143,
    ``snapkeep status`` 75, ``scontrol requeue``; the requeued start (SLURM_RESTART_COUNT=1)
    resumes and finishes bit-identical to an uninterrupted run."""
    reference = _reference(tmp_path_factory)
    work = tmp_path / "job"
    (work / "shm").mkdir(parents=True, mode=0o700)
    (work / "train.py").write_text(
        "import os, runpy, sys\n"
        f"sys.argv = [{str(WORKER)!r}, sys.argv[1], 'shm', '{STEPS}']\n"
        f"runpy.run_path({str(WORKER)!r}, run_name='__main__')\n")
    bin_dir = _fake_bin(tmp_path)
    outputs = []
    for restart in range(4):
        code, output = _slurm_job(work, bin_dir, restart)
        outputs.append(output)
        assert code == 0, output[-3000:]
        requeues = (work / "requeue.log").read_text().splitlines() \
            if (work / "requeue.log").exists() else []
        if len(requeues) == restart:  # not requeued: the job is done
            break
        assert requeues[-1] == "requeue 4242"
    everything = "\n".join(outputs)
    assert len(outputs) >= 2, everything[-3000:]  # preempted and requeued at least once
    assert "exiting with 143" in outputs[0], outputs[0][-3000:]
    assert f"job 4242, start {len(outputs)}" in outputs[-1]
    resumed = [line for line in outputs[1].splitlines() if line.startswith("resumed at ")]
    assert resumed and int(resumed[0].split()[-1]) > 0, outputs[1][-3000:]
    status = snapkeep.session.run_status(str(work / "out"))
    assert status is not None and status.state == "finished"
    final = deadline_trials.final_model(work)
    assert deadline_trials.identical(final, reference)


def test_kubernetes_prestop_flush_with_a_real_grace_timer(
        tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``snapkeep flush DIR`` as the preStop hook: the live trainer commits its step and exits
    143 before the grace timer (30 s, from the hook's start) SIGKILLs its group; flush exits
    75; the rerun finishes bit-identical. A second flush finds no live trainer (exit 4 for a
    'running' status whose process is gone, 75 for the recorded preemption)."""
    reference = _reference(tmp_path_factory)
    root = tmp_path / "pod"
    (root / "shm").mkdir(parents=True, mode=0o700)
    env = deadline_trials.env({"STEP_SLEEP_S": STEP_SLEEP_S, "SNAPKEEP_GRACE_S": "30"})
    trainer = subprocess.Popen([sys.executable, str(WORKER), str(root / "out"),
                                str(root / "shm"), str(STEPS)], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    timer = threading.Timer(30.0, lambda: _signal_all(trainer.pid, signal.SIGKILL))
    lines: list[str] = []
    try:
        assert trainer.stdout is not None
        for line in trainer.stdout:
            lines.append(line)
            if line.strip() == "step 20":
                break
        timer.start()  # terminationGracePeriodSeconds runs from the preStop hook's start
        hook = subprocess.run([sys.executable, "-m", "snapkeep", "flush", str(root / "out"),
                               "--timeout-s", "25"], env=deadline_trials.env({}),
                              capture_output=True, text=True, timeout=BOUND_S)
        lines.extend(trainer.stdout)
        code = trainer.wait(timeout=BOUND_S)
    finally:
        timer.cancel()
        if trainer.poll() is None:
            _signal_all(trainer.pid, signal.SIGKILL)
            trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()
    output = "".join(lines)
    assert hook.returncode == 75, hook.stdout + hook.stderr + output[-3000:]
    assert code == 143, output[-3000:]
    status = snapkeep.session.run_status(str(root / "out"))
    assert status is not None and status.state == "preempted" and status.durable
    again = subprocess.run([sys.executable, "-m", "snapkeep", "flush", str(root / "out")],
                           env=deadline_trials.env({}), capture_output=True, text=True,
                           timeout=BOUND_S)
    assert again.returncode == 75 and "nothing signalled" in again.stdout
    rerun = deadline_trials.run_to_end(root, STEPS, deadline_trials.zygote_for_worker())
    assert rerun.returncode == 0 and f"resumed at {status.step}" in rerun.stdout
    assert deadline_trials.identical(deadline_trials.final_model(root), reference)


def test_flush_without_a_live_trainer_signals_nothing(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    missing = subprocess.run([sys.executable, "-m", "snapkeep", "flush", str(out)],
                             env=deadline_trials.env({}), capture_output=True, text=True,
                             timeout=BOUND_S)
    assert missing.returncode == 4 and "no run status" in missing.stderr
    # a 'running' status whose process is gone (this one, reaped): nothing signalled
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    from snapkeep.session import RunStatus
    from snapkeep.store import resolve_storage

    storage, path = resolve_storage(str(out))
    storage.makedirs(storage.join(path, ".snapkeep"))
    stale = RunStatus(state="running", step=3, time_unix_s=time.time(),
                      pid=int(gone.stdout), host=os.uname().nodename)
    (out / ".snapkeep" / "status.json").write_bytes(stale.to_bytes())
    result = subprocess.run([sys.executable, "-m", "snapkeep", "flush", str(out)],
                            env=deadline_trials.env({}), capture_output=True, text=True,
                            timeout=BOUND_S)
    assert result.returncode == 4 and "nothing signalled" in result.stderr
