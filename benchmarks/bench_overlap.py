"""First-snapshot stall, overlapped staging and step time around a snapshot (issue 12).

A training loop under ``ExtensionsManager`` with a snapshot every ``--every`` iterations: the
state is a model of 1/3 of ``--state-mib`` (8 float32 parameters) plus Adam's state; each
iteration also runs a small MLP forward/backward (the "compute", ~tens of ms on one thread).
**stall** is the snapshot extension's call (what the loop waits for); **first** is the first
snapshot's stall, **later** the median of the others; **floor** is one copy of the state's
storages into preallocated warm buffers (the cost overlap removes from the call), timed before
each run. Between the extensions' initialization (the process writers' worker starts) and the
first iteration the loop pauses ``--settle-s`` seconds, as a real run spends seconds loading data
before its first snapshot is due. Modes, run in ABBA order:

- ``before``: no prefault and no overlap (snapkeep before issue 12);
- ``prefault``: staging buffers prefaulted in the background before the first snapshot;
- ``overlap``: prefault + overlapped staging (the default inside the manager).

``--sizes`` adds a sweep of the later stall versus state size (``before`` vs ``overlap``).
Writes a JSON file and, with ``--plot-dir``, PNG plots (matplotlib): stall versus state size
per writer, and step time around a snapshot.

    python benchmarks/bench_overlap.py --state-mib 256 --reps 2 --json results/overlap.json \\
        --plot-dir results
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
from _measure import median, table

from snapkeep import writing
from snapkeep._core.save import prefault as prefault_module
from snapkeep.training import ExtensionsManager
from snapkeep.training.extensions import _snapshot

WRITERS = ("ThreadWriter", "ThreadQueueWriter", "ProcessWriter", "ProcessQueueWriter")
MODES = ("before", "prefault", "overlap")
MIB = 1 << 20


class TimedSnapshot(_snapshot._Snapshot):
    """The snapshot extension, timing each call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stalls: list[float] = []
        self.at_iteration: list[int] = []

    def __call__(self, manager: Any) -> None:
        t0 = time.perf_counter()
        super().__call__(manager)
        self.stalls.append(time.perf_counter() - t0)
        self.at_iteration.append(int(manager.iteration))


def make(state_mib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module]:
    per = max(1024, int(state_mib * MIB / 3 / 4 / 8) // 1024 * 1024)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.rand(per // 1024, 1024)) for _ in range(8)])
    compute = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                  torch.nn.Linear(512, 512))
    params = [*model.parameters(), *compute.parameters()]
    return model, torch.optim.Adam(params, lr=1e-4), compute


def floor_s(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One memcpy of the state's storages into warm preallocated buffers."""
    tensors = [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor))]
    buffers = [torch.empty_like(t) for t in tensors]
    for b in buffers:
        b.zero_()
    t0 = time.perf_counter()
    for b, t in zip(buffers, tensors):
        ctypes.memmove(b.data_ptr(), t.data_ptr(), t.nbytes)
    return time.perf_counter() - t0


def run(writer_name: str, mode: str, state_mib: float, every: int, snapshots: int,
        out: str, settle_s: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model, optimizer, compute = make(state_mib)
    x = torch.randn(256, 512)
    real_prefault = prefault_module.prefault_before_first_snapshot
    if mode == "before":
        _snapshot.prefault_before_first_snapshot = lambda *a, **k: None  # type: ignore[assignment]
    try:
        writer = getattr(writing, writer_name)(out_dir=out, timeout_s=300)
        manager = ExtensionsManager({"main": model, "compute": compute}, optimizer,
                                    max_epochs=1, iters_per_epoch=every * snapshots + 2,
                                    writer=writer)
        ext = TimedSnapshot(overlap=mode == "overlap", n_retains=1)
        manager.extend(ext, trigger=(every, "iteration"))
        manager.start_extensions()
        time.sleep(settle_s)  # a real run spends seconds before its first snapshot is due
        step_s: list[float] = []
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        while not manager.stop_trigger:
            t0 = time.perf_counter()
            with manager.run_iteration(step_optimizers=["main"]):
                compute(x).pow(2).mean().backward()
                for p in model.parameters():
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            step_s.append(time.perf_counter() - t0)
        fl = floor_s(model, optimizer)
        manager.finalize()
    finally:
        _snapshot.prefault_before_first_snapshot = real_prefault
    return {"writer": writer_name, "mode": mode, "state_mib": state_mib, "floor_s": fl,
            "stalls": ext.stalls, "at": ext.at_iteration, "step_s": step_s}


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["writer"], r["mode"], r["state_mib"]) for r in results},
                  key=lambda k: (WRITERS.index(k[0]), k[2], MODES.index(k[1])))
    for writer_name, mode, size in keys:
        runs = [r for r in results if (r["writer"], r["mode"], r["state_mib"])
                == (writer_name, mode, size)]
        first = median([r["stalls"][0] for r in runs])
        later = median([s for r in runs for s in r["stalls"][1:]])
        fl = median([r["floor_s"] for r in runs])
        # iteration after each snapshot (the step that waits for background staging)
        after = median([r["step_s"][i] for r in runs for i in r["at"][1:] if i < len(r["step_s"])])
        plain = median([t for r in runs for i, t in enumerate(r["step_s"], 1)
                        if i > 1 and i not in r["at"] and i - 1 not in r["at"]])
        rows.append({"writer": writer_name, "mode": mode, "state_mib": size, "first_s": first,
                     "later_s": later, "first_x_later": first / later, "floor_s": fl,
                     "later_x_floor": later / fl, "next_step_s": after, "plain_step_s": plain})
    return rows


def plots(results: list[dict[str, Any]], rows: list[dict[str, Any]], plot_dir: str,
          tag: str, args_state_mib: float) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    sizes = sorted({r["state_mib"] for r in rows})
    if len(sizes) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for writer_name in WRITERS:
            for mode, style in (("before", "--"), ("overlap", "-")):
                pts = [(r["state_mib"], r["later_s"]) for r in rows
                       if r["writer"] == writer_name and r["mode"] == mode]
                if pts:
                    ax.plot(*zip(*sorted(pts)), style, marker="o", label=f"{writer_name} {mode}")
        floor = sorted({(r["state_mib"], r["floor_s"]) for r in rows if r["mode"] == "before"})
        if floor:
            by_size: dict[float, list[float]] = {}
            for s, f in floor:
                by_size.setdefault(s, []).append(f)
            ax.plot(sorted(by_size), [median(by_size[s]) for s in sorted(by_size)], ":k",
                    label="copy floor")
        ax.set_yscale("log")
        ax.set_xlabel("state size (MiB)")
        ax.set_ylabel("stall per snapshot (s), median of later snapshots")
        ax.set_title("Snapshot stall vs state size (2 shared vCPUs)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = os.path.join(plot_dir, f"stall-vs-size-{tag}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    size = args_state_mib
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, writer_name in zip(axes, ("ThreadWriter", "ProcessWriter")):
        for mode in MODES:
            runs = [r for r in results if r["writer"] == writer_name and r["mode"] == mode
                    and r["state_mib"] == size]
            if not runs:
                continue
            n = len(runs[0]["step_s"])
            ax.plot(range(1, n + 1), [median([r["step_s"][i] for r in runs]) for i in range(n)],
                    marker=".", label=mode)
        for i in runs[0]["at"] if runs else []:
            ax.axvline(i, color="grey", alpha=0.3)
        ax.set_title(f"{writer_name}, {size:.0f} MiB state")
        ax.set_xlabel("iteration (grey: snapshot at its end)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("iteration time incl. snapshot call (s)")
    path = os.path.join(plot_dir, f"step-time-{tag}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    made.append(path)
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=float, default=256)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--settle-s", type=float, default=2.0,
                   help="pause after the extensions initialize (the worker process starts)")
    p.add_argument("--snapshots", type=int, default=3)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--writers", default=",".join(WRITERS))
    p.add_argument("--sizes", default="", help="comma-separated MiB for the size sweep")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--plot-dir", default=None)
    p.add_argument("--tag", default="run")
    p.add_argument("--merge", default=None,
                   help="a JSON file of an earlier run whose runs join the tables and plots")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    writers = [w for w in args.writers.split(",") if w]
    cases = [(w, m, args.state_mib) for w in writers for m in MODES]
    for size in [float(s) for s in args.sizes.split(",") if s]:
        cases += [(w, m, size) for w in writers for m in ("before", "overlap")
                  if size != args.state_mib]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-overlap-", dir=args.dir or os.getcwd()) as d:
        for rep in range(args.reps):
            order = cases if rep % 4 in (0, 3) else list(reversed(cases))  # ABBA
            for i, (writer_name, mode, size) in enumerate(order):
                out = os.path.join(d, f"{rep}-{i}")
                results.append(run(writer_name, mode, size, args.every, args.snapshots, out,
                                   args.settle_s))
    if args.merge:
        with open(args.merge) as f:
            results = json.load(f)["runs"] + results
    rows = summarize(results)
    print(f"every {args.every} iterations, {args.snapshots} snapshots per run, {args.reps} "
          "runs each (ABBA), medians; 2 vCPUs shared with other sessions")
    print(table(rows, [
        ("writer", "writer", ""), ("mode", "mode", ""), ("state_mib", "MiB", ".0f"),
        ("first_s", "first stall s", ".3f"), ("later_s", "later stall s", ".3f"),
        ("first_x_later", "first / later", ".2f"), ("floor_s", "floor s", ".3f"),
        ("later_x_floor", "later / floor", ".2f"), ("next_step_s", "next iteration s", ".3f"),
        ("plain_step_s", "plain iteration s", ".3f")]))
    if args.plot_dir:
        for path in plots(results, rows, args.plot_dir, args.tag, args.state_mib):
            print("wrote", path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
