"""Preemption with a real grace timer: one trial starts ``tests/cluster/deadline_worker.py`` on
a really slow storage, signals it (SIGTERM) after step 6 and SIGKILLs its process group
``grace_s`` later; then checks what the deadline decided, the directory and the status, and
reruns it to the end. ``python tests/support/deadline_trials.py N`` runs N trials with a grace
shorter than the measured durable write and N with one that fits, and prints the counts."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from support.zygote import Forked, Zygote, group_killer, shared
from support.zygote import run as run_forked

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE.parent / "cluster" / "deadline_worker.py"
SRC = HERE.parent.parent / "src"
BOUND_S = 180
STEPS = 12
PAUSE_AT = 6  # the signal arrives after step 6; the preemption is agreed at step 7
SLOW_BPS = 100_000  # ~0.8 MB of state: ~8 s per durable write (the preempted run only)
SHORT_GRACE_S = 5.0  # the RAM commit and the exit fit (slow on a loaded machine), not the write
LONG_GRACE_S = 45.0


def env(extra: dict[str, str]) -> dict[str, str]:
    """The worker's environment (local files, fast, unless ``extra`` sets ``SLOW_BPS``)."""
    path = os.pathsep.join([str(SRC), str(HERE.parent)] +
                           ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    base = {k: v for k, v in os.environ.items() if k not in ("SLOW_BPS", "SNAPKEEP_GRACE_S")}
    return dict(base, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)


def run_to_end(root: pathlib.Path, steps: int = STEPS, zygote: Zygote | None = None
               ) -> subprocess.CompletedProcess[str]:
    """Run the worker to its end (forked by ``zygote`` when given)."""
    argv = [str(root / "out"), str(root / "shm"), str(steps)]
    if zygote is not None:
        return run_forked(zygote, str(WORKER), argv, cwd=os.getcwd(), env=env({}),
                          timeout=BOUND_S)
    return subprocess.run([sys.executable, str(WORKER), *argv], env=env({}),
                          capture_output=True, text=True, timeout=BOUND_S)


def zygote_for_worker() -> Zygote:
    """The test process's zygote for ``deadline_worker.py`` (torch and snapkeep imported)."""
    return shared(("torch", "snapkeep", "support.slow_storage"), env({}))


@dataclass
class Outcome:
    returncode: int
    killed: bool
    output: str


def preempt(root: pathlib.Path, grace_s: float, zygote: Zygote | None = None) -> Outcome:
    """Run to step ``PAUSE_AT``, SIGTERM the trainer, SIGKILL its group ``grace_s`` later."""
    (root / "shm").mkdir(mode=0o700, exist_ok=True)
    return signal_with_grace(
        [sys.executable, str(WORKER), str(root / "out"), str(root / "shm"), str(STEPS)],
        env({"PAUSE_AT": str(PAUSE_AT), "SNAPKEEP_GRACE_S": str(grace_s),
             "SLOW_BPS": str(SLOW_BPS)}), f"paused {PAUSE_AT} ", grace_s, zygote)


def signal_with_grace(argv: list[str], environment: dict[str, str], paused: str,
                      grace_s: float, zygote: Zygote | None = None) -> Outcome:
    """Start ``argv`` in a session of its own; once it prints a line starting with ``paused``
    (and waits for a line on stdin), SIGTERM it, start a real grace timer that SIGKILLs its
    process group ``grace_s`` later, let it go on, and wait (bounded) for its end. With
    ``zygote``, the process is forked by it (``argv[0]`` is ``sys.executable``; see
    tests/support/zygote.py): the same signals and timer, its import already done."""
    if zygote is not None:
        return _signal_forked(zygote, argv, environment, paused, grace_s)
    proc = subprocess.Popen(argv, env=environment, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timer, killed = group_killer(proc.pid, grace_s)
    lines: list[str] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(paused):
                break
        os.kill(proc.pid, signal.SIGTERM)
        timer.start()  # the launcher's grace period runs from the signal
        proc.stdin.write("go\n")
        proc.stdin.flush()
        lines.extend(proc.stdout)
        code = proc.wait(timeout=BOUND_S)
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
    return Outcome(returncode=code, killed=killed.is_set() and code == -signal.SIGKILL,
                   output="".join(lines))


def _signal_forked(zygote: Zygote, argv: list[str], environment: dict[str, str], paused: str,
                   grace_s: float) -> Outcome:
    assert argv[0] == sys.executable, argv
    worker = Forked(zygote, argv[1], argv[2:], cwd=os.getcwd(), env=environment,
                    with_stdin=True)
    timer, killed = group_killer(worker.pid, grace_s)
    lines: list[str] = []
    try:
        assert worker.stdin is not None
        for line in worker.stdout:
            lines.append(line)
            if line.startswith(paused):
                break
        os.kill(worker.pid, signal.SIGTERM)
        timer.start()  # the launcher's grace period runs from the signal
        worker.stdin.write("go\n")
        worker.stdin.flush()
        lines.extend(worker.stdout)
        code = worker.wait()  # bounded: the timer kills it grace_s after the signal
    finally:
        timer.cancel()
        try:
            lines.append(worker.stderr())
        finally:
            worker.close()
    return Outcome(returncode=code, killed=killed.is_set() and code == -signal.SIGKILL,
                   output="".join(lines))


def listing(out: pathlib.Path) -> list[str]:
    """Every file under ``out``, relative (snapkeep's lock file left out)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")
                  if p.is_file() and not p.name.endswith(".lock"))


def final_model(root: pathlib.Path) -> dict[str, Any]:
    return torch.load(root / "final.pt", weights_only=True)


def identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trial(root: pathlib.Path, grace_s: float, reference: dict[str, Any],
          zygote: Zygote | None = None) -> str:
    """One trial; '' when everything held, else what did not (its runs forked by ``zygote``
    when given)."""
    import snapkeep

    outcome = preempt(root, grace_s, zygote)
    status = snapkeep.session.run_status(str(root / "out"))
    files = listing(root / "out")
    short = grace_s < LONG_GRACE_S
    want = ("ram", 79, ["ckpt_4"]) if short else ("storage", 143, ["ckpt_4", "ckpt_7"])
    snapshots = sorted(f for f in files if not f.startswith(".snapkeep"))
    problems = []
    if outcome.returncode != want[1]:
        problems.append(f"exit {outcome.returncode} (killed: {outcome.killed}), "
                        f"want {want[1]}")
    if status is None or status.state != "preempted" or \
            status.preemption.get("committed_to") != want[0]:
        problems.append(f"status {status}")
    if snapshots != want[2] or any(".snapkeep-tmp." in f for f in files):
        problems.append(f"files {files}")
    rerun = run_to_end(root, zygote=zygote)
    if rerun.returncode != 0 or "resumed at 7" not in rerun.stdout:
        problems.append(f"rerun exit {rerun.returncode}: {rerun.stdout[-500:]}"
                        f"{rerun.stderr[-1500:]}")
    elif not identical(final_model(root), reference):
        problems.append("rerun not bit-identical to the uninterrupted run")
    if problems:
        return "; ".join(problems) + "\n" + outcome.output[-2000:]
    return ""


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref_root = pathlib.Path(tmp) / "reference"
        ref_root.mkdir()
        (ref_root / "shm").mkdir(mode=0o700)
        done = run_to_end(ref_root)
        assert done.returncode == 0, done.stderr
        reference = final_model(ref_root)
        counts = {SHORT_GRACE_S: 0, LONG_GRACE_S: 0}
        for i in range(n):
            for grace in counts:
                root = pathlib.Path(tmp) / f"t{i}-{grace}"
                root.mkdir()
                problem = trial(root, grace, reference)
                if problem:
                    print(f"trial {i} grace {grace}: {problem}", flush=True)
                else:
                    counts[grace] += 1
        print(f"grace {SHORT_GRACE_S} s (< durable write): {counts[SHORT_GRACE_S]}/{n} "
              f"committed to RAM, no durable write, nothing torn, resumed bit-identical")
        print(f"grace {LONG_GRACE_S} s (fits): {counts[LONG_GRACE_S]}/{n} committed to "
              f"storage before the kill, resumed bit-identical")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
