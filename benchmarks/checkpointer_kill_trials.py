"""Kill -9 trials of the plain-loop Checkpointer (``tests/support/incremental_trials.py``): a
frozen backbone (4 MiB) and a trainable head (2 MiB, AdamW), a snapshot every step, SIGKILLed at a
random moment of start-up (the sweep) or of a save (blob writes, skeleton, manifest, retention;
with a budget: the ring filled by the call and drained by the writer, the commit). After each
kill: no manifest refers to a missing or wrong blob, and the next run resumes the newest snapshot
with the uninterrupted run's state, bit for bit.

- ``Checkpointer(incremental=True, keep=2)`` (default);
- ``--staging-budget B``: ``Checkpointer(keep=2, staging_budget=B)``, full snapshots staged
  through B bytes (issue 34).

    PYTHONPATH=src python benchmarks/checkpointer_kill_trials.py [--trials 200] [--seed 0]
    PYTHONPATH=src python benchmarks/checkpointer_kill_trials.py --staging-budget 2097152

Prints one line per trial and the tally.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from support.incremental_trials import run_trials  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staging-budget", type=int, default=None,
                        help="staging_budget in bytes (full snapshots); default: incremental")
    args = parser.parse_args()
    start = time.monotonic()
    worker_args = () if args.staging_budget is None \
        else ("--staging-budget", str(args.staging_budget))
    with tempfile.TemporaryDirectory(prefix="snapkeep-kill-trials-") as tmp:
        tally = run_trials(args.trials, steps=args.steps, seed=args.seed,
                           root=pathlib.Path(tmp), log=True, worker_args=worker_args)
    print(f"\n{tally.trials} trials ({tally.kills_start} killed at start-up, {tally.kills_save} "
          f"in a save), {tally.resumes_checked} resumes checked bit-identical to the "
          f"uninterrupted run, {tally.finished_runs} runs reached the end; "
          f"{len(tally.failures)} failure(s) in {time.monotonic() - start:.0f} s")
    for failure in tally.failures:
        print("FAIL", failure)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
