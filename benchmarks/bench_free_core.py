"""Cost of a snapshot to a training loop that leaves a core free (issue 12, item 2).

The accelerator-host case on a CPU machine: the loop runs with one torch thread on a machine
with (at least) two cores, so a second core is free for background work, as the host CPU is
mostly idle while an accelerator computes. The state: a model of ``--model-mib`` MiB (float32
``Linear`` layers), Adam's state (2x the model) and an EMA copy of the model updated in place
after every step (not owned by the optimizer, so the snapshot must capture it at the call):
4x the model in all. One iteration (~0.4 s at the defaults) = forward/backward of a batch
through the model, ``optimizer.step()``, the EMA update; a snapshot every ``--every``
iterations under ``ExtensionsManager`` with snapkeep's ``snapshot`` extension (overlapped
staging on, the default inside the manager).

Measurement: segments of ``--every`` iterations, each with a snapshot at the end of its first
iteration (A) or without (B), in ABBA order, each ending once the snapshot is durable
(``writer.wait()``, timed as **wait for durable**; at this cadence a snapshot still being
written would hold up the next one).
**cost per snapshot** = median over the pairs of (A - B) segment time; the **copy floor** = one
single-threaded ``memcpy`` of the whole snapshotted state (model, Adam state, EMA) into warm
preallocated buffers, timed in the same run. The target is cost <= 0.25x the floor. **CPU-s**
= extra CPU of the process tree per snapshot (A - B, median). After the timed pairs every
writer takes one more snapshot with a copy of the state set aside at the call, trains on, and
the file it wrote is loaded and compared with that copy (``equal``). The JSON also holds the
median A - B cost of each iteration of the segment (``iteration_cost_s``: the call's iteration
first, then the ones the background work overlaps).

Baselines in the same run: ``torch.save`` + fsync in the loop (synchronous), DCP
``async_save`` (waited for at the end of the segment, as above), and **copy only**, the least
any consistent overlapped snapshot must do, with nothing written: the EMA is copied at the call
and the optimizer-owned tensors by a background thread during the next forward/backward (the
next ``optimizer.step()`` waits for it), each with one ``memcpy`` into warm buffers. A writer
name with ``/copy`` (e.g. ``ProcessWriter/copy``) is that writer with the local commit copying
every byte through its chunk buffer instead of writing the staging buffers to disk in place
(``SNAPKEEP_DIRECT_IN_PLACE=0``, how snapkeep wrote before), to pair the two in one run.

    python benchmarks/bench_free_core.py --pairs 8 --json results/free-core.json
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

import torch
from _measure import TreeCpu, median, median_ci, table

from snapkeep import writing
from snapkeep._core.storage import _direct
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

MIB = 1 << 20
SNAPKEEP = ("SimpleWriter", "ThreadWriter", "ThreadQueueWriter", "ProcessWriter",
            "ProcessQueueWriter")
COPY = tuple(f"{k}/copy" for k in SNAPKEEP)
BASELINES = ("torch.save", "DCP async_save", "copy only")
_IN_PLACE = _direct.IN_PLACE


def set_copy_mode(on: bool) -> None:
    """Turn in-place direct writes off (``/copy`` writers) or back on, here and (through the
    environment, read at import) in writer workers started from now on."""
    _direct.IN_PLACE = False if on else _IN_PLACE
    if on:
        os.environ[_direct.IN_PLACE_ENV] = "0"
    else:
        os.environ.pop(_direct.IN_PLACE_ENV, None)


def make(model_mib: float, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                 torch.nn.Module]:
    layers = max(1, round(model_mib * MIB / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    ema = copy.deepcopy(model).requires_grad_(False)
    return model, optimizer, ema


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  ema: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *ema.parameters(),
            *(v for s in optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0)]


def floor_s(tensors: list[torch.Tensor], reps: int = 5) -> float:
    """Median of ``reps`` single-threaded memcpys of ``tensors`` into warm buffers."""
    buffers = [torch.empty_like(t) for t in tensors]
    for b in buffers:
        b.zero_()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors):
            ctypes.memmove(b.data_ptr(), t.data_ptr(), t.nbytes)
        times.append(time.perf_counter() - t0)
    return median(times)


class Loop:
    """One writer's loop: ``segment(snapshot)`` runs ``every`` iterations and returns
    ``(seconds, cpu_seconds)``."""

    def __init__(self, kind: str, args: argparse.Namespace, out: str) -> None:
        torch.manual_seed(0)
        self.kind, self.every, self.out = kind, args.every, out
        self.model, self.optimizer, self.ema = make(args.model_mib, args.width)
        self.x = torch.randn(args.batch, args.width)
        self.take = self.grab_next = False
        self.writer: Any = None
        self.pending: Any = None
        self.saved = 0
        self.stalls: list[float] = []
        self.waits: list[float] = []
        self.durable_waits: list[float] = []  # at the end of each snapshot's segment
        self.last_iterations: list[float] = []  # each iteration of the last segment, seconds
        if kind in SNAPKEEP + COPY:
            self.writer = getattr(writing, kind.split("/")[0])(out_dir=out)
            self.manager = ExtensionsManager(
                {"main": self.model, "ema": self.ema}, self.optimizer, max_epochs=1 << 30,
                iters_per_epoch=1, out_dir=out, writer=self.writer)
            self.snapshot = ext.snapshot(n_retains=2, overlap=not args.no_overlap)
            self._time_direct_costs()
            self.manager.extend(self.snapshot, trigger=lambda m: self._due())
            # the correctness check's copy of the state at the call (runs before the snapshot)
            self.clones: dict[str, torch.Tensor] = {}
            self.manager.extend(self._grab, trigger=lambda m: self.grab_next, priority=1 << 20,
                                name="grab")
            self.manager.start_extensions()
        else:
            self.manager = ExtensionsManager({"main": self.model, "ema": self.ema},
                                             self.optimizer, max_epochs=1 << 30,
                                             iters_per_epoch=1, out_dir=out)
            self.manager.start_extensions()
        self.cpu = TreeCpu()

    def _time_direct_costs(self) -> None:
        """Record the snapshot call's stall and the time the next ``optimizer.step()`` waits
        for background staging (the two costs the loop pays directly)."""
        guard = self.snapshot._staging_guard
        before_step = guard._before_step
        stalls = self.stalls

        class Timed(type(self.snapshot)):  # type: ignore[misc]
            def __call__(self, manager: Any) -> None:
                t0 = time.perf_counter()
                super().__call__(manager)
                stalls.append(time.perf_counter() - t0)

        def timed_wait(*a: Any) -> None:
            t0 = time.perf_counter()
            before_step(*a)
            self.waits.append(time.perf_counter() - t0)

        self.snapshot.__class__ = Timed
        guard._before_step = timed_wait  # type: ignore[method-assign]

    def _grab(self, manager: Any) -> None:
        self.grab_next = False
        for prefix, module in (("main", self.model), ("ema", self.ema)):
            for k, v in module.state_dict().items():
                self.clones[f"{prefix}/{k}"] = v.clone()
        for i, s in self.optimizer.state_dict()["state"].items():
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    self.clones[f"opt/{i}/{k}"] = v.clone()

    def _due(self) -> bool:
        due, self.take = self.take, False
        return due

    def _state(self) -> dict[str, Any]:
        return {"main": self.model.state_dict(), "ema": self.ema.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def _copy_only(self) -> None:
        """The copy-only baseline's snapshot: EMA now, optimizer-owned tensors in a thread."""
        import concurrent.futures

        now = list(self.ema.parameters())
        later = [t for t in state_tensors(self.model, self.optimizer, self.ema)
                 if not any(t is e for e in now)]
        if not hasattr(self, "copy_buffers"):
            self.copy_buffers = {id(t): torch.empty_like(t).zero_() for t in now + later}
            self.copy_pool = concurrent.futures.ThreadPoolExecutor(1)
        for t in now:
            ctypes.memmove(self.copy_buffers[id(t)].data_ptr(), t.data_ptr(), t.nbytes)

        def copy_later() -> None:
            for t in later:
                ctypes.memmove(self.copy_buffers[id(t)].data_ptr(), t.data_ptr(), t.nbytes)

        self.pending = self.copy_pool.submit(copy_later)

    def _baseline_snapshot(self) -> None:
        path = os.path.join(self.out, f"b_{self.saved % 2}")
        self.saved += 1
        if self.kind == "copy only":
            self._copy_only()
        elif self.kind == "torch.save":
            with open(path, "wb") as f:
                torch.save(self._state(), f)
                f.flush()
                os.fsync(f.fileno())
        else:
            import torch.distributed.checkpoint as dcp

            if self.pending is not None:
                self.pending.result()
            self.pending = dcp.async_save(self._state(), checkpoint_id=path)

    def _wait(self) -> None:
        if self.writer is not None:
            self.writer.wait()
        elif self.pending is not None:
            self.pending.result()
            self.pending = None

    def iteration(self, snapshot: bool) -> None:
        with self.manager.run_iteration():
            self.take = snapshot and self.writer is not None
            self.model(self.x).pow(2).mean().backward()
            if self.kind == "copy only" and self.pending is not None:
                t0 = time.perf_counter()  # as snapkeep's step pre-hook waits for staging
                self.pending.result()
                self.pending = None
                self.waits.append(time.perf_counter() - t0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
            with torch.no_grad():
                torch._foreach_lerp_(list(self.ema.parameters()),
                                     list(self.model.parameters()), 0.01)
        if snapshot and self.writer is None:
            t0 = time.perf_counter()
            self._baseline_snapshot()
            self.stalls.append(time.perf_counter() - t0)

    def segment(self, snapshot: bool) -> tuple[float, float, float]:
        """``(seconds, CPU-s of the process tree, CPU-s of the training thread)``."""
        self.cpu.start()
        t0, c0 = time.perf_counter(), time.thread_time()
        self.last_iterations = []
        for i in range(self.every):
            ti = time.perf_counter()
            self.iteration(snapshot and i == 0)
            self.last_iterations.append(time.perf_counter() - ti)
        t1 = time.perf_counter()
        self._wait()
        if snapshot:
            self.durable_waits.append(time.perf_counter() - t1)
        return time.perf_counter() - t0, self.cpu.elapsed_s(), time.thread_time() - c0

    def close(self) -> None:
        self._wait()
        self.manager.finalize()
        if hasattr(self, "copy_pool"):
            self.copy_pool.shutdown()


def check_equal(loop: Loop) -> bool | None:
    """Take one snapshot with the state copied at the call (an extension that runs just before
    the snapshot), run two more iterations, wait, load the file and compare every tensor with
    the copy."""
    if loop.writer is None:
        return None
    loop.grab_next = True
    loop.iteration(True)
    loop.iteration(False)
    loop.iteration(False)
    loop.writer.wait()
    loop.manager.finalize()
    from snapkeep import load_latest

    loaded = load_latest(loop.out)
    if loaded is None:
        return False
    models = loaded["models"]
    got = {f"main/{k}": v for k, v in models["main"].items()}
    got.update({f"ema/{k}": v for k, v in models["ema"].items()})
    for i, s in loaded["optimizers"]["main"]["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                got[f"opt/{i}/{k}"] = v
    clones = loop.clones
    return set(got) == set(clones) and all(torch.equal(got[k], clones[k]) for k in clones)


def measure(kind: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    set_copy_mode(kind in COPY)
    try:
        return _measure(kind, args, root)
    finally:
        set_copy_mode(False)


def _measure(kind: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix=kind.replace(" ", "_").replace(".", "_").replace("/", "_")
                           + "-", dir=root)
    loop = Loop(kind, args, out)
    for _ in range(args.warmup):  # Adam's state exists, pages are warm, a first snapshot is out
        loop.segment(True)
        loop.segment(False)
    fl = floor_s(state_tensors(loop.model, loop.optimizer, loop.ema))
    diffs, cpus, own, plain = [], [], [], []
    per_iteration: list[list[float]] = []  # A - B of each iteration of the segment
    loop.stalls.clear()
    loop.waits.clear()
    loop.durable_waits.clear()
    for p in range(args.pairs):
        order = (True, False) if p % 2 == 0 else (False, True)  # ABBA
        seg, its = {}, {}
        for snap in order:
            seg[snap] = loop.segment(snap)
            its[snap] = loop.last_iterations
        per_iteration.append([a - b for a, b in zip(its[True], its[False])])
        diffs.append(seg[True][0] - seg[False][0])
        cpus.append(seg[True][1] - seg[False][1])
        own.append(seg[True][2] - seg[False][2])
        plain.append(seg[False][0])
    # the step after each snapshot waits for staging; steps without a snapshot before them
    # return at once (microseconds), so the mean over the snapshots is the snapshot's wait
    direct = {"stall_s": median(loop.stalls), "wait_s": sum(loop.waits) / len(loop.stalls),
              "durable_wait_s": median(loop.durable_waits)}
    equal = check_equal(loop) if kind in SNAPKEEP + COPY else None
    if kind not in SNAPKEEP + COPY:
        loop.close()
    state_mib = sum(t.nbytes for t in state_tensors(loop.model, loop.optimizer, loop.ema)) / MIB
    cost = median(diffs)
    lo, hi = median_ci(diffs)
    row = {"writer": kind if kind in BASELINES else f"snapkeep {kind}", "state_mib": state_mib,
           "every": args.every,
           "floor_s": fl, "cost_s": cost, "cost_x_floor": cost / fl, "ci_lo_x": lo / fl,
           "ci_hi_x": hi / fl, "cpu_s": median(cpus), "segment_s": median(plain),
           "overhead_pct": 100 * cost / median(plain), "equal": equal, "diffs": diffs,
           "cpus": cpus, "own_cpus": own, "own_cpu_s": median(own),
           "iteration_cost_s": [median([p[i] for p in per_iteration])
                                for i in range(args.every)],
           **direct, "direct_x_floor": (direct["stall_s"] + direct["wait_s"]) / fl}
    print(table([row], COLUMNS).splitlines()[-1], flush=True)
    return row


COLUMNS = [("writer", "writer", ""), ("state_mib", "state MiB", ".0f"),
           ("floor_s", "copy floor s", ".3f"), ("stall_s", "call stall s", ".3f"),
           ("wait_s", "step wait s", ".3f"), ("direct_x_floor", "(stall + wait) / floor", ".2f"),
           ("cost_s", "cost per snapshot s", ".3f"),
           ("cost_x_floor", "cost / floor", ".2f"), ("ci_lo_x", "95 % CI lo", ".2f"),
           ("ci_hi_x", "95 % CI hi", ".2f"), ("cpu_s", "CPU-s per snapshot", ".2f"),
           ("own_cpu_s", "training thread CPU-s", ".3f"),
           ("durable_wait_s", "wait for durable s", ".3f"),
           ("segment_s", "segment s", ".2f"), ("overhead_pct", "overhead %", ".1f"),
           ("equal", "file = state at call", "")]


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Box plot of the paired per-snapshot costs (in copy floors) per writer, with the direct
    cost (call stall + step wait) marked and the 0.25x target drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    data = [[d / r["floor_s"] for d in r["diffs"]] for r in rows]
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(rows) + 1),
                  [r["writer"].replace("snapkeep ", "") for r in rows], fontsize=8)
    ax.plot(range(1, len(rows) + 1), [r["direct_x_floor"] for r in rows], "rD",
            label="direct: call stall + step wait")
    ax.axhline(0.25, color="g", ls="--", label="target 0.25x copy floor")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylabel("cost per snapshot / copy floor (paired A - B)")
    ax.set_title(f"Free-core loop: {rows[0]['state_mib']:.0f} MiB state, snapshot every "
                 f"{rows[0].get('every', 4)} iterations, 1 torch thread on 2 vCPUs")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-mib", type=float, default=128, help="model size (state = 4x)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=96, help="rows per forward (sets the step time)")
    p.add_argument("--every", type=int, default=4, help="iterations per segment")
    p.add_argument("--pairs", type=int, default=8, help="ABBA pairs per writer (>= 6 for a CI)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-overlap", action="store_true",
                   help="snapkeep writers copy everything in the call (overlap=False)")
    p.add_argument("--writers", default=",".join(SNAPKEEP + BASELINES))
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG box plot of the costs here")
    p.add_argument("--from-json", default=None,
                   help="only re-draw --plot and the table from an earlier --json")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)["rows"]
        print(table(rows, COLUMNS))
        if args.plot:
            plot(rows, args.plot)
        return 0
    torch.set_num_threads(1)
    kinds = [k for k in args.writers.split(",") if k]
    known = SNAPKEEP + COPY + BASELINES
    unknown = sorted(set(kinds) - set(known))
    if unknown:
        p.error(f"--writers: unknown {unknown}; choose from {', '.join(known)}")
    print(f"# {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}, 1 torch "
          f"thread, load average {os.getloadavg()[0]:.1f}", flush=True)
    print(table([], COLUMNS), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="free-core-", dir=args.dir) as root:
        for kind in kinds:
            rows.append(measure(kind, args, root))
    print()
    print(table(rows, COLUMNS))
    print("\ncost of each iteration of the snapshot segment (median A - B, s):")
    for r in rows:
        print(f"  {r['writer']}: " + ", ".join(f"{c:+.3f}" for c in r["iteration_cost_s"]))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "python": sys.version.split()[0],
                       "torch": torch.__version__, "cpus": os.cpu_count(),
                       "load_average_end": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
