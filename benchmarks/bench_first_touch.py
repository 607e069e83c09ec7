"""What the first snapshot's staging copy cannot avoid: writing a state's bytes into memory the
process has never touched, against writing them into the same memory once it is warm.

Usage::

    python benchmarks/bench_first_touch.py --gib 1 --reps 4 \\
        --json benchmarks/results/first-touch-1gib.json

Each repetition runs every way of filling fresh memory in its own fresh process (ABBA order),
copying ``--gib`` from a warm source tensor with ``memmove`` (what staging does):

- ``copy into fresh pages``: an anonymous private mapping, each 4 KiB page faulted in and zeroed
  by the kernel on its first write (the copy is the first touch; snapkeep's staging does this);
- ``populate, then copy``: ``MADV_POPULATE_WRITE`` faults the whole range in one call first;
- ``huge pages, copy``: ``MADV_HUGEPAGE`` first (2 MiB pages where the kernel finds them; with
  ``transparent_hugepage/enabled`` = ``madvise`` only such ranges get them);
- ``2 threads, copy into fresh pages``: two threads copying 16 MiB chunks (faults in parallel);
- ``copy into warm pages``: the same mapping again, every page present (a later snapshot).

The first-snapshot stall of a writer called directly is at least the later stall plus
(fresh - warm); ``bench_resume.py --first-snapshot`` and ``bench_memory_tier.py`` report that
bound beside the measured stall.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from typing import Any

from _measure import GIB, median, table

WAYS = ("copy into fresh pages", "populate, then copy", "huge pages, copy",
        "2 threads, copy into fresh pages")
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
CHUNK = 16 << 20


def _copy(dst: int, src: int, nbytes: int, threads: int) -> None:
    offsets = iter(range(0, nbytes, CHUNK))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                off = next(offsets, None)
            if off is None:
                return
            ctypes.memmove(dst + off, src + off, min(CHUNK, nbytes - off))

    helpers = [threading.Thread(target=work) for _ in range(threads - 1)]
    for t in helpers:
        t.start()
    work()
    for t in helpers:
        t.join()


def child(way: str, nbytes: int) -> dict[str, Any]:
    import torch

    src = torch.ones(nbytes // 4)  # warm source, as a trainer's state
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = (ctypes.c_char * nbytes).from_buffer(region)
    dst = ctypes.addressof(view)
    try:
        t0 = time.perf_counter()
        if way == "huge pages, copy":
            region.madvise(mmap.MADV_HUGEPAGE)
        if way == "populate, then copy":
            region.madvise(MADV_POPULATE_WRITE)
        _copy(dst, src.data_ptr(), nbytes, 2 if way.startswith("2 threads") else 1)
        fresh = time.perf_counter() - t0
        t1 = time.perf_counter()
        _copy(dst, src.data_ptr(), nbytes, 1)
        warm = time.perf_counter() - t1
    finally:
        del view
        region.close()
    return {"fresh_s": fresh, "warm_s": warm}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    nbytes = int(args.gib * GIB) // 4096 * 4096
    if args.child:
        print(json.dumps(child(args.child, nbytes)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for way in WAYS if rep % 4 in (0, 3) else tuple(reversed(WAYS)):
            out = subprocess.run([sys.executable, __file__, "--child", way, "--gib",
                                  str(args.gib)], capture_output=True, text=True, check=True,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
            runs.setdefault(way, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    warm = median([r["warm_s"] for v in runs.values() for r in v])
    rows = [{"way": way, "fresh_s": median([r["fresh_s"] for r in v]),
             "gib_s": args.gib / median([r["fresh_s"] for r in v]),
             "x_warm": median([r["fresh_s"] for r in v]) / warm,
             "all": " ".join(f"{r['fresh_s']:.2f}" for r in v)} for way, v in runs.items()]
    rows.append({"way": "copy into warm pages", "fresh_s": warm, "gib_s": args.gib / warm,
                 "x_warm": 1.0, "all": ""})
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    print(f"{args.gib:g} GiB, {args.reps} fresh processes per way (ABBA), medians; "
          f"{os.cpu_count()} CPUs; transparent_hugepage/enabled: {thp}")
    print(table(rows, [("way", "way", ""), ("fresh_s", "s", ".3f"), ("gib_s", "GiB/s", ".2f"),
                       ("x_warm", "x warm copy", ".1f"), ("all", "each run s", "")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "reps": args.reps, "thp": thp, "rows": rows,
                       "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
