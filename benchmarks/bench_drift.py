"""No drift over a thousand saves: resident memory, open files, threads, child processes and
``/dev/shm`` segments of the training process tree while each writer (through the snapshot
extension) and each door (Checkpointer, Lightning's ``SnapkeepCheckpointIO``, HF's
``SnapkeepCallback`` and ``SnapkeepTrainer``) saves a small state (a 0.5 MiB MLP with Adam, a
tiny GPT-2 for HF) once per step, keeping 2.

    PYTHONPATH=src python benchmarks/bench_drift.py [--saves 1000] [--every 10] [--json out.json]

Each case runs in a fresh process (``tests/support/drift.py``), sampled every ``--every`` saves
after the save in flight was waited for. **growth** = Theil-Sen slope of the tree's RSS over
the samples after warm-up (the first 10 % of the saves), per 100 saves, in MB (10^6 bytes);
**fds / threads / shm** = at warm-up -> at the end (the most seen after warm-up; a leak is the
least of the last fifth of the samples above the most of the first fifth); **after
close** = fds / threads / children / segments left once the door is closed, against before it
existed. The target: growth <= 1 MB per 100 saves and no count above its warm-up value.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.drift import CASES, leaks, verdict  # noqa: E402

#: the target: RSS growth after warm-up, MB (10^6 bytes) per 100 saves
MAX_GROWTH_MB_PER_100 = 1.0


def run(case: str, saves: int, every: int, base: str) -> dict:
    env_path = str(ROOT / "src")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "drift.py"), case, str(saves),
         str(pathlib.Path(base) / case.replace("/", "_")), "--every", str(every)],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": env_path, "OMP_NUM_THREADS": "1"})
    for line in out.stdout.splitlines():
        if line.startswith("DRIFT "):
            return json.loads(line[len("DRIFT "):])
    raise RuntimeError(f"{case} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=1000)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=None, help="cases to run (default all)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cases = args.only or list(CASES)
    warmup = max(args.every, args.saves // 10)
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="bench-drift-") as base:
        for case in cases:
            result = run(case, args.saves, args.every, base)
            raw.append(result)
            row = verdict(result, warmup)
            row["ok"] = row["rss_growth_mb_per_100"] <= MAX_GROWTH_MB_PER_100 \
                and not leaks(row)
            rows.append(row)
            sys.stderr.write(f"{case}: {row['seconds']:.0f} s\n")
    lines = ["| door / writer | saves | s | RSS at warm-up MiB | RSS at end MiB | "
             "growth MB/100 saves | fds | threads | children | shm | after close "
             "(fds/threads/children/shm) | ok |", "|" + "---|" * 12]
    for r in rows:
        def span(key: str, r: dict = r) -> str:
            return f"{r[key + '_warm']} -> {r[key + '_end']} (max {r[key + '_max']})"

        lines.append(
            f"| {r['case']} | {r['saves']} | {r['seconds']:.0f} | {r['rss_warm_mib']:.1f} | "
            f"{r['rss_end_mib']:.1f} | {r['rss_growth_mb_per_100']:.3f} | {span('fds')} | "
            f"{span('threads')} | {span('children')} | {span('shm')} | "
            f"{r['fds_leaked_after_close']:+d} / {r['threads_leaked_after_close']:+d} / "
            f"{r['children_leaked_after_close']:+d} / {r['shm_leaked_after_close']:+d} | "
            f"{'yes' if r['ok'] else 'NO'} |")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "raw": raw, "warmup_saves": warmup}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
