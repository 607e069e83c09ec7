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


def main() -> None:
    from transformers.trainer_utils import get_last_checkpoint

    from snapkeep import hf

    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
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
