"""How much memory does a snapshot take? ``staging_budget=`` against the unbounded path and DCP
``async_save`` (issue 34).

Usage::

    python benchmarks/bench_budget.py --state-gib 2 --repeats 3 \\
        --json benchmarks/results/budget-2gib.json --plot docs/results/budget-2gib.png
    python benchmarks/bench_budget.py --quick        # 256 MiB, 1 repeat: a smoke run

State: a model of 1/3 of ``--state-gib`` in 8 float32 parameters plus Adam's two moments (the
state of ``bench_memory_tier.py``), trained by the ppe manager with the snapshot extension and
a ``ThreadWriter`` (the validated overlap: the optimizer-owned tensors may be copied after the
call, and the next ``optimizer.step()`` waits for them). Each iteration is an Adam step over
the whole state (one torch thread), in place. Each configuration runs in a fresh child process
(so peaks are its own): one warm-up snapshot (allocates the staging memory; gives the rates the
prediction uses), then one measured snapshot at iteration 2 followed at once by the next step.
The gradients are kept in their own tensors (the manager's ``zero_grad`` drops them; they are
set again each iteration), so training's own memory is steady.

Rows (``--repeats`` children each, ABBA order, medians):

- ``budget 1/4``, ``1/2``, ``1x``: ``ThreadWriter(staging_budget=...)`` of that share of the
  state's tensor bytes; ``budget 64 MiB``: a small fixed budget. Target: peak above training
  <= 1.1 x budget + :data:`CONSTANT_BYTES` (32 MiB: the writer's own buffers, the skeleton);
- ``unbounded``: ``ThreadWriter()`` (a full staging copy);
- ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` (gloo group of one), the
  state dicts of model and optimizer, one save in flight.

Columns: **peak above training** = the peak resident memory of the process (anonymous RSS
plus the largest file-backed and shared RSS, sampled every 20 ms by ``_measure.TreeMemory``)
from before the warm-up snapshot until the measured one is durable (so staging memory kept
between snapshots counts), minus training's own peak (two Adam steps without a snapshot,
sampled the same way: the state, the gradients and Adam's temporaries); **stall** = the
call's own time plus the time the next ``optimizer.step()`` waited in the snapshot's step
pre-hook (hooks registered before and after it); DCP: the call; **predicted** = the engine's
prediction of the time until every tensor is staged (``BudgetStats.predicted_staged_s``, from
the warm-up snapshot's copy and write rates; the step follows the call at once, so that is the
stall); for the unbounded path ``state / copy rate`` of the warm-up; **durable** = from the call
until the snapshot is committed (fsynced, renamed); **exact** = the file holds the state of the
call bit for bit (checked against a copy taken after the measured save, outside the timing).
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
from _measure import GIB, TreeMemory, median, table

MIB = 1 << 20
#: The constant the targets allow above 1.1 x the budget: the writer's own buffers (the local
#: O_DIRECT commit's chunk buffers, 3 x 8 MiB) plus the skeleton and the pickle.
CONSTANT_BYTES = 32 * MIB
CONFIGS = ["budget 1/4", "budget 1/2", "budget 1x", "budget 64 MiB", "unbounded",
           "DCP async_save"]
SHARE = {"budget 1/4": 0.25, "budget 1/2": 0.5, "budget 1x": 1.0}


def build(state_gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    per = int(state_gib * GIB / 3 / 8 / 4)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(per)) for _ in range(8)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # Adam's moments allocated: training's own memory
    return model, optimizer


def child(config: str, state_gib: float, out: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, optimizer = build(state_gib)
    state_bytes = sum(t.nbytes for t in model.state_dict().values()) + sum(
        v.nbytes for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor))
    params = list(model.parameters())
    grads = [p.grad for p in params]  # kept: the manager's zero_grad drops them
    from snapkeep import writing
    from snapkeep.training import ExtensionsManager, extensions

    memory = TreeMemory()
    memory.start_window()  # training's own peak: a step without a snapshot (Adam's temporaries)
    for _ in range(2):
        optimizer.step()
    memory.end_window()
    base = memory.peak_bytes
    memory.reset()
    memory.start_window()
    times: dict[str, float] = {}

    def before(*_: Any) -> None:
        times["hook_in"] = time.perf_counter()

    def after(*_: Any) -> None:
        times["hook_out"] = time.perf_counter()

    optimizer.register_step_pre_hook(before)  # before the snapshot's guard
    if config == "DCP async_save":
        return dcp_child(model, optimizer, state_bytes, memory, base, out)
    budget: int | None = None
    if config in SHARE:
        budget = int(state_bytes * SHARE[config])
    elif config == "budget 64 MiB":
        budget = 64 * MIB

    class TimedWriter(writing.ThreadWriter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            times["call_in"] = start
            handle = super().__call__(*args, **kwargs)
            times["call_s"] = time.perf_counter() - start
            if handle is not None:
                handle.committed.add_done_callback(
                    lambda _f: times.__setitem__("durable_at", time.perf_counter()))
            return handle

    writer = TimedWriter(out_dir=out, staging_budget=budget)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=3,
                                writer=writer)
    manager.extend(extensions.snapshot(n_retains=1),
                   trigger=lambda m: m.iteration in (1, 2))  # the warm-up and the measured
    result: dict[str, Any] = {"config": config, "state_bytes": state_bytes, "budget": budget}

    def set_grads() -> None:  # no new memory: the same gradient tensors every step
        for p, g in zip(params, grads):
            p.grad = g

    with manager.run_iteration(step_optimizers=["main"]):
        set_grads()  # iteration 1: its step updates every tensor in place; the warm-up
        # snapshot at its end
    optimizer.register_step_pre_hook(after)  # after the snapshot's guard
    writer.last_handle.wait()
    with manager.run_iteration(step_optimizers=["main"]):  # iteration 2: a step, then the
        set_grads()                                        # measured snapshot
    call_in, call_s = times["call_in"], times["call_s"]
    handle = writer.last_handle
    times.pop("hook_in", None), times.pop("hook_out", None)
    with manager.run_iteration(step_optimizers=["main"]):  # iteration 3: its step waits
        set_grads()
    wait_s = times.get("hook_out", 0.0) - times.get("hook_in", 0.0)
    handle.wait()
    durable_s = times["durable_at"] - call_in
    memory.end_window()
    stats = writer._saver.last_budget_stats
    manager.finalize()
    result.update(
        peak_above_bytes=memory.peak_bytes - base, stall_s=call_s + wait_s, call_s=call_s,
        step_wait_s=wait_s, durable_s=durable_s)
    if stats is not None and budget is not None and stats.state_bytes > budget:
        result.update(predicted_s=stats.predicted_staged_s, staged_s=stats.staged_s,
                      copy_Bps=stats.copy_Bps, write_Bps=stats.write_Bps,
                      write_lag_s=stats.write_lag_s, ring_bytes=stats.ring_bytes,
                      held_bytes=stats.held_bytes, pieces=list(stats.pieces),
                      blocks=stats.blocks)
    else:  # a full copy: the engine predicts budgeted snapshots only
        result.update(predicted_s=None)
    memory.close()
    optimizer.state.clear()  # training's memory freed before the check loads the file
    for p, g in zip(params, grads):
        p.data, p.grad = torch.empty(0), None
        g.set_()
    result["exact"] = exact(out, step=2)
    return result


def exact(out: str, step: int) -> bool:
    """The file of ``step`` holds the state of its call, bit for bit: every gradient stays
    1e-3, so the state at the call of iteration ``step``'s snapshot is that of a fresh
    :func:`build` (one Adam step) plus ``step`` more steps."""
    model, optimizer = build(_ARGS["state_gib"])
    for _ in range(step + 2):  # + the two steps that measured training's own peak
        optimizer.step()
    saved = torch.load(os.path.join(out, f"snapshot_iter_{step}"), weights_only=True)
    live = model.state_dict()
    got = saved["models"]["main"]
    if any(not torch.equal(got[k], live[k]) for k in live):
        return False
    return all(torch.equal(saved["optimizers"]["main"]["state"][i][k], v)
               for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()
               if isinstance(v, torch.Tensor))


_ARGS: dict[str, float] = {}


def dcp_child(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state_bytes: int,
              memory: TreeMemory, base: int, out: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def save(name: str) -> tuple[Any, float, float]:
        start = time.perf_counter()
        future = dcp.async_save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                                checkpoint_id=os.path.join(out, name))
        return future, start, time.perf_counter() - start

    future, _, _ = save("warm")
    optimizer.step()
    future.result()
    shutil.rmtree(os.path.join(out, "warm"))
    future, start, call_s = save("measured")
    optimizer.step()
    future.result()
    durable_s = time.perf_counter() - start
    memory.end_window()
    memory.close()
    dist.destroy_process_group()
    return {"config": "DCP async_save", "state_bytes": state_bytes, "budget": None,
            "peak_above_bytes": memory.peak_bytes - base, "stall_s": call_s, "call_s": call_s,
            "step_wait_s": 0.0, "durable_s": durable_s, "predicted_s": None, "exact": None}


def run_child(config: str, state_gib: float) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="snapkeep-bench-budget-", dir=os.environ.get("BENCH_DIR"))
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, __file__, "--child", config, "--state-gib",
                               str(state_gib), "--out", out], env=env, capture_output=True,
                              text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"{config}: child failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--state-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--child")
    p.add_argument("--out")
    p.add_argument("--from-json", help="re-render the table (and --json, --plot) of a run")
    a = p.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        report(saved["runs"], saved["state_gib"], saved["repeats"], a.json, a.plot)
        return 0
    if a.quick:
        a.state_gib, a.repeats = 0.25, 1
    _ARGS["state_gib"] = a.state_gib
    if a.child:
        print(json.dumps(child(a.child, a.state_gib, a.out)))
        return 0
    order: list[str] = []
    for r in range(a.repeats):
        order += CONFIGS if r % 2 == 0 else list(reversed(CONFIGS))  # ABBA
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for config in order:
        result = run_child(config, a.state_gib)
        runs[config].append(result)
        print(f"  {config:15s} peak +{result['peak_above_bytes'] / MIB:7.0f} MiB  stall "
              f"{result['stall_s']:.3f} s  predicted {result['predicted_s']}  durable "
              f"{result['durable_s']:.2f} s  exact {result['exact']}", flush=True)
    report(runs, a.state_gib, a.repeats, a.json, a.plot)
    return 0


def model_s(run: dict[str, Any]) -> float | None:
    """The prediction's formula with the measured snapshot's own rates (a check of the model,
    where ``predicted_s`` is the forecast from the previous snapshot's rates)."""
    from snapkeep._core.save.budget import predict_staged_s

    if not run.get("copy_Bps") or not run.get("write_Bps"):
        return None
    if not run.get("pieces"):
        return None
    return predict_staged_s(run["pieces"], run["blocks"], run["copy_Bps"], run["write_Bps"],
                            run.get("write_lag_s", 0.0))


def report(runs: dict[str, list[dict[str, Any]]], state_gib: float, repeats: int,
           json_path: str | None, plot_path: str | None) -> None:
    const = CONSTANT_BYTES
    rows = []
    summary: dict[str, Any] = {}
    dcp = runs.get("DCP async_save") or []
    dcp_stall = median([r["stall_s"] for r in dcp]) if dcp else None
    for config in [c for c in CONFIGS if runs.get(c)]:
        rs = runs[config]
        peak = median([r["peak_above_bytes"] for r in rs])
        stall = median([r["stall_s"] for r in rs])
        preds = [r["predicted_s"] for r in rs if r["predicted_s"]]
        pred = median(preds) if preds else None
        ratios = [r["stall_s"] / r["predicted_s"] for r in rs if r["predicted_s"]]
        ratio = median(ratios) if ratios else None
        models = [(r["stall_s"], m) for r in rs if (m := model_s(r))]
        model = median([m for _, m in models]) if models else None
        model_ratio = median([st / m for st, m in models]) if models else None
        budget = rs[0]["budget"]
        target = None if budget is None else 1.1 * budget + const
        summary[config] = dict(peak_above_bytes=peak, stall_s=stall, predicted_s=pred,
                               stall_over_predicted=ratio, model_s=model,
                               stall_over_model=model_ratio, durable_s=median(
                                   [r["durable_s"] for r in rs]), budget=budget,
                               peak_target_bytes=target,
                               peak_within_target=None if target is None else all(
                                   r["peak_above_bytes"] <= target for r in rs),
                               stall_over_dcp=None if not dcp_stall else stall / dcp_stall,
                               exact=all(r["exact"] is not False for r in rs),
                               stall_range_s=[min(r["stall_s"] for r in rs),
                                              max(r["stall_s"] for r in rs)])
        rows.append(dict(config=config, budget=None if budget is None else budget / MIB,
                         peak=peak / MIB, target=None if target is None else target / MIB,
                         stall=stall, lo=summary[config]["stall_range_s"][0],
                         hi=summary[config]["stall_range_s"][1], dcp=summary[config][
                             "stall_over_dcp"], pred=pred, ratio=ratio, model=model,
                         model_ratio=model_ratio, durable=summary[config]["durable_s"],
                         exact=None if rs[0]["exact"] is None else summary[config]["exact"]))
    any_run = next(iter(runs.values()))[0]
    print(f"\nstate {any_run['state_bytes'] / MIB:.0f} MiB, {repeats} repeats (ABBA), medians; "
          f"target: peak <= 1.1 x budget + {const / MIB:.0f} MiB")
    print(table(rows, [("config", "config", ""), ("budget", "budget MiB", ".0f"),
                       ("peak", "peak above training MiB", ".0f"),
                       ("target", "target MiB", ".0f"), ("stall", "stall s", ".2f"),
                       ("lo", "min", ".2f"), ("hi", "max", ".2f"),
                       ("dcp", "stall / DCP", ".2f"), ("pred", "forecast s", ".2f"),
                       ("ratio", "stall / forecast", ".2f"), ("model", "model s", ".2f"),
                       ("model_ratio", "stall / model", ".2f"),
                       ("durable", "durable s", ".2f"), ("exact", "exact", "")]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"state_gib": state_gib, "repeats": repeats, "constant_bytes": const,
                       "summary": summary, "runs": runs}, f, indent=1)
    if plot_path:
        plot(summary, const, plot_path)


def plot(summary: dict[str, Any], const: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    peaks = [summary[n]["peak_above_bytes"] / MIB for n in names]
    left.bar(names, peaks, color=["C0"] * 4 + ["C1", "C2"])
    for i, n in enumerate(names):
        if summary[n]["peak_target_bytes"] is not None:
            left.hlines(summary[n]["peak_target_bytes"] / MIB, i - 0.4, i + 0.4, colors="k",
                        linestyles="dashed")
    left.set_ylabel("peak host memory above training (MiB)")
    left.set_title(f"memory (dashed: 1.1 x budget + {const / MIB:.0f} MiB)")
    left.tick_params(axis="x", rotation=30)
    stalls = [summary[n]["stall_s"] for n in names]
    preds = [summary[n]["predicted_s"] or 0 for n in names]
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], stalls, width=0.4, label="stall (measured)")
    right.bar([x + 0.2 for x in xs], preds, width=0.4, label="predicted")
    right.set_xticks(list(xs), names, rotation=30)
    right.set_ylabel("seconds")
    right.set_title("stall of the loop")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
