"""GPU staging: how long does a snapshot of a CUDA state stop training? (issue 3, item 7)

On a CUDA machine this measures, for a state of ``--gib`` GiB spread over ``--tensors`` CUDA
tensors:

- a plain pinned copy: ``dst.copy_(src, non_blocking=True)`` into preallocated pinned buffers,
  then one synchronize (the D2H ceiling);
- a pageable copy: ``src.to('cpu')`` into fresh memory (what a naive snapshot does);
- snapkeep staging (``BufferSet.stage``): side-stream copies into reused pinned buffers,
  synchronised before it returns;
- the stall of a snapkeep ``ThreadWriter`` call on that state, and the time until the file is
  durable.

Each figure is the median of ``--repeats`` runs after a warm-up (the first run, which allocates
and pins buffers, is reported separately). Prints a table and, with ``--json PATH``, writes JSON.
Without CUDA it prints why and exits with status 0. Runs in well under 10 minutes at the default
size on a recent GPU.

Usage: ``python benchmarks/gpu_staging.py --gib 2 --json gpu.json``

Why a CUDA snapshot is consistent (the argument of :mod:`snapkeep._core.save.overlap`, for streams):
the call returns only after the device-to-host copies it enqueued have finished (snapkeep's side
stream first waits on the current stream, then is synchronised), so no kernel launched after the
call can change what was copied. An *overlapped* device copy, returning before the copy is done,
would rest on stream order alone: a copy enqueued on the training's current stream before the
call returns precedes every kernel launched after the call on that stream (the optimizer's
in-place updates included); a copy on a side stream, or a kernel on another stream, needs an event
recorded after the copy and waited on by the writing stream (``stream.wait_event``), or that
kernel may write the memory while the copy reads it. Version counters do not help on a GPU: they
move when a kernel is launched, not when it runs. This script measures the synchronised path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

GIB = 1 << 30


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(first run s, median of the next ``repeats`` runs s); CUDA work included."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    parser.add_argument("--tensors", type=int, default=32, help="number of CUDA tensors")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after warm-up (>= 1)")
    parser.add_argument("--out", default=None, help="directory for the ThreadWriter snapshot")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    if not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}); nothing to measure. Run this "
              "on a machine with an NVIDIA GPU and a CUDA build of torch.")
        return 0

    from snapkeep import writing
    from snapkeep._core.save.staging import BufferSet

    device = torch.device("cuda")
    per = max(1, int(args.gib * GIB / 4 / args.tensors))
    state = {f"t{i}": torch.randn(per, device=device) for i in range(args.tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gb = nbytes / 1e9
    print(f"{torch.cuda.get_device_name(device)}; state {nbytes / GIB:.2f} GiB in "
          f"{args.tensors} tensors; torch {torch.__version__}", flush=True)

    rows: list[dict[str, Any]] = []

    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state.values()]

    def pinned_copy() -> None:
        for dst, src in zip(pinned, state.values()):
            dst.copy_(src, non_blocking=True)

    first, med = _timed(pinned_copy, args.repeats)
    rows.append({"method": "pinned copy (preallocated)", "first_s": first, "median_s": med})
    pinned.clear()

    first, med = _timed(lambda: [t.to("cpu") for t in state.values()], args.repeats)
    rows.append({"method": "pageable .to('cpu') (fresh)", "first_s": first, "median_s": med})

    buffers = BufferSet()
    staged: dict[str, Any] = {}

    def stage() -> None:
        staged["tree"], staged["stats"] = buffers.stage(state)

    first, med = _timed(stage, args.repeats)
    rows.append({"method": "snapkeep BufferSet.stage", "first_s": first, "median_s": med})
    check = staged["tree"]
    ok = all(torch.equal(check[k], v.cpu()) for k, v in list(state.items())[:2])
    pinned_ok = all(t.is_pinned() for t in check.values())
    staged.clear()
    del check

    out = args.out or tempfile.mkdtemp(prefix="snapkeep-gpu-")
    writer = writing.ThreadWriter()
    stalls, durables = [], []
    for i in range(args.repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = writer(f"gpu_snap_{i}", out, state)
        t1 = time.perf_counter()
        assert handle is not None  # on_full='block' never skips
        for t in state.values():  # training continues: mutate in place on the GPU
            t.add_(1.0)
        handle.wait()
        stalls.append(t1 - t0)
        durables.append(time.perf_counter() - t0)
        os.remove(os.path.join(out, f"gpu_snap_{i}"))
    writer.finalize()
    rows.append({"method": "snapkeep ThreadWriter call (stall)", "first_s": stalls[0],
                 "median_s": statistics.median(stalls[1:]),
                 "durable_s": statistics.median(durables[1:])})

    floor = rows[0]["median_s"]
    for row in rows:
        row["gb_s"] = gb / row["median_s"]
        row["x_pinned"] = row["median_s"] / floor
    print("| method | first s | median s | GB/s | x pinned copy | durable s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        durable = f"{row['durable_s']:.2f}" if "durable_s" in row else "-"
        print(f"| {row['method']} | {row['first_s']:.3f} | {row['median_s']:.3f} | "
              f"{row['gb_s']:.1f} | {row['x_pinned']:.2f} | {durable} |")
    print(f"staged values correct: {ok}; staged buffers pinned: {pinned_ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "state_bytes": nbytes,
                       "torch": torch.__version__, "rows": rows, "staged_correct": ok,
                       "staged_pinned": pinned_ok}, f, indent=1)
    return 0 if ok and pinned_ok else 1


if __name__ == "__main__":
    sys.exit(main())
