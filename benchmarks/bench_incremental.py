"""Incremental snapshots against full ones, measured in the same run (ABBA pairs, medians).

Two workloads, each a plain loop with ``Checkpointer(keep=2)`` (the default ``ThreadWriter``),
one AdamW step then one snapshot per step, a fresh directory per run:

- **frozen backbone**: ``--frozen`` of the parameters (default 0.8) frozen, AdamW on the rest
  (the head). Full snapshots rewrite the whole state every time; incremental ones write the
  trainable parameters and their optimizer state (plus a small skeleton) after the first.
- **full fine-tune**: nothing frozen (AdamW on everything): every storage changes every step,
  so incremental snapshots write as much as full ones; this shows what the mode costs.

Per snapshot after the first: bytes written (the snapshot file, plus blobs written for
incremental ones; manifests excluded, < 1 KiB... a few KiB for incremental), the *stall* (the
``save`` call: staging), and *time to durable* (from the call to the commit). Then *resume*:
a new Checkpointer's ``load`` of the newest snapshot into fresh objects, verified (warm page
cache for both). Ratios are incremental / full, per ABBA pair, then the median.

    PYTHONPATH=src python benchmarks/bench_incremental.py [--state-mib 256] [--saves 4]
        [--pairs 2] [--frozen 0.8] [--dir /tmp]     # --state-mib 1100: a >= 1 GiB state
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from snapkeep import Checkpointer

MIB = 1 << 20
WIDTH = 2048  # each layer is WIDTH x WIDTH float32 = 16 MiB


def build(state_mib: int, frozen: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """A stack of 16 MiB linear layers whose parameters + AdamW state are about ``state_mib``;
    the first ``frozen`` share of the layers is frozen. Returns the model, the optimizer and
    the bytes of the trainable parameters plus their optimizer state."""
    layer_mib = WIDTH * WIDTH * 4 // MIB
    # state = frozen params + 3 x trainable params (AdamW: exp_avg, exp_avg_sq)
    params_mib = state_mib / (frozen + 3 * (1 - frozen))
    layers = max(2, round(params_mib / layer_mib))
    n_frozen = min(layers - 1, round(layers * frozen))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(layers)])
    for layer in list(model)[:n_frozen]:
        layer.weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-4)
    return model, optim, 3 * sum(p.numel() * p.element_size() for p in trainable)


def step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(1, WIDTH)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def run(directory: pathlib.Path, *, incremental: bool, state_mib: int, frozen: float,
        saves: int) -> dict[str, Any]:
    model, optim, changing = build(state_mib, frozen)
    state = {"model": model, "optim": optim}
    stalls, durables, written = [], [], []
    with Checkpointer(directory, keep=2, incremental=incremental, rng=False) as ckpt:
        for i in range(1, saves + 1):
            step(model, optim)
            start = time.perf_counter()
            handle = ckpt.save(i, state)
            stalls.append(time.perf_counter() - start)
            record = handle.wait()
            durables.append(time.perf_counter() - start)
            written.append(record.size_bytes + record.blob_bytes)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + \
        sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values()
            if isinstance(v, torch.Tensor))
    fresh, fresh_optim, _ = build(state_mib, frozen)
    start = time.perf_counter()
    with Checkpointer(directory, incremental=incremental) as ckpt:
        assert ckpt.load({"model": fresh, "optim": fresh_optim}) == saves
    resume = time.perf_counter() - start
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values()))
    return {"stall": statistics.median(stalls[1:]), "durable": statistics.median(durables[1:]),
            "bytes": statistics.median(written[1:]), "first": written[0], "resume": resume,
            "changing": changing, "total": total}


def workload(name: str, root: pathlib.Path, *, state_mib: int, frozen: float, saves: int,
             pairs: int) -> list[dict[str, Any]]:
    rows = []
    for pair in range(pairs):
        order = (False, True, True, False) if pair % 2 == 0 else (True, False, False, True)
        results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for i, incremental in enumerate(order):
            directory = root / f"{name}-{pair}-{i}"
            results[incremental].append(run(directory, incremental=incremental,
                                            state_mib=state_mib, frozen=frozen, saves=saves))
            shutil.rmtree(directory)
        for full, inc in zip(results[False], results[True]):
            rows.append({"full": full, "inc": inc})
    return rows


def median_ratio(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r["inc"][key] / r["full"][key] for r in rows)


def report(name: str, rows: list[dict[str, Any]]) -> None:
    def med(which: str, key: str) -> float:
        return statistics.median(r[which][key] for r in rows)

    total, changing = rows[0]["full"]["total"], rows[0]["full"]["changing"]
    print(f"\n{name}: state {total / MIB:.0f} MiB, trainable parameters + AdamW state "
          f"{changing / MIB:.0f} MiB, {len(rows)} ABBA pairs")
    print(f"{'':28s} {'full':>10s} {'incremental':>12s} {'ratio':>7s}")
    lines = [("bytes per save after 1st, MiB", "bytes", MIB),
             ("first save, MiB", "first", MIB), ("stall (save call), s", "stall", 1),
             ("time to durable, s", "durable", 1), ("resume (load), s", "resume", 1)]
    for label, key, unit in lines:
        print(f"{label:28s} {med('full', key) / unit:10.3f} {med('inc', key) / unit:12.3f} "
              f"{median_ratio(rows, key):7.3f}")
    print(f"{'bytes / (trainable + optim)':28s} {med('full', 'bytes') / changing:10.3f} "
          f"{med('inc', 'bytes') / changing:12.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--frozen", type=float, default=0.8)
    parser.add_argument("--dir", default=None, help="where the runs write (default: a temp "
                        "directory on the default temp filesystem)")
    parser.add_argument("--skip-full-finetune", action="store_true")
    parser.add_argument("--skip-frozen", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="snapkeep-bench-incremental-",
                                     dir=args.dir) as tmp:
        root = pathlib.Path(tmp)
        if not args.skip_frozen:
            frozen = workload("frozen", root, state_mib=args.state_mib, frozen=args.frozen,
                              saves=args.saves, pairs=args.pairs)
            report(f"frozen backbone ({args.frozen:.0%} of parameters frozen)", frozen)
        if not args.skip_full_finetune:
            full = workload("finetune", root, state_mib=args.state_mib, frozen=0.0,
                            saves=args.saves, pairs=args.pairs)
            report("full fine-tune (nothing frozen)", full)
    return 0


if __name__ == "__main__":
    sys.exit(main())
