"""Process worker faults: what the worker cannot receive is refused in the trainer (the worker
survives); Ctrl-C does not lose an in-flight save; a dead trainer's save never becomes visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import psutil
import pytest
import torch

import snapkeep
from snapkeep._core.save.shm import reclaim_dead_arenas
from snapkeep._core.storage import resolve_storage, set_publish_guard
from support.subprocess_util import default_sigint
from support.writer_gates import GATE_TIMEOUT_S, SocketGate

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # support.writer_gates


class LocalHolder:
    pass


def _local_class_instance() -> Any:
    class Local:
        pass

    return Local()


UNSENDABLE = {
    "lambda": (lambda: lambda x: x, "lambda"),
    "lock": (threading.Lock, "lock"),
    "local_class": (_local_class_instance, "local"),
    "nested_lambda_in_list": (lambda: [1, {"deep": lambda: 0}], "lambda"),
}


@pytest.mark.timeout(300)
def test_unsendable_leaves_are_refused_before_acceptance_and_the_worker_survives(tmp_path):
    writer = snapkeep.writing.ProcessWriter()
    try:
        writer("first", str(tmp_path), {"x": torch.ones(2)})
        writer.wait()
        pid = writer._saver.runner.pid
        for key, (make, reason) in UNSENDABLE.items():
            state = {"model": {"w": torch.ones(2)}, "extra": {key: make()}}
            with pytest.raises(TypeError, match=f"extra/{key}.*{reason}.*ThreadWriter"):
                writer(f"snap_{key}", str(tmp_path), state)
        writer("after", str(tmp_path), {"x": torch.full((2,), 3.0)})
        writer.wait()
        assert writer._saver.runner.pid == pid  # no WorkerDiedError, no respawn
    finally:
        writer.finalize()
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["after", "first"]
    assert torch.equal(torch.load(tmp_path / "after")["x"], torch.full((2,), 3.0))


def _run_script(body: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, *sys.path]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_a_class_from_the_training_script_is_refused_and_the_worker_survives(tmp_path):
    """The real case: a class defined in the script (__main__), which the worker never imports;
    ThreadWriter saves it."""
    result = _run_script("""
        import sys, torch, snapkeep
        class Config:  # defined in __main__
            lr = 0.1
        out = sys.argv[1]
        w = snapkeep.writing.ProcessWriter()
        w("first", out, {"x": torch.ones(1)}); w.wait()
        pid = w._saver.runner.pid
        try:
            w("bad", out, {"x": torch.ones(1), "cfg": {"c": Config()}})
        except TypeError as e:
            print("REFUSED", e)
        w("after", out, {"x": torch.ones(1)}); w.wait()
        print("SAME_WORKER", w._saver.runner.pid == pid)
        w.finalize()
        t = snapkeep.writing.ThreadWriter()
        t("thread", out, {"cfg": Config()}); t.finalize()
    """, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "REFUSED" in result.stdout and "cfg/c" in result.stdout
    assert "__main__" in result.stdout and "ThreadWriter" in result.stdout
    assert "SAME_WORKER True" in result.stdout
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == \
        ["after", "first", "thread"]


def _wait_for(predicate, what: str, timeout_s: float = GATE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


TRAINER = """
    import functools, os, sys, time, torch, snapkeep
    from support.writer_gates import gated_save
    out, gate = sys.argv[1], sys.argv[2]
    w = snapkeep.writing.ProcessWriter(savefun=functools.partial(gated_save, gate_address=gate))
    w("snap", out, {"x": torch.arange(1000.0)})
    print("SUBMITTED", w._saver.runner.pid, flush=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    w.finalize()
    print("FINALIZED", flush=True)
"""


def _start_trainer(tmp_path, gate: SocketGate) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, *sys.path]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(TRAINER), str(tmp_path), gate.address],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        preexec_fn=default_sigint)  # Ctrl-C must reach it even when the suite runs in background
    line = proc.stdout.readline()
    assert line.startswith("SUBMITTED"), (line, proc.stderr.read() if proc.poll() else "")
    gate.wait_entered()  # the worker is inside the save
    return proc, int(line.split()[1])


@pytest.mark.timeout(300)
def test_ctrl_c_does_not_lose_the_in_flight_save(tmp_path):
    gate = SocketGate()
    try:
        proc, worker_pid = _start_trainer(tmp_path, gate)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        assert proc.stdout.readline().startswith("INTERRUPTED")
        assert psutil.pid_exists(worker_pid)
        gate.release()
        out, err = proc.communicate(timeout=120)
    finally:
        gate.close()
    assert proc.returncode == 0, err
    assert "FINALIZED" in out
    assert torch.equal(torch.load(tmp_path / "snap")["x"], torch.arange(1000.0))


KILLED_TRAINER = """
    import functools, sys, time, torch, snapkeep
    from support.writer_gates import file_gated_save
    out, gate_dir = sys.argv[1], sys.argv[2]
    save = functools.partial(file_gated_save, gate_dir=gate_dir)
    w = snapkeep.writing.ProcessWriter(savefun=save)
    w("snap", out, {"x": torch.arange(1000.0)})
    print("SUBMITTED", w._saver.runner.pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(300)
def test_a_killed_trainers_save_never_becomes_visible(tmp_path):
    """SIGKILL of the trainer while its worker is inside a save; the save's gate then opens (as
    a slow savefun or storage would finish): the snapshot must never appear."""
    out, gate_dir = tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    gate_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, *sys.path]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_TRAINER), str(out), str(gate_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("SUBMITTED"), line
        worker = psutil.Process(int(line.split()[1]))
        _wait_for(lambda: any(n.startswith("entered.") for n in os.listdir(gate_dir)),
                  "the worker to enter the save")
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the trainer only; the worker is mid-save
        proc.wait(timeout=60)
        proc.stdout.close()
    (gate_dir / "go").touch()  # a surviving worker would now finish and commit
    try:
        _wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE,
                  "the orphaned worker to die", timeout_s=60)
    except AssertionError:
        worker.kill()
        raise
    assert [n for n in os.listdir(out) if not n.startswith(".")] == []
    storage, d = resolve_storage(str(out))
    storage.remove_stale_temps(d)  # the next run's sweep removes the dead worker's temp
    assert [n for n in os.listdir(out) if n != ".snapkeep"] == []
    reclaim_dead_arenas()  # and the next writer start frees the killed trainer's arena


def test_publish_guard_refuses_the_final_rename_and_leaves_nothing(tmp_path):
    storage, d = resolve_storage(str(tmp_path))

    class Dead(RuntimeError):
        pass

    def guard() -> None:
        raise Dead("trainer gone")

    set_publish_guard(guard)
    try:
        with pytest.raises(Dead):
            storage.write_bytes(os.path.join(d, "snap"), b"data")
    finally:
        set_publish_guard(None)
    assert os.listdir(tmp_path) == []
