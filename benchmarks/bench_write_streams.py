"""Time to durable with 1, 2 and 4 ``O_DIRECT`` write streams (issue 12, item 5).

Writes one snapshot of ``--state-gib`` (8 float32 tensors) the way snapkeep's local commit does
-- ``torch_save`` (no zip CRC) through the XXH3 hashing writer into a ``DirectFile`` -- then
``fsync``s it, with ``streams`` = 1, 2 and 4 direct writes in flight, ``--reps`` times each in
ABBA order. **durable s** is the wall time from the first byte to the end of ``fsync``;
**CPU s/GiB** is this process's user + system CPU (all threads) over the same span.

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

from snapkeep._core.checksum import HashingWriter
from snapkeep._core.codec import torch_save
from snapkeep._core.storage._direct import DirectFile, open_for_write

STREAMS = (1, 2, 4)


def write_once(state: Any, directory: str, streams: int) -> tuple[float, float, int, bool]:
    path = os.path.join(directory, f"snap-{streams}")
    cpu0 = os.times()
    t0 = time.perf_counter()
    fd, direct = open_for_write(path)
    with DirectFile(fd, direct, streams=streams) as f:
        torch_save(state, HashingWriter(f))  # type: ignore[arg-type]
        f.finish()
        os.fsync(f.fileno())
        direct = f.direct
    elapsed = time.perf_counter() - t0
    cpu1 = os.times()
    size = os.path.getsize(path)
    os.unlink(path)
    return elapsed, (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), size, direct


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: cwd)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    per = int(args.state_gib * GIB / 8 / 4)
    state = {f"w{i}": torch.rand(per) for i in range(8)}
    runs: dict[int, list[tuple[float, float]]] = {s: [] for s in STREAMS}
    size = 0
    with tempfile.TemporaryDirectory(prefix="bench-streams-", dir=args.dir or os.getcwd()) as d:
        write_once(state, d, 1)  # warm-up: buffers, pools, the file system's allocator
        for rep in range(args.reps):
            order = STREAMS if rep % 4 in (0, 3) else tuple(reversed(STREAMS))  # ABBA
            for streams in order:
                elapsed, cpu, size, direct = write_once(state, d, streams)
                if not direct:
                    print("note: this filesystem refused O_DIRECT (buffered writes)")
                runs[streams].append((elapsed, cpu))
    gib = size / GIB
    base = median([e for e, _ in runs[1]])
    rows = [{"streams": s, "durable_s": median([e for e, _ in v]),
             "gib_s": gib / median([e for e, _ in v]),
             "x_one": median([e for e, _ in v]) / base,
             "cpu_gib": median([c for _, c in v]) / gib} for s, v in runs.items()]
    print(f"snapshot {gib:.3f} GiB, {args.reps} runs each (ABBA), medians")
    print(table(rows, [("streams", "streams", ""), ("durable_s", "durable s", ".3f"),
                       ("gib_s", "GiB/s", ".2f"), ("x_one", "x 1 stream", ".2f"),
                       ("cpu_gib", "CPU s/GiB", ".3f")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_bytes": size, "reps": args.reps, "rows": rows,
                       "runs": {str(k): v for k, v in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
