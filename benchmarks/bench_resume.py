"""Resume speed: snapkeep's autoload against ``torch.load`` (+ ``load_state_dict``), with and
without ``mmap=True``, and a plain read of the file, warm and cold page cache (issue 12, item 4).

The parent saves one manager snapshot of ``--state-gib`` (a model of 1/3 of it in 8 float32
tensors plus Adam's ``exp_avg``/``exp_avg_sq``) with snapkeep's ``SimpleWriter`` (so it has its
checksum manifest), then runs every contender ``--reps`` times, each in a fresh child process
(a model, a fresh Adam and, for autoload, the manager already built, as in a restarted
trainer), in ABBA order. Each child
times only the resume and reports its peak RSS (anonymous + file-backed pages, so
mapped file pages count, from ``VmHWM``) and its RSS before the resume.
**cold** drops the file's pages from the
page cache first (``fsync`` + ``posix_fadvise(DONTNEED)``). Linux only.

    python benchmarks/bench_resume.py --state-gib 1 --reps 2 --json results/resume.json
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

from snapkeep.training import ExtensionsManager, extensions
from snapkeep.writing import SimpleWriter

CONTENDERS = ("torch.load", "torch.load(mmap=True)", "snapkeep autoload", "read file")
N_PARAMS = 8


def make_model(state_gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    per = max(1024, int(state_gib * GIB / 3 / 4 / N_PARAMS) // 1024 * 1024)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(per // 1024, 1024)) for _ in range(N_PARAMS)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def manager_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: str,
                autoload: bool) -> Any:
    manager = ExtensionsManager({"main": model}, {"main": optimizer}, max_epochs=1,
                                iters_per_epoch=1000, writer=SimpleWriter(out_dir=out))
    manager.extend(extensions.snapshot(autoload=autoload), trigger=(1, "iteration"))
    return manager


def save(state_gib: float, out: str) -> str:
    model, optimizer = make_model(state_gib)
    manager = manager_for(model, optimizer, out, autoload=False)
    with manager.run_iteration(step_optimizers=["main"]):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, float(i + 1))
    manager.finalize()
    return os.path.join(out, "snapshot_iter_1")


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _status_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` (peak RSS of this process image: anonymous + file-backed +
    shared pages, reset by exec, unlike ``ru_maxrss``, which a child inherits) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _read_all(path: str) -> None:
    buf = bytearray(8 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def child(contender: str, path: str, state_gib: float, cold: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, optimizer = make_model(state_gib)
    if cold:
        drop_cache(path)
    else:  # the whole file in the page cache (a cold mmap run before read only part of it)
        _read_all(path)
    before = _status_bytes("VmRSS")
    manager = manager_for(model, optimizer, os.path.dirname(path), autoload=True) \
        if contender == "snapkeep autoload" else None
    t0 = time.perf_counter()
    if contender in ("torch.load", "torch.load(mmap=True)"):
        state = torch.load(path, weights_only=True, mmap=contender != "torch.load")
        model.load_state_dict(state["models"]["main"])
        optimizer.load_state_dict(state["optimizers"]["main"])
        del state
    elif manager is not None:  # snapkeep autoload: list, verify, map, load in place
        manager.start_extensions()
        if manager.iteration != 1:
            raise RuntimeError(f"autoload did not resume (iteration {manager.iteration})")
    elif contender == "read file":
        _read_all(path)
    else:
        raise ValueError(f"unknown contender {contender!r}")
    elapsed = time.perf_counter() - t0
    if contender != "read file":  # the loaded values, not just the time
        first = next(iter(model.parameters()))
        if float(first[0, 0]) == 0.0 or len(optimizer.state) != N_PARAMS:
            raise RuntimeError(f"{contender} did not load the state")
    peak = _status_bytes("VmHWM")
    return {"time_s": elapsed, "rss_before": before, "peak_rss": peak}


def run_child(contender: str, path: str, state_gib: float, cold: bool) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, __file__, "--child", contender, "--path", path,
         "--state-gib", str(state_gib)] + (["--cold"] if cold else []),
        env=env, capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{contender} child failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=2, help="runs per contender and cache state")
    p.add_argument("--dir", default=None, help="where to save (default: a temp dir on disk)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.path, args.state_gib, args.cold)))
        return 0
    out = tempfile.mkdtemp(prefix="bench-resume-", dir=args.dir or os.getcwd())
    try:
        path = save(args.state_gib, out)
        size = os.path.getsize(path)
        runs: dict[tuple[str, bool], list[dict[str, Any]]] = {}
        cases = [(c, cold) for cold in (False, True) for c in CONTENDERS
                 if not (c == "read file" and not cold)]
        for rep in range(args.reps):
            order = cases if rep % 4 in (0, 3) else list(reversed(cases))  # ABBA
            for contender, cold in order:
                runs.setdefault((contender, cold), []).append(
                    run_child(contender, path, args.state_gib, cold))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rows = []
    med = {k: median([r["time_s"] for r in v]) for k, v in runs.items()}
    for (contender, cold), results in runs.items():
        t = med[(contender, cold)]
        rows.append({
            "contender": contender, "cache": "cold" if cold else "warm", "time_s": t,
            "x_torch_load": t / med[("torch.load", cold)],
            "x_mmap": t / med[("torch.load(mmap=True)", cold)],
            "x_read": t / med[("read file", True)] if cold else None,
            "peak_x": median([r["peak_rss"] for r in results]) / size,
            "extra_x": median([r["peak_rss"] - r["rss_before"] for r in results]) / size,
        })
    print(f"state file {size / GIB:.3f} GiB, {args.reps} runs each (ABBA), medians")
    print(table(rows, [
        ("contender", "contender", ""), ("cache", "cache", ""), ("time_s", "resume s", ".3f"),
        ("x_torch_load", "x torch.load", ".2f"), ("x_mmap", "x mmap", ".2f"),
        ("x_read", "x read", ".2f"), ("peak_x", "peak RSS x state", ".2f"),
        ("extra_x", "RSS added x state", ".2f")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_bytes": size, "reps": args.reps, "rows": rows,
                       "runs": {f"{c}|{'cold' if k else 'warm'}": v
                                for (c, k), v in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
