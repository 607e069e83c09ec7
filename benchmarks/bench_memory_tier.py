"""Restart time per tier against DCP load and ``torch.load``, the cost of a memory-tier snapshot
to the training loop against an async snapshot, the first snapshot after a restart, and the
issue-19 targets, all from one run.

Usage::

    python benchmarks/bench_memory_tier.py --state-gib 1 --reps 4 \\
        --json benchmarks/results/memory-tier-1gib.json \\
        --plot-dir benchmarks/results --plot-dir docs/results --tag 1gib
    python benchmarks/bench_memory_tier.py --quick      # 64 MiB, 2 runs, cold: a smoke run

State: the manager snapshot of ``bench_resume.py`` (a model of 1/3 of ``--state-gib`` in 8
float32 tensors plus Adam's two moments), saved once by the parent to every place a restart
reads from: snapkeep's storage (``SimpleWriter`` into a disk directory, with its checksum
manifest), the memory tier (``MemoryTier(every=1, replicas=0)`` under ``--shm``), a
``torch.save`` file and a DCP checkpoint (``get_state_dict`` of model and optimizer).

Restart rows: each run is a fresh child process that builds the model and a fresh Adam (and,
for snapkeep, the manager with its extensions), then times until "ready to train": loaded and
one byte of every optimizer page read (``bench_resume.make_resident``). **cold** drops the
disk files' pages from the page cache first (``posix_fadvise(DONTNEED)``, no privileges
needed); the tier's files are tmpfs pages (RAM), the same in both rows. Contenders run in ABBA
order over ``--reps`` repetitions; tables give medians.

Loop rows (one child): a training iteration is an Adam step over the whole state (one torch
thread). Segments of ``--segment`` iterations, the first of which triggers either nothing,
the snapshot extension with a ``ThreadWriter`` (async: stage, then write in the background), or
the memory tier's RAM commit; **stall** = that iteration's time minus the median iteration
without a snapshot; **cost** = the segment's time minus the adjacent segment without a snapshot
(ABBA order; so an async writer's background work inside the segment counts). The async
writer's work still running at a segment's end is waited for outside the timing and reported
(``async_spill_s``): make ``--segment`` long enough for it to be ~0.

First-snapshot rows: ``bench_resume.first_snapshot_child`` (the extension after an autoload,
a writer called directly, a writer called directly after ``writer.prefault``), with the
copy into fresh pages against warm pages of the same bytes (the floor any first snapshot pays).

A peer-RAM restart needs two or more ranks (the copy comes from another rank's tmpfs over
gloo): ``bench_peer_restart.py`` times it.
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
from _measure import GIB, median, table
from bench_resume import (
    FIRST_COLUMNS,
    FIRST_SNAPSHOT,
    dcp_load,
    drop_cache,
    first_snapshot_child,
    make_model,
    make_resident,
    summarize_first,
)

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

TEMPLATE = "snapshot_iter_{.iteration}"
JOB = "bench"
RESTART = ("memory tier (own RAM)", "snapkeep autoload (storage)", "DCP load", "torch.load",
           "torch.load(mmap=True)")
LOOP = ("no snapshot", "snapshot, ThreadWriter (async)", "memory tier RAM commit")


def manager_for(model: Any, optimizer: Any, out: str, *, shm: str | None, writer: Any = None,
                snapshot_every: int = 10**6, tier_every: int = 10**6) -> tuple[Any, Any, Any]:
    """A manager with an autoloading snapshot extension (``writer``, default ``SimpleWriter``)
    and, with ``shm``, the memory tier rooted there; returns (manager, snapshot, tier)."""
    manager = ExtensionsManager({"main": model}, {"main": optimizer}, max_epochs=1,
                                iters_per_epoch=10**7, out_dir=out,
                                writer=writer or writing.SimpleWriter(out_dir=out))
    snap = ext.snapshot(filename=TEMPLATE, autoload=True, quiet=True)
    manager.extend(snap, trigger=(snapshot_every, "iteration"))
    tier = None
    if shm is not None:
        tier = ext.memory_tier(ext.MemoryTier(every=tier_every, replicas=0, root=shm, job=JOB))
        manager.extend(tier)
    return manager, snap, tier


def set_grads(model: torch.nn.Module, value: float) -> None:
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.full_like(p, value)
        else:
            p.grad.fill_(value)


def prepare(work: str, shm: str, state_gib: float) -> dict[str, Any]:
    """Save one state (step 1) to storage, the memory tier, ``torch.save`` and DCP (in a child
    process: the snapshot store's lock and the tier's owner record die with it)."""
    model, optimizer = make_model(state_gib)
    disk = os.path.join(work, "disk")
    manager, _, _ = manager_for(model, optimizer, disk, shm=shm, snapshot_every=1, tier_every=1)
    manager.start_extensions()
    with manager.run_iteration(step_optimizers=["main"]):
        set_grads(model, 1.0)
    # not finalized: a finished run removes its RAM tier; this one stays for the restarts (and
    # the store's lock goes with this child process)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(work, "plain.pt"))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(disk, "dcp"),
             no_dist=True)
    snapshot = os.path.join(disk, "snapshot_iter_1")
    return {"snapshot": snapshot, "size": os.path.getsize(snapshot)}


def disk_files(work: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(work) for name in names]


def restart_child(contender: str, work: str, shm: str, state_gib: float,
                  cold: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, optimizer = make_model(state_gib)
    for path in disk_files(work):  # the file pages of every contender: dropped, or all read
        if cold:
            drop_cache(path)
        else:
            with open(path, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
    disk = os.path.join(work, "disk")
    manager = snap = tier = None
    if contender == "memory tier (own RAM)":
        manager, snap, tier = manager_for(model, optimizer, disk, shm=shm)
    elif contender == "snapkeep autoload (storage)":
        manager, snap, tier = manager_for(model, optimizer, disk, shm=None)
    t0 = time.perf_counter()
    if manager is not None:
        manager.start_extensions()
        if manager.iteration != 1:
            raise RuntimeError(f"{contender} did not resume (iteration {manager.iteration})")
    elif contender == "DCP load":
        dcp_load(model, optimizer, os.path.join(disk, "snapshot_iter_1"))
    elif contender in ("torch.load", "torch.load(mmap=True)"):
        state = torch.load(os.path.join(work, "plain.pt"), weights_only=True,
                           mmap=contender != "torch.load")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        del state
    else:
        raise ValueError(f"unknown contender {contender!r}")
    make_resident(optimizer)
    elapsed = time.perf_counter() - t0
    source = None
    if tier is not None:
        source = tier.restored.source if tier.restored is not None else None
        if source != "own":
            raise RuntimeError(f"the memory tier did not restore from its own RAM ({source})")
    first = next(iter(model.parameters()))
    if float(first[0, 0]) == 0.0 or float(optimizer.state[first]["exp_avg"][0, 0]) == 0.0:
        raise RuntimeError(f"{contender} did not load the state")
    # not finalized: finishing would remove the RAM tier the next repetition resumes from
    return {"time_s": elapsed, "source": source}


def loop_child(work: str, shm: str, state_gib: float, reps: int,
               segment: int) -> dict[str, Any]:
    """Segment and stall times per :data:`LOOP` contender, ABBA over ``reps`` + 1 rounds (the
    first round, which allocates buffers and starts workers, is dropped)."""
    torch.set_num_threads(1)
    model, optimizer = make_model(state_gib)
    set_grads(model, 1e-3)
    optimizer.step()
    loop_shm = tempfile.mkdtemp(prefix="loop-", dir=shm)
    out = os.path.join(work, "loop")
    thread_writer = writing.ThreadWriter(out_dir=out)
    managers = {
        "no snapshot": manager_for(model, optimizer, os.path.join(out, "none"), shm=None)[0],
        "snapshot, ThreadWriter (async)": manager_for(
            model, optimizer, out, shm=None, writer=thread_writer, snapshot_every=segment)[0],
        "memory tier RAM commit": manager_for(
            model, optimizer, os.path.join(out, "tier"), shm=loop_shm, tier_every=segment)[0],
    }
    segments: dict[str, list[float]] = {k: [] for k in LOOP}
    firsts: dict[str, list[float]] = {k: [] for k in LOOP}
    others: list[float] = []
    spill: list[float] = []
    try:
        for manager in managers.values():
            manager.start_extensions()
            for _ in range(segment - 1):  # from here each segment's first iteration triggers
                with manager.run_iteration(step_optimizers=["main"]):
                    set_grads(model, 1e-3)
        for rnd in range(reps + 1):
            order = LOOP if rnd % 4 in (0, 3) else tuple(reversed(LOOP))
            for name in order:
                manager = managers[name]
                t0 = time.perf_counter()
                times = []
                for _ in range(segment):
                    t1 = time.perf_counter()
                    with manager.run_iteration(step_optimizers=["main"]):
                        set_grads(model, 1e-3)
                    times.append(time.perf_counter() - t1)
                elapsed = time.perf_counter() - t0
                t2 = time.perf_counter()
                thread_writer.wait()  # background work not done within the segment
                waited = time.perf_counter() - t2
                if rnd == 0:
                    continue
                segments[name].append(elapsed)
                firsts[name].append(times[0])  # the iteration that fired the trigger
                others.extend(times[1:])
                if name == "no snapshot":
                    others.append(times[0])
                if name == LOOP[1]:
                    spill.append(waited)
    finally:
        for manager in managers.values():
            manager.finalize()
        shutil.rmtree(loop_shm, ignore_errors=True)
    return {"segments_s": segments, "trigger_iteration_s": firsts, "iteration_s": others,
            "async_spill_s": spill}


def run_child(argv: list[str]) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child {argv[:2]} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def targets(restart: dict[tuple[str, bool], float], first: dict[str, dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """The issue-19 item-3 targets, measured in this run (cold cache, fresh process)."""
    auto = restart.get(("snapkeep autoload (storage)", True))
    rows = []

    def row(what: str, measured: float | None, target: str, met: bool | None) -> None:
        rows.append({"what": what, "measured": measured, "target": target,
                     "met": "-" if met is None else ("met" if met else "NOT met")})

    dcp = restart.get(("DCP load", True))
    tl = restart.get(("torch.load", True))
    ram = restart.get(("memory tier (own RAM)", True))
    x_dcp = auto / dcp if auto and dcp else None
    x_tl = auto / tl if auto and tl else None
    speedup = auto / ram if auto and ram else None
    row("autoload / DCP load", x_dcp, "<= 1.0x", None if x_dcp is None else x_dcp <= 1.0)
    row("autoload / torch.load", x_tl, "<= 0.5x", None if x_tl is None else x_tl <= 0.5)
    row("storage autoload / memory tier restart", speedup, ">= 5x",
        None if speedup is None else speedup >= 5.0)
    direct = first.get("direct writer")
    ratio = direct["ratio"] if direct else None
    row("first / later snapshot after a restart (writer called directly)", ratio, "<= 1.5x",
        None if ratio is None else ratio <= 1.5)
    return rows


def plot(directory: str, restart_rows: list[dict[str, Any]], loop_rows: list[dict[str, Any]],
         state_gib: float, tag: str) -> None:
    """``memory-tier-restart-<tag>.png`` (restart time per contender, cold and warm) and
    ``memory-tier-loop-<tag>.png`` (stall and cost per snapshot) into ``directory``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if restart_rows:
        fig, ax = plt.subplots(figsize=(7.5, 4))
        names = [c for c in RESTART if any(r["contender"] == c for r in restart_rows)]
        width = 0.38
        for k, (cache, color) in enumerate((("cold", "#4c72b0"), ("warm", "#dd8452"))):
            values = [next((r["time_s"] for r in restart_rows
                            if r["contender"] == n and r["cache"] == cache), 0.0) for n in names]
            xs = [i + (k - 0.5) * width for i in range(len(names))]
            ax.bar(xs, values, width, label=f"{cache} page cache", color=color)
            for x, v in zip(xs, values):
                ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace(" (", "\n(") for n in names], fontsize=7)
        ax.set_ylabel("fresh process to ready to train, s")
        ax.set_title(f"Restart, {state_gib:.2g} GiB state (median)", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(directory, f"memory-tier-restart-{tag}.png"), dpi=110)
        plt.close(fig)
    loop_rows = [r for r in loop_rows if r["contender"] != LOOP[0]]
    if loop_rows:
        fig, ax = plt.subplots(figsize=(7, 2.6))
        labels = [r["contender"] for r in loop_rows]
        ys = range(len(labels))
        ax.barh([y + 0.2 for y in ys], [r["cost_s"] for r in loop_rows], 0.4,
                label="cost to the loop (segment)", color="#55a868")
        ax.barh([y - 0.2 for y in ys], [r["stall_s"] for r in loop_rows], 0.4,
                label="stall at the trigger", color="#c44e52")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.axvline(0, color="black", linewidth=0.5)
        ax.set_xlabel("s per snapshot (median)")
        ax.set_title(f"Snapshot cost to the loop, {state_gib:.2g} GiB state", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(directory, f"memory-tier-loop-{tag}.png"), dpi=110)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=4, help="runs per contender (ABBA order)")
    p.add_argument("--segment", type=int, default=3, help="iterations per loop segment")
    p.add_argument("--dir", default=None, help="disk directory (default: a temp dir here)")
    p.add_argument("--shm", default="/dev/shm", help="tmpfs for the memory tier")
    p.add_argument("--cache", choices=("both", "cold", "warm"), default="both")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: "
                   "restart, loop, first")
    p.add_argument("--quick", action="store_true",
                   help="64 MiB, 2 runs, cold cache only: a smoke run")
    p.add_argument("--json", default=None)
    p.add_argument("--plot-dir", action="append", default=[],
                   help="directory for the PNGs (repeatable)")
    p.add_argument("--tag", default="1gib", help="PNG name suffix")
    p.add_argument("--from-json", default=None,
                   help="draw the plots from a stored --json run instead of measuring")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            stored = json.load(f)
        for directory in args.plot_dir:
            plot(directory, stored["restart"], stored["loop"], stored["state_bytes"] / GIB,
                 args.tag)
        return 0
    if args.quick:
        args.state_gib, args.reps, args.cache = 1 / 16, 2, "cold"
    if args.child == "prepare":
        print(json.dumps(prepare(args.work, args.shm, args.state_gib)))
        return 0
    if args.child == "loop":
        print(json.dumps(loop_child(args.work, args.shm, args.state_gib, args.reps,
                                    args.segment)))
        return 0
    if args.child in FIRST_SNAPSHOT:
        snapshot = os.path.join(args.work, "disk", "snapshot_iter_1")
        print(json.dumps(first_snapshot_child(args.child, snapshot, args.state_gib)))
        return 0
    if args.child:
        print(json.dumps(restart_child(args.child, args.work, args.shm, args.state_gib,
                                       args.cold)))
        return 0
    skip = set(filter(None, args.skip.split(",")))
    work = tempfile.mkdtemp(prefix="bench-memtier-", dir=args.dir or os.getcwd())
    shm = tempfile.mkdtemp(prefix="bench-memtier-", dir=args.shm)
    common = ["--work", work, "--shm", shm, "--state-gib", str(args.state_gib)]
    load_before = os.getloadavg()
    restart_runs: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    first_runs: dict[str, list[dict[str, Any]]] = {}
    loop: dict[str, Any] = {}
    try:
        info = run_child(["--child", "prepare", *common])
        colds = {"both": (True, False), "cold": (True,), "warm": (False,)}[args.cache]
        cases: list[tuple[str, bool]] = []
        if "restart" not in skip:
            cases += [(c, cold) for cold in colds for c in RESTART]
        if "first" not in skip:
            cases += [(c, False) for c in FIRST_SNAPSHOT]
        for rep in range(args.reps):
            order = cases if rep % 4 in (0, 3) else list(reversed(cases))  # ABBA
            for contender, cold in order:
                result = run_child(["--child", contender, *common]
                                   + (["--cold"] if cold else []))
                if contender in FIRST_SNAPSHOT:
                    first_runs.setdefault(contender, []).append(result)
                else:
                    restart_runs.setdefault((contender, cold), []).append(result)
        if "loop" not in skip:
            loop = run_child(["--child", "loop", *common, "--reps", str(args.reps),
                              "--segment", str(args.segment)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    load_after = os.getloadavg()

    restart = {k: median([r["time_s"] for r in v]) for k, v in restart_runs.items()}
    restart_rows = []
    for (contender, cold), t in restart.items():
        base = restart.get(("DCP load", cold))
        tl = restart.get(("torch.load", cold))
        restart_rows.append({"contender": contender, "cache": "cold" if cold else "warm",
                             "time_s": t, "x_dcp": t / base if base else None,
                             "x_torch_load": t / tl if tl else None})
    first = {c.split(": ")[1]: summarize_first(c, v) for c, v in first_runs.items()}
    loop_rows = []
    if loop:
        base_iter = median(loop["iteration_s"])
        segs = loop["segments_s"]
        for name in LOOP:
            costs = [s - b for s, b in zip(segs[name], segs["no snapshot"])]
            loop_rows.append({"contender": name, "stall_s": median(
                [t - base_iter for t in loop["trigger_iteration_s"][name]]),
                "cost_s": median(costs), "segment_s": median(segs[name])})
        thread = next(r for r in loop_rows if r["contender"] == LOOP[1])
        for r in loop_rows:
            r["x_async"] = r["cost_s"] / thread["cost_s"] if thread["cost_s"] > 0 else None
    target_rows = targets(restart, first)

    print(f"state file {info['size'] / GIB:.3f} GiB; {args.reps} runs each, ABBA, medians; "
          f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    if restart_rows:
        print("\nrestart: fresh process, model and optimizer built, to ready to train")
        print(table(restart_rows, [("contender", "contender", ""), ("cache", "cache", ""),
                                   ("time_s", "restart s", ".3f"), ("x_dcp", "x DCP load", ".2f"),
                                   ("x_torch_load", "x torch.load", ".2f")]))
    if loop_rows:
        print(f"\nloop: Adam step over the state, segments of {args.segment} iterations")
        print(table(loop_rows, [("contender", "contender", ""),
                                ("stall_s", "stall at trigger s", ".3f"),
                                ("cost_s", "cost per snapshot s", ".3f"),
                                ("segment_s", "segment s", ".3f"),
                                ("x_async", "cost x async", ".2f")]))
    if first:
        print("\nfirst snapshot after a restart (ThreadWriter)")
        print(table(list(first.values()), FIRST_COLUMNS))
    print(f"\nissue-19 targets ({info['size'] / GIB:.2f} GiB, cold cache, fresh process), "
          "this run")
    print(table(target_rows, [("what", "what", ""), ("measured", "measured", ".2f"),
                              ("target", "target", ""), ("met", "met", "")]))
    for directory in args.plot_dir:
        plot(directory, restart_rows, loop_rows, info["size"] / GIB, args.tag)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_bytes": info["size"], "reps": args.reps, "segment": args.segment,
                       "loadavg_before": load_before, "loadavg_after": load_after,
                       "restart": restart_rows, "loop": loop_rows,
                       "first_snapshot": list(first.values()), "targets": target_rows,
                       "runs": {"restart": {f"{c}|{'cold' if k else 'warm'}": v
                                            for (c, k), v in restart_runs.items()},
                                "first": first_runs, "loop": loop}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
