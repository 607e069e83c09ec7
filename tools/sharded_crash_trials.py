"""Crash trials for SHARDED snapshots: SIGKILL the ranks of a 2-rank FSDP2 job at random
moments, restart it on the same directory, and check that no uncommitted snapshot is ever listed
or loaded and that every committed one holds exactly the parameters of its step.

    python tools/sharded_crash_trials.py --trials 20 [--iters 150] [--kill-within-s 6]

Each trial starts ``tests/distributed/sharded_worker.py`` on 2 gloo ranks (``train`` mode: a
sharded snapshot every iteration, ``n_retains=2``, autoload, 150 iterations) and waits until
both ranks train; after a random delay of up to 6 s it SIGKILLs a random rank, then the other
one after a further random delay of up to 0.5 s (torchrun tearing the job down). Then:

- every directory the store lists (marker present) must verify completely (every file's size
  and xxh3 against the marker) and, loaded with DCP's own ``dcp_to_torch_save`` in this
  process, hold the parameters of a reference run at its step (bitwise);
- directories without a marker are counted (a kill inside a save); they must not be listed;
- the next start resumes from the newest listed snapshot (checked by its report).

A reference run (no kill) records the parameters of every step first. When a restarted run
reaches the last iteration, the directory is emptied and the next trial starts over.
Needs about 10-15 s per trial on 2 cores. ``trials()`` is what the suite's
``tests/distributed/test_sharded_crash.py`` calls, with fewer trials and iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "sharded_worker.py"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # support.ranks

from snapkeep._core.distributed.sharded_store import ShardedStore  # noqa: E402
from snapkeep._core.storage import resolve_storage  # noqa: E402
from snapkeep.store import ppe_template  # noqa: E402
from support.ranks import finish, rank_env, start  # noqa: E402

ITERS = 150
KILL_WITHIN_S = 6.0
TEMPLATE = "snapshot_iter_{.iteration}"
START_TIMEOUT_S = 180.0


def reference(base: Path, iters: int = ITERS) -> dict[int, dict[str, torch.Tensor]]:
    """Parameters after every step of an uninterrupted run."""
    out, rep = base / "ref", base / "ref_reports"
    rep.mkdir()
    procs = start(WORKER, 2, [str(base / "ref_init"), str(out), str(rep), "train", str(iters)])
    outputs = finish(procs, 300)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"reference run failed:\n{outputs}")
    states = torch.load(rep / "params_rank0.pt", weights_only=True)
    return {step: s["params"] for step, s in states.items()}


def check_directory(out: Path, ref: dict[int, dict[str, torch.Tensor]], scratch: Path
                    ) -> tuple[list[str], int, int]:
    """(failures, listed, uncommitted) of the snapshots in ``out``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    storage, directory = resolve_storage(str(out))
    store = ShardedStore(storage, directory, ppe_template(TEMPLATE))
    failures: list[str] = []
    listed = store.entries()
    for entry in listed:
        manifest = store.verify_part(entry, 0, 1)  # every file, as one rank
        if manifest.step != entry.step:
            failures.append(f"{entry.name}: marker step {manifest.step}")
        target = scratch / f"{entry.name}.pt"
        dcp_to_torch_save(entry.path, target)
        params = torch.load(target, weights_only=False)["models"]["main"]
        target.unlink()
        expected = ref.get(int(entry.step or -1))
        if expected is None:
            failures.append(f"{entry.name}: no reference for step {entry.step}")
            continue
        for key, value in expected.items():
            if not torch.equal(params[key], value):
                failures.append(f"{entry.name}: {key} differs from the reference at its step")
    return failures, len(listed), len(store.uncommitted())


def trials(n_trials: int, seed: int = 0, iters: int = ITERS,
           kill_within_s: float = KILL_WITHIN_S, log: Any = print) -> dict[str, Any]:
    """Run the reference and ``n_trials`` kill-and-restart trials of ``iters`` iterations
    (a kill within ``kill_within_s`` seconds of the start of training); return the counts and
    the failures found. Everything runs in a temporary directory, removed at the end."""
    rng = random.Random(seed)
    base = Path(tempfile.mkdtemp(prefix="sharded-crash-"))
    results: dict[str, Any] = {"trials": 0, "killed_rank": [0, 0], "uncommitted_seen": 0,
                               "snapshots_checked": 0, "resumes_checked": 0,
                               "fresh_starts": 0, "failures": []}
    try:
        log("reference run ...")
        ref = reference(base, iters)
        out = base / "out"
        expected_resume: str | None = None
        reported = 0
        for trial in range(n_trials):
            rep = base / f"r{trial}"
            rep.mkdir()
            procs = start(WORKER, 2, [str(base / f"init{trial}"), str(out), str(rep), "train",
                                      str(iters)], env={"SNAPKEEP_TEST_NO_RECORD": "1"})
            try:
                deadline = time.monotonic() + START_TIMEOUT_S
                while time.monotonic() < deadline and not all(
                        (rep / f"started_rank{r}").exists() for r in range(2)):
                    if any(p.poll() is not None for p in procs):
                        break
                    time.sleep(0.02)
                resumed_at = [(rep / f"started_rank{r}").read_text()
                              if (rep / f"started_rank{r}").exists() else None
                              for r in range(2)]
                victim = rng.randrange(2)
                time.sleep(rng.uniform(0.0, kill_within_s))
                for rank in (victim, 1 - victim):
                    if procs[rank].poll() is None:
                        os.killpg(procs[rank].pid, signal.SIGKILL)
                    time.sleep(rng.uniform(0.0, 0.5))
            finally:
                finish(procs, 60)
            results["trials"] += 1
            results["killed_rank"][victim] += 1
            want = expected_resume.rsplit("_", 1)[-1] if expected_resume else "0"
            if resumed_at[0] is not None and resumed_at != [want, want]:
                results["failures"].append(
                    f"trial {trial}: resumed at {resumed_at}, newest committed was {want}")
            elif resumed_at[0] is not None:
                results["resumes_checked"] += 1
            failures, listed, uncommitted = check_directory(out, ref, base)
            results["snapshots_checked"] += listed
            results["uncommitted_seen"] += uncommitted
            results["failures"] += [f"trial {trial}: {f}" for f in failures]
            storage, directory = resolve_storage(str(out))
            entries = ShardedStore(storage, directory, ppe_template(TEMPLATE)).entries()
            expected_resume = entries[-1].name if entries else None
            finished = any(json.loads((rep / f"train_rank{r}.json").read_text()).get(
                "iteration") == iters for r in range(2) if (rep / f"train_rank{r}.json").exists())
            if finished or (entries and entries[-1].step == iters):
                shutil.rmtree(out, ignore_errors=True)
                expected_resume = None
                results["fresh_starts"] += 1
            log(f"trial {trial}: killed rank {victim} first; listed {listed}, "
                f"uncommitted {uncommitted}, resumed at {resumed_at[0]}; "
                f"failures so far {len(results['failures'])}")
            for failure in results["failures"][reported:]:
                log(f"  FAILURE {failure}")
            reported = len(results["failures"])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iters", type=int, default=ITERS)
    parser.add_argument("--kill-within-s", type=float, default=KILL_WITHIN_S)
    args = parser.parse_args()
    results = trials(args.trials, args.seed, args.iters, args.kill_within_s,
                     log=lambda line: print(line, flush=True))
    print(json.dumps(results, indent=1))
    if results["failures"]:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.update({k: v for k, v in rank_env().items() if k == "OMP_NUM_THREADS"})
    main()
