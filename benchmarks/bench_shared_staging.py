"""What a step taken by both the snapshot extension and the memory tier costs the loop, with the
tier borrowing the writer's staged copy (no second staging) against the tier staging its own.

Usage::

    python benchmarks/bench_shared_staging.py --state-gib 1 --reps 4 \\
        --json benchmarks/results/shared-staging-1gib.json
    python benchmarks/bench_shared_staging.py --quick     # 64 MiB, 2 runs: a smoke run

State: ``bench_resume.make_model`` (a model of 1/3 of ``--state-gib`` in 8 float32 tensors plus
Adam's two moments), one torch thread. A training iteration is an Adam step over the state (the
same gradient tensors every iteration).
Each run is a fresh process that trains ``--triggers`` x ``--segment`` iterations; the first
iteration of each segment fires the contender's extensions (all with ``ThreadWriter`` for the
durable snapshot, overlap on, and ``MemoryTier(every=segment, replicas=0)`` in a tmpfs directory):

- ``snapshot only``: the snapshot extension;
- ``snapshot + tier, shared staging``: the tier registered after the snapshot (it borrows);
- ``snapshot + tier, own staging``: the tier registered first (it stages its own copy: what
  every step cost before);
- ``no snapshot``: the baseline for CPU time.

Per run: before each triggering iteration the writer's and the tier's background work is waited
for, outside the timing (**spill s**: how long that took, i.e. how much of it a segment did not
absorb); **call s** = the time inside the manager's extensions at a triggering iteration (the
stall the loop sees at the call, with nothing in flight: the staging copy), median over the
triggers after the first (the first pays fresh pages); **CPU s per snapshot** = the process's
CPU time (all threads) over the run minus the ``no snapshot`` run's, per trigger, with
everything waited for at the end;
**peak RSS GiB** = the process's maximum resident set (``ru_maxrss``). Contenders run in ABBA
order over ``--reps`` repetitions, fresh processes; tables give medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from _measure import GIB, median, table
from bench_resume import make_model

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

CONTENDERS = ("no snapshot", "snapshot only", "snapshot + tier, shared staging",
              "snapshot + tier, own staging")


def child(contender: str, work: str, shm: str, state_gib: float, triggers: int,
          segment: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, optimizer = make_model(state_gib)
    grads = [torch.full_like(p, 1e-3) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    optimizer.step()  # Adam's moments exist: the whole state
    out = os.path.join(work, "out")
    writer = writing.ThreadWriter(out_dir=out)
    manager = ExtensionsManager({"main": model}, {"main": optimizer}, max_epochs=1,
                                iters_per_epoch=10**7, out_dir=out, writer=writer)
    tier = ext.memory_tier(ext.MemoryTier(every=segment, replicas=0, root=shm, job="bench"))
    snapshot = ext.snapshot(filename="snapshot_iter_{.iteration}", n_retains=1, quiet=True)
    if contender == "snapshot + tier, own staging":
        manager.extend(tier)
    if contender != "no snapshot":
        manager.extend(snapshot, trigger=(segment, "iteration"))
    if contender == "snapshot + tier, shared staging":
        manager.extend(tier)
    calls: list[float] = []
    spills: list[float] = []
    run_extensions = manager.run_extensions

    def timed() -> None:
        began = time.perf_counter()
        run_extensions()
        if manager.iteration % segment == 0:
            calls.append(time.perf_counter() - began)

    manager.run_extensions = timed  # type: ignore[method-assign]
    manager.start_extensions()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(triggers * segment):
        if (manager.iteration + 1) % segment == 0 and contender != "no snapshot":
            began = time.perf_counter()  # nothing in flight at the call: staging alone
            if contender in CONTENDERS[2:]:
                tier.wait()
            writer.wait()
            spills.append(time.perf_counter() - began)
        with manager.run_iteration(step_optimizers=["main"]):  # zero_grad(), body, step()
            for p, g in zip(model.parameters(), grads):  # an Adam step over the whole state
                p.grad = g  # the same gradient tensors every iteration (no fresh pages)
    if contender in CONTENDERS[2:]:
        tier.wait()
    writer.wait()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    borrowed = contender in CONTENDERS[2:] and tier.engine is not None \
        and tier.engine._buffers is None
    manager.finalize()
    return {"calls_s": calls, "spills_s": spills, "cpu_s": cpu, "wall_s": wall,
            "triggers": triggers,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "tier_staged_own": contender in CONTENDERS[2:] and not borrowed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=4, help="runs per contender (ABBA order)")
    p.add_argument("--triggers", type=int, default=4, help="triggering iterations per run")
    p.add_argument("--segment", type=int, default=3, help="iterations per trigger")
    p.add_argument("--shm", default="/dev/shm", help="tmpfs for the memory tier")
    p.add_argument("--quick", action="store_true", help="64 MiB, 2 runs: a smoke run")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.state_gib, args.reps = 1 / 16, 2
    if args.child:
        print(json.dumps(child(args.child, args.work, args.shm, args.state_gib, args.triggers,
                               args.segment)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    load_before = os.getloadavg()
    for rep in range(args.reps):
        order = CONTENDERS if rep % 4 in (0, 3) else tuple(reversed(CONTENDERS))  # ABBA
        for contender in order:
            work = tempfile.mkdtemp(prefix="bench-shared-", dir=os.getcwd())
            shm = tempfile.mkdtemp(prefix="bench-shared-", dir=args.shm)
            try:
                done = subprocess.run(
                    [sys.executable, __file__, "--child", contender, "--work", work, "--shm",
                     shm, "--state-gib", str(args.state_gib), "--triggers", str(args.triggers),
                     "--segment", str(args.segment)],
                    check=True, capture_output=True, text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
                runs[contender].append(json.loads(done.stdout.strip().splitlines()[-1]))
            finally:
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
            print(f"rep {rep + 1}/{args.reps} {contender}: done", file=sys.stderr)
    load_after = os.getloadavg()
    base_cpu = median([r["cpu_s"] for r in runs["no snapshot"]])
    rows = []
    for contender in CONTENDERS[1:]:
        rs = runs[contender]
        rows.append({
            "contender": contender,
            "first_call_s": median([r["calls_s"][0] for r in rs]),
            "call_s": median([median(r["calls_s"][1:]) for r in rs]),
            "spill_s": median([median(r["spills_s"][1:]) for r in rs]),
            "cpu_per_snapshot_s": median([(r["cpu_s"] - base_cpu) / r["triggers"] for r in rs]),
            "peak_rss_gib": median([r["peak_rss_gib"] for r in rs]),
            "tier_staged_own": any(r["tier_staged_own"] for r in rs),
        })
    print(f"{args.state_gib:g} GiB state, {args.reps} fresh processes per row (ABBA), "
          f"{args.triggers} triggers each, medians; load average before {load_before[0]:.1f}, "
          f"after {load_after[0]:.1f}; no-snapshot run peak RSS "
          f"{median([r['peak_rss_gib'] for r in runs['no snapshot']]):.2f} GiB")
    print(table(rows, [("contender", "contender", ""), ("first_call_s", "first call s", ".3f"),
                       ("call_s", "later calls s", ".3f"),
                       ("spill_s", "spill s", ".3f"),
                       ("cpu_per_snapshot_s", "CPU s per snapshot", ".3f"),
                       ("peak_rss_gib", "peak RSS GiB", ".2f"),
                       ("tier_staged_own", "tier staged own", "")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_gib": args.state_gib, "reps": args.reps, "rows": rows,
                       "runs": runs, "load": [load_before, load_after]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
