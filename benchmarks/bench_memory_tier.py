"""Restart time per tier, and the loop cost of a memory-tier snapshot (single process).

Usage::

    python benchmarks/bench_memory_tier.py --state-mib 128 --reps 3 [--json out.json]

State: a model of 8 equal float32 Linear layers holding 1/3 of ``--state-mib`` plus Adam's two
moments (one step taken). Every figure is the median of ``--reps`` runs, measured in this
process with the files in the page cache (warm), rows interleaved per repetition:

- restart rows: time from a fresh ``ExtensionsManager`` (model and optimizer built) to
  ``start_extensions()`` returned with the state loaded, resp. ``torch.load`` +
  ``load_state_dict`` and DCP ``load`` into the live state dict (no process group);
  ``memory tier (own RAM)`` resumes from the tier (its root a directory under ``--shm``,
  default /dev/shm), ``snapkeep autoload (storage)`` from ``--out`` (a disk directory);
- loop rows: the call of the extension at its trigger (what the training loop waits for):
  the memory tier's snapshot (staging; serialise, tmpfs commit and peer copies run in its
  background thread) vs the snapshot extension with a ``ThreadWriter`` (async), interleaved
  ABBA, each call's background work drained before the next timed call. ``--loop-only``
  measures these rows alone (the before/after figure of the tier's stall: run it with
  ``PYTHONPATH`` at each version's ``src``).

A peer-RAM restart needs several ranks and is not measured here (see
``tests/distributed/test_memory_tier_distributed.py`` for the path itself).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

TEMPLATE = "snapshot_iter_{.iteration}"


def build(state_mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    width = int((state_mib * 2**20 / 3 / 4 / 8) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(8)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def manager_for(out: str, shm: str | None, model: Any, optimizer: Any, *,
                writer: Any = None, every: int = 1) -> tuple[ExtensionsManager, Any, Any]:
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=10**6, out_dir=out,
                                writer=writer or writing.SimpleWriter(out_dir=out))
    snap = ext.snapshot(filename=TEMPLATE, autoload=True, quiet=True)
    manager.extend(snap, trigger=(every, "iteration"))
    tier = None
    if shm is not None:
        tier = ext.memory_tier(ext.MemoryTier(every=every, replicas=0, root=shm, job="bench"))
        manager.extend(tier)
    return manager, snap, tier


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="disk directory (default: a temp dir)")
    parser.add_argument("--shm", default="/dev/shm", help="tmpfs for the tier")
    parser.add_argument("--json", default=None)
    parser.add_argument("--loop-only", action="store_true",
                        help="measure the loop rows only (no restart rows)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="bench-memtier-", dir=args.out)
    shm = tempfile.mkdtemp(prefix="bench-memtier-", dir=args.shm)
    rows: dict[str, list[float]] = {}
    try:
        model, optimizer = build(args.state_mib)
        out_ram, out_disk = os.path.join(work, "ram"), os.path.join(work, "disk")
        # one step saved to storage (step 1) and, for the RAM run, step 2 in RAM only
        for out, tier_root in ((out_disk, None), (out_ram, shm)) if not args.loop_only else ():
            manager, _, _ = manager_for(out, tier_root, model, optimizer, every=1)
            manager.start_extensions()
            with manager.run_iteration():
                pass
            if tier_root is None:
                manager.finalize()
        if not args.loop_only:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(work, "plain.pt"))
        import torch.distributed.checkpoint as dcp
        if not args.loop_only:
            dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(work, "dcp"))

        def ram_restart() -> None:
            manager, _, tier = manager_for(out_ram, shm, model, optimizer, every=10**6)
            manager.start_extensions()
            assert tier.restored is not None and tier.restored.source == "own"
            # left unfinalized: the tier stays for the next repetition

        def storage_restart() -> None:
            manager, snap, _ = manager_for(out_disk, None, model, optimizer, every=10**6)
            manager.start_extensions()
            assert snap.loaded_entry is not None
            manager.finalize()

        def torch_load() -> None:
            state = torch.load(os.path.join(work, "plain.pt"), weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

        def dcp_load() -> None:
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(work, "dcp"))

        restart = {"memory tier (own RAM)": ram_restart,
                   "snapkeep autoload (storage)": storage_restart,
                   "torch.load + load_state_dict": torch_load,
                   "DCP load (model only)": dcp_load}
        for _ in range(0 if args.loop_only else args.reps):
            for name, fn in restart.items():
                rows.setdefault(name, []).append(timed(fn))

        # loop cost: the call at the trigger, ABBA against an async snapshot; each call's
        # background work is drained before the next timed call (no overlap between rows)
        loop_out = os.path.join(work, "loop")
        tier_call = ext.memory_tier(ext.MemoryTier(every=1, replicas=0, root=shm, job="loop"))
        mgr, snap, _ = manager_for(loop_out, None, model, optimizer,
                                   writer=writing.ThreadWriter(out_dir=loop_out))
        mgr.extend(tier_call)
        mgr.start_extensions()
        calls = [("loop: memory tier snapshot (call)", lambda: tier_call(mgr), tier_call.wait),
                 ("loop: snapshot, ThreadWriter (async)", lambda: snap(mgr), snap.writer.wait)]
        for i in range(args.reps + 1):
            with mgr.run_iteration():  # both fire here too (untimed): buffers, then warm
                pass
            tier_call.wait()
            snap.writer.wait()
            if i == 0:
                continue
            for name, call, drain in (calls if i % 2 else calls[::-1]):  # ABBA
                rows.setdefault(name, []).append(timed(call))
                drain()
        mgr.finalize()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in rows.items()}
    print(f"state {args.state_mib} MiB, median of {args.reps}, warm cache")
    print("| what | seconds |\n|---|---:|")
    for name, value in medians.items():
        print(f"| {name} | {value:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_mib": args.state_mib, "reps": args.reps, "median_s": medians,
                       "all_s": rows}, f, indent=1)


if __name__ == "__main__":
    main()
