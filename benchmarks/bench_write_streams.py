"""Time to durable and CPU per GiB of the local ``O_DIRECT`` commit (issue 12, item 5).

Writes one snapshot of ``--state-gib`` (8 float32 tensors in page-aligned buffers, as snapkeep's
staging buffers are) the way the local commit does -- ``torch_save`` (no zip CRC) into a
``DirectFile`` with an XXH3 hasher -- then ``fsync``s it, ``--reps`` times per configuration in
ABBA order. Configurations: 1, 2 and 4 direct writes in flight (``streams``), each in three
**modes**:

- ``in place``: the commit as shipped: tensor records go to the disk from the staging buffers
  (no copy), each 8 MiB piece hashed just before it is written;
- ``copy``: every byte copied through the chunk buffer, hashed piece by piece as it is copied;
- ``copy+hash``: the commit before in-place writes: the whole record hashed first
  (``HashingWriter``), then copied through the chunk buffer -- two passes over memory.

**durable s** is the wall time from the first byte to the end of ``fsync``; **CPU s/GiB** is
this process's user + system CPU (all threads) over the same span.

    python benchmarks/bench_write_streams.py --state-gib 0.5 --reps 6 --json results/streams.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
from _measure import GIB, median, table

from snapkeep._core.format.codec import torch_save
from snapkeep._core.save.host_memory import _host_buffer
from snapkeep._core.storage import HashingWriter, _direct, new_hasher
from snapkeep._core.storage._direct import DirectFile
from snapkeep._core.storage._direct_resources import open_for_write

STREAMS = (1, 2, 4)
MODES = ("in place", "copy", "copy+hash")


def write_once(state: Any, directory: str, streams: int, mode: str
               ) -> tuple[float, float, int, bool, int]:
    path = os.path.join(directory, f"snap-{streams}")
    saved = _direct.IN_PLACE
    _direct.IN_PLACE = mode == "in place"
    try:
        cpu0 = os.times()
        t0 = time.perf_counter()
        fd, direct = open_for_write(path)
        hasher = new_hasher() if mode != "copy+hash" else None
        with DirectFile(fd, direct, streams=streams, hasher=hasher) as f:
            torch_save(state, HashingWriter(f, hashed_by=hasher))  # type: ignore[arg-type]
            f.finish()
            os.fsync(f.fileno())
            direct, in_place = f.direct, f.in_place_bytes
        elapsed = time.perf_counter() - t0
        cpu1 = os.times()
    finally:
        _direct.IN_PLACE = saved
    size = os.path.getsize(path)
    os.unlink(path)
    return elapsed, (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), size, direct, in_place


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: cwd)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    per = int(args.state_gib * GIB / 8 / 4)
    state = {f"w{i}": torch.empty(0).set_(_host_buffer(per * 4)).uniform_() for i in range(8)}
    configs = [(m, s) for m in MODES for s in STREAMS]
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {c: [] for c in configs}
    size = 0
    in_place_share = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-streams-", dir=args.dir or os.getcwd()) as d:
        write_once(state, d, 1, "in place")  # warm-up: buffers, pools, the file system
        for rep in range(args.reps):
            order = configs if rep % 4 in (0, 3) else list(reversed(configs))  # ABBA
            for mode, streams in order:
                elapsed, cpu, size, direct, in_place = write_once(state, d, streams, mode)
                if not direct:
                    print("note: this filesystem refused O_DIRECT (buffered writes)")
                if mode == "in place":
                    in_place_share = in_place / size
                runs[(mode, streams)].append((elapsed, cpu))
    gib = size / GIB
    base = median([e for e, _ in runs[("copy+hash", 1)]])
    rows = [{"mode": m, "streams": s, "durable_s": median([e for e, _ in v]),
             "gib_s": gib / median([e for e, _ in v]),
             "x_before": median([e for e, _ in v]) / base,
             "cpu_gib": median([c for _, c in v]) / gib} for (m, s), v in runs.items()]
    print(f"snapshot {gib:.3f} GiB ({100 * in_place_share:.1f} % of it written in place), "
          f"{args.reps} runs each (ABBA), medians")
    print(table(rows, [("mode", "mode", ""), ("streams", "streams", ""),
                       ("durable_s", "durable s", ".3f"), ("gib_s", "GiB/s", ".2f"),
                       ("x_before", "x copy+hash 1 stream", ".2f"),
                       ("cpu_gib", "CPU s/GiB", ".3f")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_bytes": size, "reps": args.reps, "in_place_share": in_place_share,
                       "rows": rows, "runs": {f"{m} {s}": v for (m, s), v in runs.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
