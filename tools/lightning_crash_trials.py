"""Lightning kill trials (issue 26's done-when): SIGKILL a ``Trainer`` fit that checkpoints
through ``SnapkeepCheckpointIO`` at random moments, rerun it with ``ckpt_path="last"``, and check
that the rerun resumes from a verified snapshot and ends bit-identical to an uninterrupted run.

    python tools/lightning_crash_trials.py --trials 50 [--seed 26]

The run is ``tests/doors/lightning_worker.py`` (6 epochs x 8 steps, a snapshot at each epoch
end, ``save_top_k=2`` on the epoch loss, ``save_last=True``). The trials rotate over three kinds
of moment:

- ``time``: after a uniform random delay from the start, up to the uninterrupted run's duration
  (start-up, training, a save in flight, teardown);
- ``step``: right after a random optimizer step (1-47), mid-epoch or just after a save began;
- ``in-save``: the k-th save (k random, 1-6) kills itself half-way through its temp file.

``--continuation``: the exact-continuation trials (issue 32): the run is
``tests/doors/continuation_worker.py lightning`` (torchdata's ``StatefulDataLoader``, dropout,
``every_n_train_steps=2``, ``val_check_interval=3``, 5 batches an epoch, 15 steps), SIGKILLed
right after a random step (1-14; a snapshot may be in flight), rerun; every step after the
resume must feed the same batch and dropout mask as the uninterrupted run and the end state
must be bit-identical. Prints one line per trial (the step resumed from, mid-epoch or at an
epoch's end) and the tally.

With ``--from-step 9`` every kill comes after the first save began (the time delay counts
from step 9, steps are drawn from 9-47, in-save kills from saves 2-6), so a rerun has a
committed snapshot to resume from unless that first save was still in flight.

Then the directory is checked before the rerun: every snapshot with a manifest verifies (no torn
file under a final name) and ``last.ckpt`` names a committed snapshot. The rerun must print the
snapshot it restored (or start fresh when none was committed) and end with the reference's
final model and optimizer state, bit for bit. Prints one line per trial and the tally.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, os.pardir, "tests", "doors", "lightning_worker.py")
CONTINUATION = os.path.join(HERE, os.pardir, "tests", "doors", "continuation_worker.py")
#: The continuation trials' run: 3 epochs of 5 batches, a snapshot every 2 steps, validation
#: every 3 batches, torchdata's StatefulDataLoader.
CONTINUATION_ARGS = ["15", "--loader", "stateful", "--every", "2", "--val-every", "3",
                     "--batches-per-epoch", "5"]
BOUND_S = 300.0


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
                PYTHONWARNINGS="ignore")


def _identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _kill(out: str, kind: str, rng: random.Random, duration_s: float, first: int) -> str:
    """Start the worker on ``out`` and SIGKILL it at a moment of ``kind``, from step ``first``
    on (the ``time`` delay counts from that step, up to ``duration_s``); describe it."""
    extra: list[str] = []
    if kind == "in-save":
        k = rng.randint(1 if first <= 1 else 2, 6)
        extra = ["--kill-in-save", str(k)]
        what = f"in save {k}"
    proc = subprocess.Popen([sys.executable, WORKER, out, *extra], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    try:
        if kind == "time":
            delay = rng.uniform(0.0, duration_s)
            what = f"{delay:.2f} s after step {first}"
            for line in proc.stdout if first > 0 else ():
                if line.startswith("step ") and int(line.split()[1]) >= first:
                    break
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
        elif kind == "step":
            step = rng.randint(max(first, 1), 47)
            what = f"after step {step}"
            for line in proc.stdout:
                if line.startswith("step ") and int(line.split()[1]) >= step:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        proc.wait(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return f"{what} (rc {proc.returncode})"


def _check_directory(ckpts: str) -> tuple[list[str], str | None]:
    """Every snapshot with a manifest verifies; ``last.ckpt`` names a committed snapshot.
    Returns the problems and the name of the newest committed snapshot (None: none)."""
    from snapkeep.lightning import SnapkeepCheckpointIO

    problems: list[str] = []
    if not os.path.isdir(ckpts):
        return problems, None
    io = SnapkeepCheckpointIO()
    newest = None
    try:
        for entry in io.entries(ckpts):
            newest = entry.name
            store = io._directory(ckpts, lock=False).store  # the IO's store, read only
            try:
                store.verify(entry)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{entry.name} does not verify: {e}")
        last = os.path.join(ckpts, "last.ckpt")
        if os.path.exists(last) and os.path.getsize(last) < 4096:
            target = json.loads(open(last, "rb").read())["target"]
            if not os.path.exists(os.path.join(ckpts, ".snapkeep", target + ".json")):
                problems.append(f"last.ckpt names {target}, which is not committed")
    finally:
        io.close()
    return problems, newest


def _continuation_run(cwd: str, *, kill_after: int | None = None
                      ) -> tuple[int, list[tuple[int, str]], str]:
    """One continuation worker run in ``cwd`` (SIGKILLed as soon as it says step
    ``kill_after``): its exit status, ``(step, digest)`` lines and stderr."""
    os.makedirs(cwd, exist_ok=True)
    err_path = os.path.join(cwd, "stderr.txt")
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, CONTINUATION, "lightning", "ckpt",
                                 *CONTINUATION_ARGS], cwd=cwd, env=_env(),
                                stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        steps: list[tuple[int, str]] = []
        try:
            for line in proc.stdout:
                if line.startswith("step "):
                    steps.append((int(line.split()[1]), line.split()[2]))
                    if kill_after is not None and steps[-1][0] >= kill_after:
                        os.kill(proc.pid, signal.SIGKILL)
                        break
            proc.wait(timeout=BOUND_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    with open(err_path) as f:
        return proc.returncode, steps, f.read()


def continuation(trials: int, seed: int, root: str) -> int:
    """The exact-continuation trials (module docstring, ``--continuation``)."""
    rng = random.Random(seed)
    code, expected, err = _continuation_run(os.path.join(root, "ref"))
    if code != 0:
        print(f"the uninterrupted run failed: {err[-2000:]}")
        return 2
    final = torch.load(os.path.join(root, "ref", "final.pt"), weights_only=True)
    per_epoch = int(CONTINUATION_ARGS[CONTINUATION_ARGS.index("--batches-per-epoch") + 1])
    tally = {"trials": 0, "identical": 0, "mid_epoch_resumes": 0, "epoch_end_resumes": 0,
             "fresh_starts": 0, "failures": 0}
    for trial in range(trials):
        cwd = os.path.join(root, f"c{trial:03d}")
        kill_after = rng.randint(1, len(expected) - 1)
        killed, _, _ = _continuation_run(cwd, kill_after=kill_after)
        code, steps, err = _continuation_run(cwd)
        said = [line for line in err.splitlines() if line.startswith("snapkeep: resuming from")
                or line.startswith("snapkeep: no snapshot of")]
        resumed = int(said[0].split("(step ")[1].split(")")[0]) \
            if said and "(step " in said[0] else 0
        kind = "fresh" if resumed == 0 else \
            "epoch-end" if resumed % per_epoch == 0 else "mid-epoch"
        tally["fresh_starts" if resumed == 0 else "epoch_end_resumes" if kind == "epoch-end"
              else "mid_epoch_resumes"] += 1
        same = code == 0 and steps == expected[resumed:] and _identical(
            final, torch.load(os.path.join(cwd, "final.pt"), weights_only=True))
        tally["identical"] += int(same)
        tally["failures"] += int(not same)
        tally["trials"] += 1
        print(f"trial {trial + 1:2d} killed after step {kill_after:2d} (rc {killed}) resumed "
              f"from step {resumed:2d} ({kind:9s}) bit-identical={same}"
              + ("" if same else f"  rerun rc {code}: {err[-1500:]}"), flush=True)
    print(json.dumps(tally))
    print(f"{tally['identical']}/{tally['trials']} bit-identical (every step's batch and dropout "
          f"mask, and the end state); {tally['mid_epoch_resumes']} resumed mid-epoch, "
          f"{tally['epoch_end_resumes']} at an epoch's end, {tally['fresh_starts']} fresh")
    return 0 if tally["failures"] == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--from-step", type=int, default=0,
                        help="kill only from this step on (9: after the first save began; "
                             "in-save kills then pick saves 2-6); default 0: from the start")
    parser.add_argument("--continuation", action="store_true",
                        help="the exact-continuation trials (StatefulDataLoader, dropout, "
                             "every_n_train_steps, an integer val_check_interval)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = args.dir or tempfile.mkdtemp(prefix="lightning-trials-")
    if args.continuation:
        return continuation(args.trials, args.seed, root)
    started = time.monotonic()
    reference = subprocess.Popen([sys.executable, WORKER, os.path.join(root, "ref")], env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert reference.stdout is not None
    for line in reference.stdout:  # the time kills draw from the run's time after from_step
        if line.startswith("step ") and int(line.split()[1]) >= args.from_step:
            started = time.monotonic()
            break
    reference.stdout.read()
    if reference.wait(timeout=BOUND_S) != 0:
        print("the uninterrupted run failed")
        return 2
    reference.stdout.close()
    duration_s = time.monotonic() - started
    expected = torch.load(os.path.join(root, "ref", "final.pt"), weights_only=True)
    kinds = ("time", "step", "in-save")
    tally = {"trials": 0, "resumed_verified": 0, "fresh_start": 0, "identical": 0,
             "mid_save_kills": 0, "failures": 0}
    for trial in range(args.trials):
        kind = kinds[trial % len(kinds)]
        out = os.path.join(root, f"t{trial:03d}")
        moment = _kill(out, kind, rng, duration_s, args.from_step)
        ckpts = os.path.join(out, "ckpts")
        torn = os.path.isdir(ckpts) and any(".snapkeep-tmp." in n for n in os.listdir(ckpts))
        tally["mid_save_kills"] += int(torn)
        problems, newest = _check_directory(ckpts)
        rerun = subprocess.run([sys.executable, WORKER, out], env=_env(), capture_output=True,
                               text=True, timeout=BOUND_S)
        restored = [line for line in rerun.stderr.splitlines()
                    if line.startswith("Restored all states from the checkpoint at ")]
        if rerun.returncode != 0:
            problems.append(f"rerun failed: {rerun.stderr[-2000:]}")
        elif restored:
            tally["resumed_verified"] += int("failed verification" not in rerun.stderr)
        else:
            tally["fresh_start"] += 1
        same = rerun.returncode == 0 and _identical(
            expected, torch.load(os.path.join(out, "final.pt"), weights_only=True))
        if not same and rerun.returncode == 0:
            problems.append("final state differs from the uninterrupted run")
        tally["identical"] += int(same)
        tally["trials"] += 1
        tally["failures"] += int(bool(problems))
        source = restored[0].rsplit("/", 1)[-1] if restored else "fresh start"
        if rerun.returncode == 0 and source != (newest or "fresh start"):
            problems.append(f"the newest committed snapshot was {newest}")
        print(f"trial {trial + 1:2d} {kind:7s} killed {moment:26s} mid-save={torn!s:5s} "
              f"resumed from {source:22s} identical={same}"
              + (f"  PROBLEMS: {problems}" if problems else ""), flush=True)
    print(json.dumps(tally))
    print(f"{tally['identical']}/{tally['trials']} bit-identical; "
          f"{tally['resumed_verified']} resumed from a verified snapshot, "
          f"{tally['fresh_start']} started fresh (killed before the first commit); "
          f"{tally['mid_save_kills']} killed with a save's temp file in the directory; "
          f"{tally['failures']} with problems")
    return 0 if tally["failures"] == 0 and tally["identical"] == tally["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
