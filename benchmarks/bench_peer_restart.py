"""Restart time per tier with two gloo ranks: own RAM, a peer's RAM (the node's tmpfs lost),
storage (every tmpfs lost).

Usage::

    python benchmarks/bench_peer_restart.py --state-gib 1 --reps 2 \\
        --json benchmarks/results/peer-restart-1gib.json

Two ranks on this machine, each its own simulated node: rank ``r``'s RAM tier is
``--shm/<run>/node<r>`` (tmpfs), storage a disk directory both share. The ``save`` phase trains
one iteration of the ``bench_resume.py`` state (``--state-gib`` per rank) with DISTRIBUTED
snapshots (saver rank 0, storage at step 1) and ``MemoryTier(every=1, replicas=1)`` (each rank's
copy in its own tmpfs and in its peer's), waits for the peer copies and exits without finalizing
(the tiers stay, as after a crash). Each restart then starts both ranks in fresh processes
(model and optimizer built) and times ``start_extensions()`` plus reading one byte of every
optimizer page, per rank:

- ``own RAM``: nothing lost; both ranks resume from their own tmpfs;
- ``peer RAM``: node 0's tmpfs wiped first; rank 0 takes its state from rank 1's tmpfs over gloo
  (checksum verified), rank 1 from its own (the row gives rank 0's time);
- ``storage``: both tmpfs wiped and the storage files' pages dropped from the page cache; both
  ranks autoload from storage (the row gives the slower rank).

``own RAM`` and ``peer RAM`` alternate (ABBA) over ``--reps``: a restart from a peer does not
write the copy back to its own tmpfs, so node 0's tier as saved is kept on disk and put back
before each ``own RAM`` restart (untimed). ``storage`` runs once, at the end (it destroys the
tiers). Medians.

The bound of the ``peer RAM`` row on this machine (``--bound``, phase ``gloo``): rank 1 sends
``--state-gib`` of bytes from warm memory to rank 0 over gloo (the transport a peer copy uses),
received once into fresh memory (``torch.empty``: what a restart receives into) and once into
memory already touched; ``--reps`` times each, medians. Fresh pages cost this VM far more than
a loopback copy: see ``bench_first_touch.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from _measure import median, table
from bench_resume import drop_cache, make_model, make_resident

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

TEMPLATE = "snapshot_iter_{.iteration}"
CASES = ("own RAM", "peer RAM")


def build(base: str, shm: str, rank: int, state_gib: float) -> tuple[Any, Any, Any, Any]:
    """(manager, model, optimizer, tier) of one rank."""
    model, optimizer = make_model(state_gib)
    out = os.path.join(base, "storage")
    manager = ExtensionsManager({"main": model}, {"main": optimizer}, max_epochs=1,
                                iters_per_epoch=10**6, out_dir=out,
                                writer=writing.SimpleWriter(out_dir=out))
    manager.extend(ext.snapshot(filename=TEMPLATE, saver_rank=0, autoload=True, timeout_s=600,
                                quiet=True), trigger=(1, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=1, replicas=1, stride=1, job="bench",
                                          root=os.path.join(shm, f"node{rank}"),
                                          timeout_s=600))
    manager.extend(tier)
    return manager, model, optimizer, tier


def rank_main(rank: int, base: str, shm: str, phase: str, state_gib: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(base, 'init-' + phase)}",
                            rank=rank, world_size=2)
    if phase == "gloo":
        gloo_bound(rank, base, state_gib)
        return
    # (manager.optimizers would start the extensions: the optimizer is used directly)
    manager, model, optimizer, tier = build(base, shm, rank, state_gib)
    if phase == "save":
        manager.start_extensions()
        with manager.run_iteration(step_optimizers=["main"]):
            for p in model.parameters():
                p.grad = torch.full_like(p, 1.0)
        tier.wait()
        dist.barrier()
        os._exit(0)  # no finalize: the tiers stay, as after a crash
    dist.barrier()
    t0 = time.perf_counter()
    manager.start_extensions()
    make_resident(optimizer)
    elapsed = time.perf_counter() - t0
    if manager.iteration != 1:
        raise RuntimeError(f"rank {rank} did not resume (iteration {manager.iteration})")
    source = tier.restored.source if tier.restored is not None else "storage"
    with open(os.path.join(base, f"report-{phase}-{rank}.json"), "w") as f:
        json.dump({"time_s": elapsed, "source": source}, f)
    dist.barrier()
    os._exit(0)  # no finalize: the next restart resumes from the same tiers


def gloo_bound(rank: int, base: str, state_gib: float, reps: int = 3) -> None:
    """Rank 1 sends ``state_gib`` GiB to rank 0 over gloo; rank 0 times the receive into fresh
    memory and into warm memory (``reps`` each, alternating), see the module docstring."""
    import torch.distributed as dist

    n = int(state_gib * (1 << 30))
    warm = torch.ones(n, dtype=torch.uint8)  # touched: warm pages on both ranks
    times: dict[str, list[float]] = {"fresh": [], "warm": []}
    for i in range(2 * reps):
        kind = "fresh" if i % 2 == 0 else "warm"
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 1:
            dist.send(warm, dst=0)
        else:
            into = torch.empty(n, dtype=torch.uint8) if kind == "fresh" else warm
            dist.recv(into, src=1)
            times[kind].append(time.perf_counter() - t0)
            del into
    if rank == 0:
        with open(os.path.join(base, "report-gloo-0.json"), "w") as f:
            json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(base: str, shm: str, phase: str, state_gib: float) -> list[dict[str, Any]]:
    init = os.path.join(base, "init-" + phase)
    if os.path.exists(init):
        os.unlink(init)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--base", base,
                               "--shm", shm, "--phase", phase, "--state-gib", str(state_gib)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"{phase} rank failed ({p.returncode}):\n{out[-3000:]}")
    if phase == "save":
        return []
    if phase == "gloo":
        path = os.path.join(base, "report-gloo-0.json")
        with open(path) as f:
            bound = json.load(f)
        os.unlink(path)
        return [bound]
    reports = []
    for r in range(2):
        path = os.path.join(base, f"report-{phase}-{r}.json")
        with open(path) as f:
            reports.append(json.load(f))
        os.unlink(path)
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=1.0, help="state per rank")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dir", default=None, help="disk directory (default: a temp dir here)")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--json", default=None)
    p.add_argument("--bound", action="store_true",
                   help="also time the gloo transfer alone (the peer row's bound)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--base", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.base, args.shm, args.phase, args.state_gib)
        return 0
    base = tempfile.mkdtemp(prefix="bench-peer-", dir=args.dir or os.getcwd())
    shm = tempfile.mkdtemp(prefix="bench-peer-", dir=args.shm)
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    try:
        run_ranks(base, shm, "save", args.state_gib)
        node0, saved0 = os.path.join(shm, "node0"), os.path.join(base, "node0-saved")
        shutil.copytree(node0, saved0)
        for rep in range(args.reps):
            for case in CASES if rep % 4 in (0, 3) else tuple(reversed(CASES)):
                shutil.rmtree(node0, ignore_errors=True)
                if case == "own RAM":
                    shutil.copytree(saved0, node0)
                runs.setdefault(case, []).append(run_ranks(base, shm, "restart", args.state_gib))
        shutil.rmtree(shm)
        os.makedirs(shm)
        storage = os.path.join(base, "storage")
        for root, _, names in os.walk(storage):
            for name in names:
                drop_cache(os.path.join(root, name))
        runs["storage (cold)"] = [run_ranks(base, shm, "restart", args.state_gib)]
        bound = run_ranks(base, shm, "gloo", args.state_gib)[0] if args.bound else None
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    expected = {"own RAM": ["own", "own"], "peer RAM": ["peer1", "own"],
                "storage (cold)": ["storage", "storage"]}
    rows = []
    for case, reps in runs.items():
        for reports in reps:
            sources = [r["source"] for r in reports]
            if sources != expected[case]:
                raise RuntimeError(f"{case}: ranks resumed from {sources}, "
                                   f"expected {expected[case]}")
        rank0 = median([reports[0]["time_s"] for reports in reps])
        slowest = median([max(r["time_s"] for r in reports) for reports in reps])
        rows.append({"case": case, "rank0_s": rank0, "slowest_s": slowest, "runs": len(reps)})
    storage_s = rows[-1]["slowest_s"]
    for row in rows:
        row["x_storage"] = storage_s / row["slowest_s"]
    print(f"2 gloo ranks, {args.state_gib:g} GiB state per rank; medians")
    print(table(rows, [("case", "restart from", ""), ("rank0_s", "rank 0 s", ".3f"),
                       ("slowest_s", "slowest rank s", ".3f"),
                       ("x_storage", "storage / this", ".2f"), ("runs", "runs", "d")]))
    if bound is not None:
        print(f"bound: {args.state_gib:g} GiB rank 1 -> rank 0 over gloo, received into fresh "
              f"memory {median(bound['fresh']):.3f} s, into warm memory "
              f"{median(bound['warm']):.3f} s (medians of {len(bound['fresh'])})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_gib": args.state_gib, "reps": args.reps, "rows": rows,
                       "runs": runs, "gloo_bound_s": bound}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
