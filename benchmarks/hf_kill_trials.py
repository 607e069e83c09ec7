"""Kill -9 mid-save trials of a Hugging Face Trainer run with ``snapkeep.hf.SnapkeepCallback``.

Each trial runs ``tests/doors/hf_worker.py`` (a tiny GPT-2 built in code, CPU, 12 steps, a
checkpoint every 2), SIGKILLs it inside the save of a random checkpoint at a random stage of
that save (after the weights; with ``optimizer.pt`` half written; after ``trainer_state.json``,
before snapkeep's marker), then:

- stock: ``get_last_checkpoint`` picks a directory; is it the broken one, and does
  ``trainer.train(resume_from_checkpoint=<it>)`` run?
- snapkeep: ``latest_verified`` picks one; is it the newest complete one, and does the resumed
  run end bit-identical to an uninterrupted run?

    PYTHONPATH=src python benchmarks/hf_kill_trials.py [--trials 20] [--seed 0]

``--mid-epoch``: the exact-continuation trials (issue 32): the run is
``tests/doors/continuation_worker.py hf`` (``SnapkeepTrainer``, dropout, a checkpoint every
step, 3 epochs of 5 batches); each trial SIGKILLs it once the checkpoint of a random mid-epoch
step is committed and reruns it (``latest_verified``); every step after the resume must feed the
same batch and dropout mask as the uninterrupted run and the end state must be bit-identical.

Prints one line per trial and the tally.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "doors" / "hf_worker.py"
CONTINUATION = ROOT / "tests" / "doors" / "continuation_worker.py"
MID_EPOCH_STEPS, PER_EPOCH = 15, 5
STEPS, EVERY = 12, 2
STAGES = ("model", "optimizer", "state")
BOUND_S = 300


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]),
                OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")


def run(out: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(WORKER), str(out), "--max-steps", str(STEPS),
                           "--callback", *args], env=env(), capture_output=True, text=True,
                          timeout=BOUND_S)


def kill_mid_save(out: pathlib.Path, step: int, stage: str) -> None:
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out), "--max-steps", str(STEPS),
                             "--callback", "--hold-at", str(step), "--hold-stage", stage],
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holding = out / f"holding-{step}"
    deadline = time.monotonic() + BOUND_S
    while not holding.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        if not holding.exists():
            raise RuntimeError(f"worker ended ({proc.poll()}) before holding at {step}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    holding.unlink()


def identical(a: pathlib.Path, b: pathlib.Path) -> bool:
    x, y = (torch.load(p / "final.pt", weights_only=True) for p in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def deep_equal(a: object, b: object) -> bool:
    """Tensors bit for bit (dtype included), containers element by element."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            deep_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def continuation_run(cwd: pathlib.Path, *extra: str
                     ) -> tuple[int, list[tuple[int, str]], str]:
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, str(CONTINUATION), "hf", "ckpt", str(MID_EPOCH_STEPS),
                           "--batches-per-epoch", str(PER_EPOCH), *extra], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=BOUND_S)
    steps = [(int(line.split()[1]), line.split()[2]) for line in done.stdout.splitlines()
             if line.startswith("step ")]
    return done.returncode, steps, done.stderr


def mid_epoch(trials: int, seed: int) -> int:
    """The exact-continuation trials (``--mid-epoch``, module docstring)."""
    rng = random.Random(seed)
    mid = [s for s in range(1, MID_EPOCH_STEPS) if s % PER_EPOCH]
    identical_runs = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        code, expected, err = continuation_run(root / "reference")
        if code != 0:
            print(f"the uninterrupted run failed: {err[-2000:]}")
            return 2
        for trial in range(trials):
            step = rng.choice(mid)
            cwd = root / f"m{trial}"
            killed, _, _ = continuation_run(cwd, "--kill-at", str(step))
            code, steps, err = continuation_run(cwd)
            resumed = f"resuming from checkpoint-{step} (step {step})" in err
            same = code == 0 and resumed and steps == expected[step:] \
                and deep_equal(*(torch.load(p / "final.pt", weights_only=True)
                                 for p in (root / "reference", cwd)))
            identical_runs += same
            print(f"trial {trial + 1:2d}: killed (rc {killed}) once checkpoint-{step} "
                  f"({step % PER_EPOCH} of {PER_EPOCH} batches into epoch "
                  f"{step // PER_EPOCH + 1}) was committed; resumed from it: {resumed}; "
                  f"bit-identical: {same}" + ("" if same else f"  {err[-1500:]}"), flush=True)
            shutil.rmtree(cwd)
    print(f"\n{identical_runs}/{trials} mid-epoch resumes bit-identical to the uninterrupted run "
          "(every step's batch and dropout mask, and the end state)")
    return 0 if identical_runs == trials else 1


def main() -> None:
    from transformers.trainer_utils import get_last_checkpoint

    from snapkeep import hf

    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mid-epoch", action="store_true",
                   help="the exact-continuation trials (module docstring)")
    a = p.parse_args()
    if a.mid_epoch:
        sys.exit(mid_epoch(a.trials, a.seed))
    rng = random.Random(a.seed)
    tally = {"stock_broken": 0, "stock_resume_failed": 0, "ours_newest_complete": 0,
             "ours_identical": 0}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        reference = root / "reference"
        assert run(reference).returncode == 0
        for trial in range(a.trials):
            step = rng.randrange(EVERY, STEPS + 1, EVERY)
            stage = rng.choice(STAGES)
            out = root / f"t{trial}"
            kill_mid_save(out, step, stage)
            stock = get_last_checkpoint(str(out))
            broken = stock == str(out / f"checkpoint-{step}")
            tally["stock_broken"] += broken
            copy = root / f"stock{trial}"
            shutil.copytree(out, copy)
            stock_run = run(copy, "--resume", "stock")
            stock_failed = stock_run.returncode != 0
            tally["stock_resume_failed"] += stock_failed
            shutil.rmtree(copy)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ours = hf.latest_verified(out)
            expected = str(out / f"checkpoint-{step - EVERY}") if step > EVERY else None
            tally["ours_newest_complete"] += ours == expected
            resumed = run(out, "--resume", "verified")
            same = resumed.returncode == 0 and identical(reference, out)
            tally["ours_identical"] += same
            error = stock_run.stderr.strip().splitlines()[-1][:90] if stock_failed else "ran"
            print(f"trial {trial:2d}: killed in checkpoint-{step:<2d} at {stage:9s} | stock "
                  f"picks {pathlib.Path(stock or '-').name} ({'broken' if broken else 'ok'}), "
                  f"resume: {error} | snapkeep picks {pathlib.Path(ours or '-').name}, "
                  f"bit-identical: {same}", flush=True)
            shutil.rmtree(out)
    n = a.trials
    print(f"\nstock get_last_checkpoint picked the killed directory: {tally['stock_broken']}/{n}"
          f"; stock resume from it failed: {tally['stock_resume_failed']}/{n}")
    print(f"snapkeep latest_verified picked the newest complete checkpoint: "
          f"{tally['ours_newest_complete']}/{n}; resumed run bit-identical to uninterrupted: "
          f"{tally['ours_identical']}/{n}")


if __name__ == "__main__":
    main()
