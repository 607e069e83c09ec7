"""Kill -9 trials of incremental snapshots (``tests/support/incremental_worker.py``).

Each trial starts the worker on the trial directory (resuming whatever the earlier trials left)
and SIGKILLs it at a random moment: during start-up (lock, listing, the sweep of blobs and
temporary files, the load), or a random 0-60 ms after a random save call returned (the
background commit: blob writes, the blob directory's fsync, the skeleton and its manifest,
retention deleting a snapshot, its manifest and its blobs). After each kill:

- no dangling reference: every blob each manifest lists is there, of its size, hashing to its
  name (so no referenced blob was deleted);
- the next run resumes the newest snapshot file (every file under a snapshot name is complete:
  atomic publish), and the state it loads is bit-identical to the uninterrupted run's at that
  step (digests printed by the worker's ``--reference`` run);
- a run that reaches the end has the uninterrupted run's final state; the directory then starts
  over.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

import xxhash

WORKER = pathlib.Path(__file__).with_name("incremental_worker.py")
BOUND_S = 120
_SNAPSHOT = re.compile(r"^ckpt_(\d+)$")


@dataclasses.dataclass
class Tally:
    trials: int = 0
    kills_start: int = 0
    kills_save: int = 0
    resumes_checked: int = 0
    finished_runs: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore")


def reference(steps: int, tmp: pathlib.Path) -> dict[int, str]:
    run = subprocess.run([sys.executable, str(WORKER), str(tmp / "unused"), "--steps",
                          str(steps), "--reference"], env=env(), capture_output=True, text=True,
                         timeout=BOUND_S, check=True)
    return {int(s): d for _, s, d in (line.split() for line in run.stdout.splitlines())}


def newest_step(out: pathlib.Path) -> int:
    steps = [int(m.group(1)) for p in out.glob("ckpt_*") if (m := _SNAPSHOT.match(p.name))]
    return max(steps, default=0)


def dangling(out: pathlib.Path) -> list[str]:
    """Every problem with the references of the manifests in ``out``."""
    problems = []
    for manifest in sorted((out / ".snapkeep").glob("ckpt_*.json")):
        body = json.loads(manifest.read_text())
        area = out / body.get("blob_area", "")
        for digest, nbytes in body.get("blobs", {}).items():
            blob = area / digest
            if not blob.is_file():
                problems.append(f"{manifest.name}: blob {digest} missing")
            elif blob.stat().st_size != nbytes or \
                    xxhash.xxh3_128(blob.read_bytes()).hexdigest() != digest:
                problems.append(f"{manifest.name}: blob {digest} wrong size or content")
    return problems


def run_trials(trials: int, *, steps: int = 12, seed: int = 0, root: pathlib.Path,
               log: bool = False, worker_args: tuple[str, ...] = ()) -> Tally:
    """``worker_args``: more arguments of the worker (``--staging-budget N``: full snapshots
    staged through N bytes, issue 34)."""
    rng = random.Random(seed)
    ref = reference(steps, root)
    out = root / "run"
    tally = Tally()
    for trial in range(trials):
        expected = newest_step(out) if out.exists() else 0
        phase = "start" if rng.random() < 0.25 else "save"
        target = rng.randint(expected + 1, steps) if expected < steps else steps
        delay_s = rng.uniform(0, 0.4) if phase == "start" else rng.uniform(0, 0.06)
        proc = subprocess.Popen([sys.executable, str(WORKER), str(out), "--steps", str(steps),
                                 *worker_args],
                                env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        finished = None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                words = line.split()
                if words[:1] == ["resumed"]:
                    step, state = int(words[1]), words[2]
                    tally.resumes_checked += 1
                    if step != expected:
                        tally.failures.append(f"trial {trial}: resumed step {step}, the newest "
                                              f"snapshot was {expected}")
                    elif state != ref[step]:
                        tally.failures.append(f"trial {trial}: state at step {step} differs "
                                              "from the uninterrupted run's")
                if words[:1] == ["final"]:
                    finished = words[1]
                kill = (phase == "start" and words[:1] == ["starting"]) or \
                    (phase == "save" and words[:1] == ["saved"] and int(words[1]) >= target)
                if kill:
                    time.sleep(delay_s)
                    os.kill(proc.pid, signal.SIGKILL)
                    tally.kills_start += phase == "start"
                    tally.kills_save += phase == "save"
                    break
            proc.wait(timeout=BOUND_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        tally.trials += 1
        problems = dangling(out)
        tally.failures += [f"trial {trial}: {p}" for p in problems]
        if finished is not None:
            tally.finished_runs += 1
            if finished != ref[steps]:
                tally.failures.append(f"trial {trial}: the final state differs")
            for path in sorted(out.rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
        if log:
            print(f"trial {trial:3d}: kill at {phase:5s} (resume expected {expected:2d}, "
                  f"target {target:2d}, +{delay_s * 1000:3.0f} ms) "
                  f"{'FINISHED ' if finished else ''}{'; '.join(problems) or 'ok'}",
                  flush=True)
    return tally
