"""How long does a snapshot stop training, and what does it cost? (issue 3)

For every snapkeep writer, ppe's writers (when ``pytorch_pfn_extras`` is importable), DCP's
``async_save`` (single process, gloo group of size 1) and plain ``torch.save`` + fsync, on a state
of ``--state-gib`` GiB (a model of 1/3 of it plus its Adam state), this measures:

- stall: seconds the call blocks (median over ``--repeats``; the first snapshot, which allocates
  buffers, is reported separately);
- durable: seconds from the call until the file is fsynced (ppe does not fsync: the script
  fsyncs its file once ppe is done and counts that);
- peak RSS of the process tree while saving, and its drift over ``--flat-snapshots`` snapshots;
- torn / later tensors: the state is filled with a constant before each call and refilled in
  place right after it returns (as ``optimizer.step()`` would); each file must hold the constant;
- CPU seconds per GiB written (user + system, this process and its children, the probe's own
  refill excluded);
- the floor: copying the state into preallocated buffers, timed right before every snapshot
  (``stall / floor`` is the median of per-snapshot ratios, and ``stall / DCP`` compares those
  normalised stalls, so load drift on a shared machine cancels out);
- end-to-end overhead of a CPU training loop that snapshots every ``--loop-every`` steps, in
  wall time and in CPU time of the process tree, from paired loop segments with and without a
  snapshot (see :func:`train_loop`).

Usage: ``python benchmarks/bench_stall.py --state-gib 0.25 --json out.json``
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import gc
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import GIB, TreeCpu, TreeMemory, median, median_ci, table  # noqa: E402

import snapkeep  # noqa: E402
from snapkeep import writing  # noqa: E402

ppe_writing: Any
try:
    import pytorch_pfn_extras.writing as _ppe_writing

    ppe_writing = _ppe_writing
except ImportError:  # ppe is optional
    ppe_writing = None


# -- the state -----------------------------------------------------------------------------------
def make_state(state_gib: float, n_params: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``state_gib / 3`` GiB in ``n_params`` float32 tensors, plus Adam's state."""
    per = max(1024, int(state_gib * GIB / 3 / 4 / n_params) // 1024 * 1024)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(per // 1024, 1024)) for _ in range(n_params)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return model, optimizer


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat_tensors(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat_tensors(v, f"{prefix}/{i}"))
    return out


def fill(tensors: list[torch.Tensor], value: float) -> None:
    with torch.no_grad():
        for t in tensors:
            t.fill_(value)


def classify(loaded: dict[str, torch.Tensor], expected: set[str], value: float
             ) -> tuple[int, int]:
    """(torn, later): tensors holding a mix of values, and tensors wholly from after the call."""
    torn = later = 0
    for key in expected:
        t = loaded.get(key)
        if t is None:
            torn += 1
            continue
        lo, hi = (float(x) for x in t.aminmax())
        if lo == hi == value:
            continue
        if lo == hi:
            later += 1
        else:
            torn += 1
    return torn, later


# -- contenders ------------------------------------------------------------------------------------
class Contender:
    """One way of taking a snapshot. ``save`` is the timed call; ``wait`` returns once durable."""

    name = "?"
    family = "?"

    def open(self, out_dir: str) -> None:
        self.out = out_dir

    def save(self, name: str, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        pass

    def load(self, name: str) -> dict[str, torch.Tensor]:
        return flat_tensors(torch.load(os.path.join(self.out, name), mmap=True,
                                       weights_only=False, map_location="cpu"))

    def remove(self, name: str) -> None:
        for path in (os.path.join(self.out, name),
                     os.path.join(self.out, ".snapkeep", name + ".json")):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)

    def close(self) -> None:
        pass


class SnapkeepContender(Contender):
    family = "snapkeep"

    def __init__(self, cls: type[writing.Writer], **kwargs: Any) -> None:
        self.cls = cls
        self.kwargs = kwargs
        extra = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        self.name = f"snapkeep {cls.__name__}" + (f" ({extra})" if extra else "")

    def open(self, out_dir: str) -> None:
        super().open(out_dir)
        self.writer = self.cls(**self.kwargs)

    def save(self, name: str, state: dict[str, Any]) -> None:
        self.writer(name, self.out, state)

    def wait(self) -> None:
        self.writer.wait()

    def close(self) -> None:
        self.writer.finalize()
        del self.writer  # its staging buffers go with it


class PpeContender(Contender):
    family = "ppe"

    def __init__(self, cls: Any) -> None:
        self.cls = cls
        self.name = f"ppe {cls.__name__}"
        self._last: str | None = None

    def open(self, out_dir: str) -> None:
        super().open(out_dir)
        self.writer = self.cls(out_dir=out_dir)

    def save(self, name: str, state: dict[str, Any]) -> None:
        self._last = name
        # an absolute name: ppe's queue writers ignore out_dir and write into the working dir
        self.writer(os.path.join(self.out, name), self.out, state)

    def wait(self) -> None:
        worker = getattr(self.writer, "_worker", None)
        if worker is not None:
            worker.join()
            if getattr(worker, "exitcode", 0):
                raise RuntimeError(f"ppe worker failed with exit code {worker.exitcode}")
        queue = getattr(self.writer, "_queue", None)
        if queue is not None:
            queue.join()
        if self._last is not None:  # ppe does not fsync; count the fsync in "durable"
            with open(os.path.join(self.out, self._last), "rb") as f:
                os.fsync(f.fileno())

    def close(self) -> None:
        self.writer.finalize()
        del self.writer


class DcpContender(Contender):
    family = "dcp"
    name = "DCP async_save"

    def open(self, out_dir: str) -> None:
        import torch.distributed as dist

        super().open(out_dir)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._future: Any = None
        self._template: Any = None

    def save(self, name: str, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        if self._future is not None:  # one in flight, like snapkeep's default
            self._future.result()
        self._future = dcp.async_save(state, checkpoint_id=os.path.join(self.out, name))
        self._state = state

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()
            self._future = None

    def load(self, name: str) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        if self._template is None:
            self._template = copy.deepcopy(self._state)
        dcp.load(self._template, checkpoint_id=os.path.join(self.out, name))
        return flat_tensors(self._template)

    def close(self) -> None:
        self.wait()
        self._template = None


class TorchSaveContender(Contender):
    family = "torch"
    name = "torch.save + fsync"

    def save(self, name: str, state: dict[str, Any]) -> None:
        with open(os.path.join(self.out, name), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


def contenders(selected: list[str] | None) -> list[Contender]:
    out: list[Contender] = [SnapkeepContender(c) for c in (
        writing.SimpleWriter, writing.ThreadWriter, writing.ThreadQueueWriter,
        writing.ProcessWriter, writing.ProcessQueueWriter)]
    out.append(DcpContender())
    out.append(TorchSaveContender())
    if ppe_writing is not None:
        # ProcessQueueWriter last: it moves the trainer's own tensors into shared memory
        out += [PpeContender(getattr(ppe_writing, n)) for n in (
            "SimpleWriter", "ThreadWriter", "ThreadQueueWriter", "ProcessWriter",
            "ProcessQueueWriter")]
    if selected:
        out = [c for c in out if any(s.lower() in c.name.lower() for s in selected)]
    return out


# -- phase A: stall, durability, memory, torn tensors, CPU -------------------------------------
@dataclasses.dataclass
class Row:
    name: str
    family: str
    first_stall_s: float = float("nan")
    stall_s: float = float("nan")
    stall_max_s: float = float("nan")
    durable_s: float = float("nan")
    peak_rss_gib: float = float("nan")
    rss_x_state: float = float("nan")
    extra_rss_x_state: float = float("nan")
    rss_drift_mib: float = float("nan")
    torn: int = 0
    later: int = 0
    checked: int = 0
    cpu_s_per_gib: float = float("nan")
    floor_s: float = float("nan")
    stall_x_floor: float = float("nan")
    stall_x_dcp: float = float("nan")
    loop_overhead_pct: float = float("nan")
    loop_cpu_overhead_pct: float = float("nan")
    loop_overhead_ci: str = ""
    error: str | None = None


class Floor:
    """The floor: one copy of the state's storages into preallocated, warm buffers, the faster
    of ``Tensor.copy_`` (torch's threads) and a single-threaded ``memcpy`` (``ctypes.memmove``);
    on a busy two-core machine the single-threaded copy is often the faster one."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        storages = {t.untyped_storage().data_ptr(): t for t in tensors}
        self.sources = [torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
                        for t in storages.values()]
        self.buffers = [torch.empty_like(s) for s in self.sources]
        self.nbytes = sum(s.numel() for s in self.sources)
        self.first_s = self.time()  # touches the buffers

    def time_copy(self) -> float:
        t0 = time.perf_counter()
        for d, s in zip(self.buffers, self.sources):
            d.copy_(s)
        return time.perf_counter() - t0

    def time_memcpy(self) -> float:
        t0 = time.perf_counter()
        for d, s in zip(self.buffers, self.sources):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), s.numel())
        return time.perf_counter() - t0

    def time(self) -> float:
        return min(self.time_copy(), self.time_memcpy())

    def summary(self, repeats: int) -> dict[str, float]:
        copy_times = [self.time_copy() for _ in range(repeats)]
        memcpy_times = [self.time_memcpy() for _ in range(repeats)]
        times = [min(a, b) for a, b in zip(copy_times, memcpy_times)]
        clone_times = []
        for _ in range(2):
            t0 = time.perf_counter()
            clones = [s.clone() for s in self.sources]
            clone_times.append(time.perf_counter() - t0)
            del clones
        floor = median(times)
        return {"floor_s": floor, "floor_gb_s": self.nbytes / floor / 1e9,
                "torch_copy_s": median(copy_times), "memcpy_s": median(memcpy_times),
                "first_copy_s": self.first_s, "clone_s": median(clone_times),
                "clone_gb_s": self.nbytes / median(clone_times) / 1e9}


def run_snapshots(contender: Contender, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  args: argparse.Namespace, out_dir: str, mem: TreeMemory, state_bytes: int,
                  floor: Floor, base_rss: int) -> Row:
    row = Row(name=contender.name, family=contender.family)
    tensors = list(flat_tensors(state_of(model, optimizer)).values())
    expected = set(flat_tensors(state_of(model, optimizer)))
    count = 1 + args.repeats
    if contender.family == "snapkeep":
        count = max(count, args.flat_snapshots)
    stalls, durables, cpus, rss_after, floors = [], [], [], [], []
    cpu = TreeCpu()
    mem.reset()
    contender.open(out_dir)
    try:
        for r in range(count):
            value = float(r + 1)
            fill(tensors, value)
            state = state_of(model, optimizer)
            gc.collect()
            mem.start_window()  # the floor is timed with the sampler running, as the stall is
            floors.append(floor.time())  # the floor under the same load, just before the call
            cpu.start()
            t0 = time.perf_counter()
            contender.save(f"snap_{r}", state)
            t1 = time.perf_counter()
            probe0 = time.thread_time()
            fill(tensors, value + 0.5)  # the in-place mutation right after the call
            probe_cpu = time.thread_time() - probe0
            contender.wait()
            t2 = time.perf_counter()
            cpus.append(cpu.elapsed_s() - probe_cpu)
            mem.end_window()
            del state
            rss_after.append(mem.current_bytes())
            stalls.append(t1 - t0)
            durables.append(t2 - t0)
            if r <= args.repeats:
                loaded = contender.load(f"snap_{r}")
                torn, later = classify(loaded, expected, value)
                del loaded
                row.torn += torn
                row.later += later
                row.checked += len(expected)
            contender.remove(f"snap_{r}")
            print(f"  {contender.name} #{r}: stall {t1 - t0:.3f} s, durable {t2 - t0:.2f} s",
                  flush=True)
    except Exception as e:  # a contender that cannot run is reported, not fatal
        row.error = f"{type(e).__name__}: {e}"
        print(f"  {contender.name} failed: {row.error}", flush=True)
    finally:
        with contextlib.suppress(Exception):
            contender.close()
    if stalls:
        row.first_stall_s = stalls[0]
        rest = stalls[1:args.repeats + 1] or stalls
        row.stall_s = median(rest)
        row.stall_max_s = max(rest)
        row.durable_s = median(durables[1:args.repeats + 1] or durables)
        row.floor_s = median(floors[1:args.repeats + 1] or floors)
        row.stall_x_floor = median([s / f for s, f in zip(stalls[1:args.repeats + 1],
                                                          floors[1:args.repeats + 1])])
        row.cpu_s_per_gib = median(cpus[1:] or cpus) / (state_bytes / GIB)
        peak = mem.peak_bytes - floor.nbytes  # the benchmark's own floor buffers are resident
        row.peak_rss_gib = peak / GIB
        row.rss_x_state = peak / state_bytes
        row.extra_rss_x_state = (peak - base_rss - state_bytes) / state_bytes
        if len(rss_after) >= 3:
            row.rss_drift_mib = (rss_after[-1] - rss_after[1]) / (1 << 20)
    return row


# -- phase B: training-loop overhead ------------------------------------------------------------
def train_loop(contender: Contender, args: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    """Overhead of snapshotting every ``loop_every`` steps, from paired segments of one loop.

    The loop runs ``2 * loop_pairs`` segments of ``loop_every`` steps; in each pair one segment
    starts with a snapshot and ends once it is durable ("on"), the other takes none ("off"),
    in the order on/off, off/on, on/off, ... (ABBA), so the machine's drifting speed cancels
    out. Cost per snapshot = median over pairs of (on - off); overhead = that cost over the
    median "off" segment, i.e. the overhead of snapshotting every ``loop_every`` steps. The
    same in CPU seconds of the process tree. One untimed warm-up snapshot first starts workers
    and allocates buffers (steady state).
    """
    torch.manual_seed(0)
    width = args.loop_width
    layers: list[torch.nn.Module] = []
    for _ in range(args.loop_depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.loop_batch, width)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    for _ in range(2):
        step()
    contender.open(out_dir)
    contender.save("loop_warmup", state_of(model, optimizer))
    contender.wait()
    cpu = TreeCpu()
    pairs: list[dict[str, float]] = []
    try:
        for pair in range(args.loop_pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            seg: dict[str, float] = {}
            for on in order:
                cpu.start()
                t0 = time.perf_counter()
                if on:
                    contender.save(f"loop_{pair}", state_of(model, optimizer))
                for _ in range(args.loop_every):
                    step()
                if on:
                    contender.wait()
                key = "on" if on else "off"
                seg[key + "_s"] = time.perf_counter() - t0
                seg[key + "_cpu_s"] = cpu.elapsed_s()
            pairs.append(seg)
    finally:
        contender.close()
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
    off = median([p["off_s"] for p in pairs])
    off_cpu = median([p["off_cpu_s"] for p in pairs])
    costs = [p["on_s"] - p["off_s"] for p in pairs]
    cost = median(costs)
    cost_lo, cost_hi = median_ci(costs)
    cost_cpu = median([p["on_cpu_s"] - p["off_cpu_s"] for p in pairs])
    state_mib = sum(t.numel() * t.element_size() for t in
                    flat_tensors(state_of(model, optimizer)).values()) / (1 << 20)
    return {"pairs": pairs, "segment_s": off, "segment_cpu_s": off_cpu,
            "cost_per_snapshot_s": cost, "cost_per_snapshot_cpu_s": cost_cpu,
            "overhead_pct": 100.0 * cost / off, "cpu_overhead_pct": 100.0 * cost_cpu / off_cpu,
            "overhead_ci_pct": (100.0 * cost_lo / off, 100.0 * cost_hi / off),
            "state_mib": state_mib}


# -- main ---------------------------------------------------------------------------------------
COLUMNS = [
    ("name", "writer", ""), ("first_stall_s", "first stall s", ".3f"),
    ("stall_s", "stall s (median)", ".3f"), ("stall_x_floor", "stall / floor", ".2f"),
    ("stall_x_dcp", "stall / DCP", ".2f"), ("durable_s", "durable s", ".2f"),
    ("peak_rss_gib", "peak RSS GiB", ".2f"), ("rss_x_state", "RSS / state", ".2f"),
    ("extra_rss_x_state", "copies", ".2f"),
    ("rss_drift_mib", "RSS drift MiB", ".0f"), ("torn", "torn", "d"), ("later", "later", "d"),
    ("cpu_s_per_gib", "CPU s/GiB", ".2f"), ("loop_overhead_pct", "loop overhead %", ".1f"),
    ("loop_overhead_ci", "95 % CI", ""), ("loop_cpu_overhead_pct", "loop CPU overhead %", ".1f"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=3.0, help="state size, GiB (default 3)")
    p.add_argument("--params", type=int, default=8, help="model tensors (x4 state tensors)")
    p.add_argument("--repeats", type=int, default=5, help="timed snapshots per writer (>= 5)")
    p.add_argument("--flat-snapshots", type=int, default=20,
                   help="snapshots per snapkeep writer for the RSS drift (0: repeats only)")
    p.add_argument("--out", default=None, help="directory for snapshots (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--only", nargs="*", default=None, help="substrings of writer names to run")
    p.add_argument("--loop-every", type=int, default=10, help="snapshot every N loop steps")
    p.add_argument("--loop-width", type=int, default=1024)
    p.add_argument("--loop-depth", type=int, default=4)
    p.add_argument("--loop-batch", type=int, default=512)
    p.add_argument("--loop-pairs", type=int, default=20,
                   help="(with, without a snapshot) segment pairs per writer; median of them")
    p.add_argument("--no-loop", action="store_true", help="skip the training-loop phase")
    p.add_argument("--loop-only", action="store_true", help="only the training-loop phase")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats must be >= 5 (the issue asks for a median of at least 5)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # absolute: ppe's writers join out_dir and filename themselves
    root = os.path.abspath(args.out or tempfile.mkdtemp(prefix="snapkeep-bench-", dir=os.getcwd()))
    os.makedirs(root, exist_ok=True)
    mem = TreeMemory()
    base_rss = mem.current_bytes()
    load_before = os.getloadavg()
    if args.loop_only:
        args.state_gib = 1 / 1024  # phase A is skipped: a token state
    model, optimizer = make_state(args.state_gib, args.params)
    tensors = list(flat_tensors(state_of(model, optimizer)).values())
    state_bytes = sum(t.untyped_storage().nbytes() for t in tensors)
    print(f"state: {state_bytes / GIB:.2f} GiB in {len(tensors)} tensors; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs",
          flush=True)
    floor_copy = Floor(tensors)
    floor = floor_copy.summary(args.repeats)
    print(f"floor: copy into preallocated buffers {floor['floor_s']:.3f} s "
          f"({floor['floor_gb_s']:.1f} GB/s; Tensor.copy_ {floor['torch_copy_s']:.3f} s, one "
          f"memcpy {floor['memcpy_s']:.3f} s); clone into fresh memory {floor['clone_s']:.3f} s",
          flush=True)

    rows: list[Row] = []
    for contender in [] if args.loop_only else contenders(args.only):
        out_dir = os.path.join(root, re.sub(r"[^A-Za-z0-9_.-]+", "_", contender.name))
        os.makedirs(out_dir, exist_ok=True)
        rows.append(run_snapshots(contender, model, optimizer, args, out_dir, mem, state_bytes,
                                  floor_copy, base_rss))
        shutil.rmtree(out_dir, ignore_errors=True)
        gc.collect()
    # stall / DCP compares stalls normalised by their own floors, so load drift between writers
    # on a shared machine cancels out
    dcp = next((r for r in rows if r.family == "dcp"), None)
    dcp_stall = dcp.stall_s if dcp is not None else float("nan")
    for r in rows:
        if dcp is not None:
            r.stall_x_dcp = r.stall_x_floor / dcp.stall_x_floor
    del floor_copy  # free its buffers before the loop phase
    print()
    print(table([dataclasses.asdict(r) for r in rows], COLUMNS[:-3]), flush=True)

    loop: dict[str, Any] = {}
    if not args.no_loop:
        del model, optimizer, tensors
        gc.collect()
        loop_dir = os.path.join(root, "loop")
        os.makedirs(loop_dir, exist_ok=True)
        for contender in contenders(args.only):
            try:
                result = train_loop(contender, args, loop_dir)
            except Exception as e:
                print(f"  loop with {contender.name} failed: {type(e).__name__}: {e}",
                      flush=True)
                continue
            loop[contender.name] = result
            print(f"loop with {contender.name}: {result['segment_s']:.2f} s per "
                  f"{args.loop_every} steps, +{result['cost_per_snapshot_s']:.3f} s and "
                  f"+{result['cost_per_snapshot_cpu_s']:.2f} CPU-s per snapshot of "
                  f"{result['state_mib']:.0f} MiB: {result['overhead_pct']:.1f} % (95 % CI "
                  f"{result['overhead_ci_pct'][0]:.1f} .. {result['overhead_ci_pct'][1]:.1f} %; "
                  f"{result['cpu_overhead_pct']:.1f} % CPU)", flush=True)
        if args.loop_only:
            rows = [Row(name=c.name, family=c.family) for c in contenders(args.only)]
        for r in rows:
            if r.name in loop:
                r.loop_overhead_pct = loop[r.name]["overhead_pct"]
                r.loop_cpu_overhead_pct = loop[r.name]["cpu_overhead_pct"]
                lo, hi = loop[r.name]["overhead_ci_pct"]
                r.loop_overhead_ci = f"{lo:.1f} .. {hi:.1f}"
    mem.close()
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)

    text = table([dataclasses.asdict(r) for r in rows], COLUMNS)
    print()
    print(f"state {state_bytes / GIB:.2f} GiB; floor {floor['floor_s']:.3f} s "
          f"({floor['floor_gb_s']:.1f} GB/s); DCP stall {dcp_stall:.3f} s; process RSS before "
          f"the state {base_rss / GIB:.2f} GiB; load average {load_before[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")
    print(text)
    for r in rows:
        if r.error:
            print(f"{r.name}: {r.error}")
    if args.json:
        result = {
            "config": {k: v for k, v in vars(args).items()},
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                        "snapkeep": snapkeep.__version__, "python": platform.python_version(),
                        "threads": torch.get_num_threads()},
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "state_bytes": state_bytes, "base_rss_bytes": base_rss, "floor": floor,
            "rows": [dataclasses.asdict(r) for r in rows], "loop": loop,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
