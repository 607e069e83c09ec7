"""The first ``Checkpointer.save`` after a restart against later ones, with and without the
staging buffers prepared in the background after ``load``.

Usage::

    python benchmarks/bench_checkpointer_first_save.py --state-mib 256 --reps 3

The parent writes one Checkpointer snapshot of ``--state-mib`` (a model of 1/3 of it in 8
float32 tensors plus Adam's ``exp_avg``/``exp_avg_sq``, as ``bench_resume.py``). Each run is a
fresh process (a restarted trainer): it builds the model and a fresh Adam, ``load``-s that
snapshot with the default ``ThreadWriter``, then :data:`N_SAVES` times takes
:data:`STEPS_BETWEEN` optimizer steps and times the ``save`` call (the stall: the staging copy),
waiting for the commit outside the timed part. ``no prefault`` switches the preparation off
in this benchmark only (the Checkpointer's ``_prepare_first_save`` replaced by a no-op).
Contenders run in ABBA order, ``--reps`` runs each; medians over runs. Each run also reports
the cost of copying the state's bytes into fresh and into warm pages
(``bench_resume.first_touch_floor``). Linux only.
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
from _measure import median, table
from bench_resume import first_touch_floor, make_model

import snapkeep
from snapkeep.writing import SimpleWriter

CONTENDERS = ("prefault", "no prefault")
N_SAVES = 3
STEPS_BETWEEN = 4  # optimizer steps before each save (training in between)
MIB = 1 << 20


def _state(state_mib: float) -> dict[str, Any]:
    model, optimizer = make_model(state_mib * MIB / (1 << 30))
    return {"model": model, "optim": optimizer}


def write_snapshot(state_mib: float, directory: str) -> None:
    state = _state(state_mib)
    for p in state["model"].parameters():
        p.grad = torch.ones_like(p)
    state["optim"].step()  # Adam's state exists
    with snapkeep.Checkpointer(directory, writer=SimpleWriter()) as ckpt:
        ckpt.save(1, state)


def child(contender: str, source: str, state_mib: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    if contender == "no prefault":  # benchmark only: the library has no switch for this
        snapkeep.Checkpointer._prepare_first_save = (  # type: ignore[method-assign]
            lambda self, *args, **kwargs: None)
    state = _state(state_mib)
    out = tempfile.mkdtemp(prefix="first-save-", dir=os.path.dirname(source))
    try:  # the snapshot in a directory of its own (runs do not write into each other's); a
        # hard link, as the store lists regular files only
        os.link(os.path.join(source, "ckpt_1"), os.path.join(out, "ckpt_1"))
        shutil.copytree(os.path.join(source, ".snapkeep"), os.path.join(out, ".snapkeep"))
        stalls: list[float] = []
        with snapkeep.Checkpointer(out) as ckpt:
            assert ckpt.load(into=state) == 1
            for p in state["model"].parameters():
                p.grad = torch.full_like(p, 1e-3)
            for i in range(N_SAVES):
                for _ in range(STEPS_BETWEEN):
                    state["optim"].step()
                t0 = time.perf_counter()
                ckpt.save(2 + i, state)
                stalls.append(time.perf_counter() - t0)
                ckpt.wait()
        nbytes = sum(p.numel() * 3 * 4 for p in state["model"].parameters())
        return {"stalls_s": stalls, "state_bytes": nbytes, **first_touch_floor(nbytes)}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_child(contender: str, source: str, state_mib: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", contender, "--source", source,
         "--state-mib", str(state_mib)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
        check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{contender} child failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def summarize(contender: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    firsts = [r["stalls_s"][0] for r in results]
    laters = [median(r["stalls_s"][1:]) for r in results]
    return {
        "case": contender, "first_s": median(firsts), "later_s": median(laters),
        "ratio": median([f / lt for f, lt in zip(firsts, laters)]),
        "fresh_copy_s": median([r["fresh_copy_s"] for r in results]),
        "warm_copy_s": median([r["warm_copy_s"] for r in results]),
        "stalls_s": [r["stalls_s"] for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=float, default=256.0)
    p.add_argument("--reps", type=int, default=3, help="fresh processes per contender")
    p.add_argument("--dir", default=None, help="where to save (default: a temp dir here)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--source", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.source, args.state_mib)))
        return 0
    top = tempfile.mkdtemp(prefix="bench-first-save-", dir=args.dir or os.getcwd())
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    load_before = os.getloadavg()
    try:
        source = os.path.join(top, "source")
        write_snapshot(args.state_mib, source)
        for rep in range(args.reps):
            order = CONTENDERS if rep % 4 in (0, 3) else tuple(reversed(CONTENDERS))  # ABBA
            for contender in order:
                runs[contender].append(run_child(contender, source, args.state_mib))
    finally:
        shutil.rmtree(top, ignore_errors=True)
    load_after = os.getloadavg()
    rows = [summarize(c, runs[c]) for c in CONTENDERS]
    nbytes = runs[CONTENDERS[0]][0]["state_bytes"]
    print(f"Checkpointer, first save after load vs later ({nbytes / MIB:.0f} MiB of tensors, "
          f"ThreadWriter, {STEPS_BETWEEN} optimizer steps before each of {N_SAVES} saves, "
          f"{args.reps} fresh processes each, ABBA, medians; ratio = median over runs of first "
          f"/ median of the later ones; load average before {load_before[0]:.1f}, after "
          f"{load_after[0]:.1f})")
    print(table(rows, [("case", "case", ""), ("first_s", "first stall s", ".3f"),
                       ("later_s", "later stall s", ".3f"), ("ratio", "first / later", ".2f"),
                       ("fresh_copy_s", "copy into fresh pages s", ".3f"),
                       ("warm_copy_s", "copy into warm pages s", ".3f")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_bytes": nbytes, "reps": args.reps, "rows": rows,
                       "loadavg_before": load_before, "loadavg_after": load_after}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
