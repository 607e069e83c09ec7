"""Crash trials: SIGKILL a training run at random moments during its saves, restart it, and check
that it resumes from the newest committed snapshot and that no snapshot is ever torn.

    python tools/crash_trials.py --trials 100            # fork server (fast)
    python tools/crash_trials.py --trials 5 --fresh      # a fresh interpreter per run (slow)

Each trial: start (or restart) ``tools/crash_child.py`` on the same directory; it autoloads and
prints what it loaded; once its first, second or third save has begun (chosen at random) and a
further random delay of up to about one save's duration has passed, it gets SIGKILL: somewhere
inside the save (encode, write, fsync, replace, manifest, retention) or just after it.

Then, before the next start, every snapshot file left in the directory is checked: one with a
manifest must verify against it, and every one must load completely and hold the parameters of
its step (one without a manifest was killed between the two commits). The newest of them is what
the next start must load; it must be the last one the killed run recorded as committed
(``committed.log``, written by a post-commit hook) or resumed from, or the one whose save had
begun, if its file was already committed when the kill came. The restart must also find no
temporary file left (they are removed at start-up).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from snapkeep._core.load.loading import load_file
from snapkeep._core.storage import resolve_storage
from snapkeep.store import SnapshotStore as Catalog
from snapkeep.store import ppe_template

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_child.py")
sys.path.insert(0, os.path.dirname(CHILD))
from crash_child import TEMPLATE, expected_param  # noqa: E402

READY_TIMEOUT_S = 120.0


@dataclasses.dataclass
class Report:
    """Counts of what the trials saw; ``failures`` lists every violated expectation."""

    trials: int = 0
    killed_during_save: int = 0
    killed_after_commit_before_record: int = 0
    resumed_unverified: int = 0
    files_checked: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.trials > 0 and not self.failures


class _Lines:
    """Lines from a pipe, each read bounded by a deadline."""

    def __init__(self, stream: Any) -> None:
        self._fd = stream.fileno()
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._fd, selectors.EVENT_READ)

    def read(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._selector.select(remaining):
                raise TimeoutError(f"no line within {timeout_s} s (have {self._buffer!r})")
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise EOFError(f"pipe closed (have {self._buffer!r})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


class ForkServer:
    """Starts runs by asking a fork server (``crash_child.py zygote``) for a child."""

    def __init__(self, stderr: Any = None) -> None:
        self._proc = subprocess.Popen([sys.executable, CHILD, "zygote"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=stderr)
        self._lines = _Lines(self._proc.stdout)
        first = self._lines.read(READY_TIMEOUT_S)
        if first != "serving":
            raise RuntimeError(f"fork server did not start: {first!r}")
        self._pid: int | None = None

    def start(self, out: str, writer: str) -> str:
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"run {out} {writer}\n".encode())
        self._proc.stdin.flush()
        line = self._lines.read(READY_TIMEOUT_S)
        if not line.startswith("pid "):
            raise RuntimeError(f"fork server: {line!r}")
        self._pid = int(line.split()[1])
        return self._lines.read(READY_TIMEOUT_S)

    def read_line(self) -> str:
        return self._lines.read(READY_TIMEOUT_S)

    def kill(self) -> None:
        if self._pid is None:
            return
        os.kill(self._pid, signal.SIGKILL)
        while True:  # the server reaps the child and says so
            line = self._lines.read(READY_TIMEOUT_S)
            if line.startswith(f"exit {self._pid} "):
                break
        self._pid = None

    def close(self) -> None:
        self.kill()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=60)


class FreshProcesses:
    """Starts each run as a new interpreter (``crash_child.py child``)."""

    def __init__(self, stderr: Any = None) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: _Lines | None = None
        self._stderr = stderr

    def start(self, out: str, writer: str) -> str:
        self._proc = subprocess.Popen([sys.executable, CHILD, "child", "--out", out,
                                       "--writer", writer], stdout=subprocess.PIPE,
                                      stderr=self._stderr)
        self._lines = _Lines(self._proc.stdout)
        return self.read_line()

    def read_line(self) -> str:
        assert self._lines is not None
        return self._lines.read(READY_TIMEOUT_S)

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()  # SIGKILL
            self._proc.wait(timeout=60)
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None

    def close(self) -> None:
        self.kill()


def _parse_ready(line: str) -> dict[str, str]:
    if not line.startswith("ready "):
        raise RuntimeError(f"the run did not start: {line!r}")
    return dict(part.split("=", 1) for part in line.split()[1:])


def _last_step(path: str) -> int:
    """Step of the last complete line of a log (0 when empty)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f.read().split("\n")[:-1] if line.strip()]
    return int(lines[-1].split()[0]) if lines else 0


def check_directory(out: str, report: Report) -> int:
    """Check every snapshot file in ``out`` (see module docstring); return the newest step."""
    storage, directory = resolve_storage(out)
    catalog = Catalog(storage, directory, ppe_template(TEMPLATE))
    newest = 0
    for entry in catalog.entries():
        report.files_checked += 1
        step = int(entry.step or 0)
        try:
            # no manifest: killed between the snapshot's commit and its manifest's
            catalog.verify(entry)
            state = load_file(storage, entry.path)
            params = state["models"]["main"]
            if int(state["_start_iteration"]) != step or not all(
                    torch.equal(t, expected_param(step, t.shape)) for t in params.values()):
                report.failures.append(f"{entry.name}: values are not those of step {step}")
        except Exception as e:  # any failure to verify or load is a torn snapshot
            report.failures.append(f"{entry.name}: torn ({type(e).__name__}: {e})")
            continue
        newest = max(newest, step)
    return newest


def run_trials(
    trials: int, work_dir: str, *, seed: int = 0, fresh: bool = False, writer: str = "simple",
    max_delay_s: float = 0.04, progress: bool = False,
) -> Report:
    """Run ``trials`` kill/restart cycles in ``work_dir``; see the module docstring."""
    rng = random.Random(seed)
    out = os.path.join(work_dir, "out")
    begun, committed = os.path.join(work_dir, "begun.log"), os.path.join(work_dir, "committed.log")
    stderr = open(os.path.join(work_dir, "children.stderr"), "ab")  # warnings, tracebacks
    launcher: ForkServer | FreshProcesses = \
        FreshProcesses(stderr) if fresh else ForkServer(stderr)
    report = Report()
    expected: int | None = 0
    try:
        for trial in range(trials + 1):  # the last start only checks the last kill
            ready = _parse_ready(launcher.start(out, writer))
            loaded = int(ready["loaded"])
            if expected is not None and loaded != expected:
                report.failures.append(f"trial {trial}: loaded step {loaded}, newest committed "
                                       f"snapshot is {expected}")
            if loaded and ready["consistent"] != "1":
                report.failures.append(f"trial {trial}: loaded values are not those of step "
                                       f"{loaded}")
            if ready["temps"] != "0":
                report.failures.append(f"trial {trial}: {ready['temps']} temporary file(s) left "
                                       "after start-up")
            if loaded and ready["verified"] != "1":
                report.resumed_unverified += 1
            if trial == trials:
                break
            saves = rng.randint(1, 3)
            while saves:  # let the run start its first, second or third save ...
                if launcher.read_line().startswith("begin "):
                    saves -= 1
            time.sleep(rng.uniform(0.0, max_delay_s))  # ... and kill it somewhere inside
            launcher.kill()
            report.trials += 1
            last_begun, last_committed = _last_step(begun), _last_step(committed)
            # what must survive: everything recorded as committed and what this run resumed from
            baseline = max(last_committed, loaded)
            newest = check_directory(out, report)
            if last_begun > baseline:
                report.killed_during_save += 1
            if newest == baseline or (newest == last_begun and newest > baseline):
                if newest > baseline:
                    report.killed_after_commit_before_record += 1
                expected = newest
            else:
                report.failures.append(
                    f"trial {trial}: newest valid snapshot is step {newest}; the run resumed "
                    f"from {loaded}, recorded step {last_committed} as committed and had begun "
                    f"step {last_begun}")
                expected = None
            if progress:
                print(f"trial {trial + 1}/{trials}: killed at step {last_begun} "
                      f"(committed {last_committed}), newest valid {newest}", flush=True)
    finally:
        launcher.close()
        stderr.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true",
                        help="a fresh interpreter per run instead of the fork server (slow)")
    parser.add_argument("--writer", default="simple", choices=["simple", "thread"])
    parser.add_argument("--max-delay-s", type=float, default=0.04,
                        help="kill at a uniform random delay up to this after a save starts "
                        "(about one save's duration)")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="snapkeep-crash-")
    os.makedirs(work, exist_ok=True)
    start = time.monotonic()
    report = run_trials(args.trials, work, seed=args.seed, fresh=args.fresh, writer=args.writer,
                        max_delay_s=args.max_delay_s, progress=args.progress)
    summary = {**dataclasses.asdict(report), "ok": report.ok, "writer": args.writer,
               "seconds": round(time.monotonic() - start, 1), "dir": work}
    print(json.dumps(summary, indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
