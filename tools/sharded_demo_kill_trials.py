"""Kill -9 trials of the sharded demo under torchrun (FSDP2, 2 gloo ranks) at random moments.

    python tools/sharded_demo_kill_trials.py /tmp/trials 5 [--iterations 30] [--model-size medium]

An uninterrupted run first (a snapshot every iteration); then each trial starts the same run,
SIGKILLs its whole process group at a random moment between 30 % and 90 % of the uninterrupted
run's time, reruns it to the end (it resumes from the newest committed snapshot) and compares the
last snapshot's every tensor (parameters and Adam state, through DCP's ``dcp_to_torch_save``) bit
for bit with the uninterrupted run's. ``--model-size medium`` gives a 2 MiB local shard per rank
(a 1024 x 1024 layer) and its moments: the SHARDED extension's overlapped staging defers them.
Prints one line per trial and the count of bit-identical trials; exit status 1 if any differs.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _command(out: str, iterations: int, model_size: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "snapkeep.demo_sharded", "--out", out, "--iterations", str(iterations),
            "--snapshot-interval", "1", "--model-size", model_size, "--timeout-s", "60"]


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(directory, directory + ".pt")
    state = torch.load(directory + ".pt", weights_only=False)
    os.remove(directory + ".pt")
    found: dict[str, torch.Tensor] = {}

    def walk(value: object, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, torch.Tensor):
            found[path] = value

    walk(state, "")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("trials", type=int)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--model-size", default="medium")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    shutil.rmtree(args.base, ignore_errors=True)
    os.makedirs(args.base)
    last = f"snapshot_iter_{args.iterations}"
    started = time.monotonic()
    subprocess.run(_command(f"{args.base}/reference", args.iterations, args.model_size),
                   env=env, check=True, capture_output=True)
    reference_s = time.monotonic() - started
    reference = _tensors(f"{args.base}/reference/{last}")
    print(f"uninterrupted: {reference_s:.1f} s, {len(reference)} tensors", flush=True)
    same_count = 0
    for trial in range(args.trials):
        out = f"{args.base}/trial{trial}"
        proc = subprocess.Popen(_command(out, args.iterations, args.model_size), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        delay = random.uniform(0.3 * reference_s, 0.9 * reference_s)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rerun = subprocess.run(_command(out, args.iterations, args.model_size), env=env,
                               capture_output=True, text=True)
        resumed = next((line for line in rerun.stdout.splitlines()
                        if "resumed from" in line or "starting fresh" in line), "?")
        got = _tensors(f"{out}/{last}") if rerun.returncode == 0 else {}
        same = got.keys() == reference.keys() and all(
            torch.equal(got[k], reference[k]) for k in reference)
        same_count += same
        print(f"trial {trial}: killed at {delay:.1f} s; rerun exit {rerun.returncode}: "
              f"{resumed.strip()}; bit-identical: {same}", flush=True)
        shutil.rmtree(out)
    print(f"{same_count}/{args.trials} bit-identical")
    return 0 if same_count == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
