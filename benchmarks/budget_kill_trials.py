"""Kill -9 trials with a staging budget (issue 34): ``Checkpointer(keep=2,
staging_budget=2 MiB)`` on the incremental trials' loop (a 10 MiB state: a 4 MiB backbone, a
2 MiB head under AdamW), a snapshot every step, SIGKILLed at a random moment of start-up or of
a save (the ring filled by the call and drained by the writer, the commit, retention). After
each kill the next run resumes the newest snapshot with the uninterrupted run's state, bit for
bit (see ``tests/support/incremental_trials.py``).

    PYTHONPATH=src python benchmarks/budget_kill_trials.py [--trials 50] [--seed 0]

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
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--budget", type=int, default=2 << 20, help="staging_budget, bytes")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="snapkeep-budget-kill-") as tmp:
        tally = run_trials(args.trials, steps=args.steps, seed=args.seed,
                           root=pathlib.Path(tmp), log=True,
                           worker_args=("--staging-budget", str(args.budget)))
    print(f"\n{tally.trials} trials ({tally.kills_start} killed at start-up, {tally.kills_save} "
          f"in a save), {tally.resumes_checked} resumes checked bit-identical to the "
          f"uninterrupted run, {tally.finished_runs} runs reached the end; "
          f"{len(tally.failures)} failure(s) in {time.monotonic() - start:.0f} s")
    for failure in tally.failures:
        print("FAIL", failure)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
