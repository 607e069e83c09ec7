"""How often should I save? ``every="auto"`` against fixed intervals and CheckFreq's rule.

Three parts, one run:

1. **Costs, measured on this machine** with a real ``Checkpointer(every="auto")`` run per state
   size (a small state and about 1 GiB): the cost a save adds to the loop (``C``: the save's
   step minus a plain step, as ``every="auto"`` measures it), the time to durable (``D``: the
   save's step to its commit) and the restart time (``R``: a new process that opens the
   directory, loads the newest snapshot and trains one step, timed from its spawn).
2. **Simulation** with those costs and failures drawn with a mean time between failures ``M``
   (default 20 minutes and 2 hours; exponential, fixed seeds, the same failure times for every
   policy): a job of ``--failures`` x ``M`` seconds of training; each save stalls the loop
   ``C``, becomes durable ``D`` after its call (one in flight: a save due earlier waits), a
   failure loses the training since the newest durable snapshot and costs ``R``. Policies:
   fixed intervals swept around Young's (the best one reported), CheckFreq's rule
   (``max(C / 3.5 %, D)``), and ``every="auto"``: the library's own choice
   (:func:`snapkeep.session.Cadence`'s ``choose``) with the MTBF it would estimate from the job's
   history (``estimate_mtbf_s``: ``prior + uptime`` before any failure, then
   ``(0.03 prior + uptime) / (0.03 + failures)``, re-estimated
   at each restart, where the library also re-chooses as the uptime grows; the
   default prior of one day, and the true ``M`` as prior). Reported: the effective training
   time ratio (training / wall time), the mean over the seeds.
3. **A real run with injected kills**: a training subprocess with ``every=AutoInterval(...)``,
   SIGKILLed at random times (exponential, mean ``--kill-mtbf-s`` of wall time, fixed seed),
   rerun until it reaches its last step; each run's chosen interval is compared with the band
   of intervals the simulation, fed that run's measured costs, puts within 1 % of the best.

Usage::

    python benchmarks/bench_cadence.py --json benchmarks/results/cadence-<date>.json \\
        --plot benchmarks/results/cadence.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from typing import Any

from snapkeep.session import (
    AutoInterval,
    checkfreq_interval_s,
    choose,
    estimate_mtbf_s,
    young_interval_s,
)

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))

# -- 1. measured costs -----------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import json, sys, time, torch, snapkeep
    out, mib, steps, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    n = max(1, mib // 128)
    per = mib * (1 << 20) // 4 // n
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(per)) for _ in range(n)])
    every = snapkeep.AutoInterval(mtbf_s=1e6, max_steps=3, warmup_steps=3)
    t0 = time.monotonic()
    with snapkeep.Checkpointer(out, every=every, keep=1) as ck:
        state = {"model": model}
        ck.load(into=state)
        for step in range(1, steps + 1):
            with torch.no_grad():
                for p in model:
                    p.add_(1.0)
            time.sleep(0.05)
            ck.save(step, state)
            if mode == "restart":
                print(json.dumps({"ready_s": time.monotonic() - t0}), flush=True)
                break
        if mode == "measure":
            ck.wait()
            c = ck.choice
            print(json.dumps({"cost_s": c.cost_s, "durable_s": c.durable_s,
                              "step_s": c.step_s}), flush=True)
""")


def _python(code_path: str, *args: str) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, code_path, *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1]), time.monotonic() - started


def _restart(code: str, out: str, mib: int) -> float:
    """Seconds from spawning a process to its first trained step after loading the newest
    snapshot (imports, open, load, one step)."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, code, out, str(mib), "1", "restart"],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    ready = time.monotonic() - started
    proc.communicate(timeout=900)
    if "ready_s" not in line:
        raise RuntimeError(f"the restart did not train a step: {line!r}")
    if proc.returncode != 0:  # after the step: timed anyway, and said
        print(f"note: the restart process exited with {proc.returncode} after its step",
              flush=True)
    return ready


def measure_costs(mib: int, workdir: str) -> dict[str, float]:
    """C, D (seconds) of a real every='auto' run and R (seconds) of a real restart."""
    code = os.path.join(workdir, "worker.py")
    with open(code, "w") as f:
        f.write(WORKER)
    out = os.path.join(workdir, f"state-{mib}")
    measured, _ = _python(code, out, str(mib), "16", "measure")
    restarts = [_restart(code, out, mib) for _ in range(3)]
    shutil.rmtree(out, ignore_errors=True)
    return {"state_mib": mib, "cost_s": measured["cost_s"], "durable_s": measured["durable_s"],
            "step_s": measured["step_s"], "restart_s": statistics.median(restarts),
            "restarts_s": restarts}


# -- 2. simulation ---------------------------------------------------------------------------------

Policy = Callable[[int, float], float]  # (failures, uptime_s) -> interval, seconds of training


def simulate(policy: Policy, *, work_s: float, cost_s: float, durable_s: float,
             restart_s: float, mtbf_s: float, seed: int) -> float:
    """Training / wall time of one job (see the module docstring), one failure at a time.

    Between two failures the loop is periodic: the policy's interval ``T`` (chosen at the
    segment's start from the failures and uptime so far), then the save; save ``i`` is called
    at ``T + (i - 1) * L`` with ``L = max(T + C, D)`` (a save due before the previous one is
    durable waits for it), stalls ``C`` and is durable ``D`` after its call. A failure at ``tau``
    keeps the snapshots durable by then, costs ``R`` (a failure during the restart restarts
    again) and the training since the newest durable snapshot.
    """
    rng = random.Random(seed)
    wall = 0.0
    restarts = 0.0
    durable = 0.0  # training in the newest durable snapshot (the segment's start)
    failures = 0
    settle = max(cost_s, durable_s)
    while True:
        interval = policy(failures, wall - restarts)
        cycle = max(interval + cost_s, durable_s)
        tau = rng.expovariate(1.0 / mtbf_s)  # the next failure, from the segment's start
        left = work_s - durable
        saves = max(0, math.ceil(left / interval) - 1)  # saves before the last chunk
        finish = left if saves == 0 else \
            interval + (saves - 1) * cycle + cost_s + (left - saves * interval)
        if finish <= tau:
            return work_s / (wall + finish)
        kept = 0 if tau < interval + settle else \
            min(saves, math.floor((tau - interval - settle) / cycle) + 1)
        durable += kept * interval
        wall += tau
        failures += 1
        while True:  # the restart; a failure during it restarts again
            again = rng.expovariate(1.0 / mtbf_s)
            if again >= restart_s:
                wall += restart_s
                restarts += restart_s
                break
            wall += again
            restarts += again
            failures += 1


def ratios(policy: Policy, seeds: range, **kw: float) -> list[float]:
    return [simulate(policy, seed=s, **kw) for s in seeds]


def mean_ratio(policy: Policy, seeds: range, **kw: float) -> float:
    return statistics.fmean(ratios(policy, seeds, **kw))


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of ``a - b`` over the seeds (the same failure draws) and its standard error."""
    diff = [x - y for x, y in zip(a, b)]
    return {"mean": statistics.fmean(diff),
            "se": statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0}


def auto_policy(costs: dict[str, float], prior_s: float) -> Policy:
    """every='auto': the library's choice with the MTBF estimated from the job's history."""
    settings = AutoInterval(mtbf_s=prior_s)

    def policy(failures: int, uptime_s: float) -> float:
        mtbf = estimate_mtbf_s(prior_s, uptime_s=uptime_s, failures=failures)
        choice = choose(cost_s=costs["cost_s"], durable_s=costs["durable_s"],
                        step_s=costs["step_s"], mtbf_s=mtbf, settings=settings)
        return choice.interval_steps * costs["step_s"]
    return policy


def sweep(costs: dict[str, float], mtbf_s: float, args: argparse.Namespace) -> dict[str, Any]:
    seeds = range(args.seeds)
    kw = dict(work_s=args.failures * mtbf_s, cost_s=costs["cost_s"],
              durable_s=costs["durable_s"], restart_s=costs["restart_s"], mtbf_s=mtbf_s)
    young = young_interval_s(costs["cost_s"], mtbf_s)
    grid = sorted({young * 2 ** (k / 4) for k in range(-12, 13)} | {costs["durable_s"]})
    fixed = [(interval, mean_ratio(lambda f, u, i=interval: i, seeds, **kw))
             for interval in grid if interval >= costs["step_s"]]
    best_interval, best = max(fixed, key=lambda row: row[1])
    checkfreq_s = checkfreq_interval_s(costs["cost_s"], costs["durable_s"])
    per_best = ratios(lambda f, u: best_interval, seeds, **kw)
    per_checkfreq = ratios(lambda f, u: checkfreq_s, seeds, **kw)
    per_auto = ratios(auto_policy(costs, AutoInterval().mtbf_s), seeds, **kw)
    return {
        "mtbf_s": mtbf_s, "work_s": kw["work_s"], "seeds": args.seeds,
        "fixed": [{"interval_s": i, "ratio": r} for i, r in fixed],
        "best_fixed": {"interval_s": best_interval, "ratio": best},
        "band_1pct_s": [min(i for i, r in fixed if r >= best - 0.01),
                        max(i for i, r in fixed if r >= best - 0.01)],
        "checkfreq": {"interval_s": checkfreq_s, "ratio": statistics.fmean(per_checkfreq)},
        "auto_default_prior": {"ratio": statistics.fmean(per_auto)},
        "auto_true_prior": {"ratio": mean_ratio(auto_policy(costs, mtbf_s), seeds, **kw)},
        "auto_minus_best": paired(per_auto, per_best),
        "auto_minus_checkfreq": paired(per_auto, per_checkfreq),
        "young_daly_s": young,
    }


# -- 3. a real run with injected kills ----------------------------------------------------------

KILL_WORKER = textwrap.dedent("""
    import json, sys, time, torch, snapkeep
    out, steps, prior = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    optim = torch.optim.Adam(model.parameters())
    with snapkeep.Checkpointer(out, every=snapkeep.AutoInterval(mtbf_s=prior), keep=2) as ck:
        state = {"model": model, "optim": optim}
        start = ck.load(into=state) or 0
        print("start", start, flush=True)
        for step in range(start + 1, steps + 1):
            optim.zero_grad()
            model(torch.randn(32, 512)).pow(2).mean().backward()
            optim.step()
            time.sleep(0.01)
            if ck.save(step, state) is not None and ck.choice is not None:
                c = ck.choice
                print("choice", json.dumps({"step": step, **c.as_dict()}), flush=True)
    print("done", flush=True)
""")


def killed_run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    code = os.path.join(workdir, "kill_worker.py")
    with open(code, "w") as f:
        f.write(KILL_WORKER)
    out = os.path.join(workdir, "killed")
    rng = random.Random(args.kill_seed)
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    while True:
        deadline = time.monotonic() + rng.expovariate(1.0 / args.kill_mtbf_s)
        log = os.path.join(workdir, f"run-{len(runs)}.log")
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, code, out, str(args.kill_steps),
                                     str(args.kill_prior_s)], stdout=sink, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        with open(log) as f:
            buffer = f.read()
        choices: list[dict[str, Any]] = []
        done = False
        for line in buffer.splitlines():
            if line.startswith("choice "):
                choices.append(json.loads(line[7:]))
            done = done or line == "done"
        runs.append({"killed": proc.returncode == -signal.SIGKILL, "choices": choices})
        if done:
            break
    with open(os.path.join(out, ".snapkeep", "goodput.json")) as f:
        history = json.load(f)
    from snapkeep.session import run_goodput
    goodput = run_goodput(out)
    return {"runs": runs, "wall_s": time.monotonic() - started, "history": history,
            "goodput": goodput.as_dict() if goodput is not None else None}


# -- main ------------------------------------------------------------------------------------------

def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sims = results["simulations"]
    cols = 2
    rows = (len(sims) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.8 * rows), squeeze=False)
    for ax, sim in zip(axes.flat, sims):
        xs = [row["interval_s"] for row in sim["fixed"]]
        ax.plot(xs, [100 * row["ratio"] for row in sim["fixed"]], "o-", ms=3, color="#8c8c8c",
                label="fixed interval")
        auto = 100 * sim["auto_default_prior"]["ratio"]
        ax.axhline(auto, color="#4c72b0", label=f"every='auto' ({auto:.2f} %)")
        cf = sim["checkfreq"]
        ax.plot([cf["interval_s"]], [100 * cf["ratio"]], "s", color="#c44e52",
                label=f"CheckFreq ({100 * cf['ratio']:.2f} %)")
        best = sim["best_fixed"]
        ax.plot([best["interval_s"]], [100 * best["ratio"]], "*", ms=10, color="#55a868",
                label=f"best fixed ({100 * best['ratio']:.2f} %)")
        low = min(100 * r["ratio"] for r in sim["fixed"] if r["interval_s"] >= cf["interval_s"])
        ax.set_ylim(min(low, 100 * cf["ratio"]) - 0.5, 100 * best["ratio"] + 0.3)
        ax.set_xscale("log")
        ax.set_xlabel("seconds of training between snapshots")
        ax.set_ylabel("training / wall time, %")
        ax.set_title(f"{sim['state_mib']} MiB state, MTBF {sim['mtbf_s'] / 60:.0f} min",
                     fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 1024])
    p.add_argument("--mtbf-s", type=float, nargs="+", default=[1200.0, 7200.0])
    p.add_argument("--failures", type=float, default=24.0,
                   help="job length in MTBFs of training (default 24)")
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--kill-mtbf-s", type=float, default=25.0)
    p.add_argument("--kill-prior-s", type=float, default=60.0)
    p.add_argument("--kill-steps", type=int, default=3000)
    p.add_argument("--kill-seed", type=int, default=1)
    p.add_argument("--no-kills", action="store_true")
    p.add_argument("--from-json", default=None, help="replot/print a stored run")
    p.add_argument("--costs-from", default=None,
                   help="take the measured costs from a stored run's JSON (no measurement)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=[], action="append")
    return p.parse_args(argv)


def _table(results: dict[str, Any]) -> None:
    print("| state | MTBF | C s | D s | R s | best fixed s (ratio) | CheckFreq s (ratio) "
          "| auto, prior 1 day | auto, prior = MTBF | auto / best | auto / CheckFreq "
          "| auto - CheckFreq, points (se) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for sim in results["simulations"]:
        c = results["costs"][str(sim["state_mib"])]
        best, cf = sim["best_fixed"], sim["checkfreq"]
        auto = sim["auto_default_prior"]["ratio"]
        print(f"| {sim['state_mib']} MiB | {sim['mtbf_s'] / 60:.0f} min | {c['cost_s']:.3f} | "
              f"{c['durable_s']:.3f} | {c['restart_s']:.1f} | {best['interval_s']:.1f} "
              f"({100 * best['ratio']:.2f} %) | {cf['interval_s']:.1f} ({100 * cf['ratio']:.2f} "
              f"%) | {100 * auto:.2f} % | {100 * sim['auto_true_prior']['ratio']:.2f} % | "
              f"{auto / best['ratio']:.4f} | {auto / cf['ratio']:.4f} | "
              f"{100 * sim['auto_minus_checkfreq']['mean']:+.3f} "
              f"({100 * sim['auto_minus_checkfreq']['se']:.3f}) |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        results = {"argv": sys.argv[1:], "costs": {}, "simulations": []}
        with tempfile.TemporaryDirectory(prefix="bench-cadence-") as workdir:
            stored = {}
            if args.costs_from:
                with open(args.costs_from) as f:
                    stored = json.load(f)["costs"]
            for mib in args.sizes_mib:
                costs = stored.get(str(mib)) or measure_costs(mib, workdir)
                results["costs"][str(mib)] = costs
                print(f"measured {mib} MiB: {costs}", flush=True)
                for mtbf in args.mtbf_s:
                    sim = sweep(costs, mtbf, args)
                    sim["state_mib"] = mib
                    results["simulations"].append(sim)
            if not args.no_kills:
                kills = killed_run(args, workdir)
                results["kills"] = kills
    _table(results)
    kills = results.get("kills")
    if kills:
        _report_kills(results, kills, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for path in args.plot:
        _plot(results, path)
    return 0


def _report_kills(results: dict[str, Any], kills: dict[str, Any],
                  args: argparse.Namespace) -> None:
    """Each killed run's chosen intervals against the simulation's 1 % band for its costs."""
    rows = []
    for i, run in enumerate(kills["runs"]):
        for c in run["choices"][-1:]:
            costs = {"cost_s": c["cost_s"], "durable_s": c["durable_s"] or 0.0,
                     "step_s": c["step_s"], "restart_s": c["restart_s"] or 0.0}
            sim = sweep(costs, args.kill_mtbf_s, argparse.Namespace(
                seeds=min(args.seeds, 40), failures=args.failures))
            low, high = sim["band_1pct_s"]
            rows.append((i, c["interval_s"], c["interval_steps"], c["mtbf_s"], c["failures"],
                         low, high, low <= c["interval_s"] <= high))
    kills["checked"] = [dict(zip(("run", "interval_s", "interval_steps", "mtbf_estimate_s",
                                  "failures_seen", "band_low_s", "band_high_s", "inside"), r))
                        for r in rows]
    print(f"\nreal run, SIGKILL at random (mean {args.kill_mtbf_s:g} s), "
          f"{len(kills['runs'])} runs, {sum(r['killed'] for r in kills['runs'])} killed; "
          f"goodput {kills['goodput']}")
    print("| run | failures seen | chose s (steps) | MTBF estimate s | simulated 1 % band s "
          "| inside |")
    print("|---:|---:|---:|---:|---:|---|")
    for i, s, n, m, seen, low, high, inside in rows:
        print(f"| {i} | {seen} | {s:.2f} ({n}) | {m:.0f} | {low:.2f} - {high:.2f} | {inside} |")


if __name__ == "__main__":
    raise SystemExit(main())
