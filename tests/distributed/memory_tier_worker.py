"""One rank of test_memory_tier_distributed.py: DISTRIBUTED snapshots (saver rank 0) to a shared
storage directory every 3 iterations, and the memory tier every 2 iterations with peer copies.

Usage: ``python memory_tier_worker.py RANK WORLD_SIZE INIT_FILE BASE PHASE REPLICAS``.

Each rank's node RAM is ``BASE/node<RANK>`` (a directory per simulated node); storage is
``BASE/storage``. Phases:

- ``train``: train to iteration 5 (RAM at 2 and 4, storage at 3), wait for the peer copies,
  then every rank SIGKILLs itself (no finalize: the tiers stay).
- ``resume``: start again (an audit hook records every snapshot data file of storage opened for
  reading during the start: single-file snapshots, so every byte of saved state), train to 8,
  finalize; write ``BASE/report_rank<RANK>.json``.
- ``missing``: rank 1 exits before the recovery agreement; rank 0 reports how its start ended.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

TEMPLATE = "snapshot_iter_{.iteration}"
UNTIL = 8


def build(base: str, rank: int, replicas: int) -> tuple[ExtensionsManager, torch.nn.Module, Any]:
    torch.manual_seed(0)  # replicated state, as under DDP
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = os.path.join(base, "storage")
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=UNTIL, out_dir=out,
                                writer=writing.SimpleWriter(out_dir=out))
    manager.extend(ext.snapshot(filename=TEMPLATE, saver_rank=0, autoload=True, timeout_s=60),
                   trigger=(3, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=2, replicas=replicas, stride=1, job="test",
                                          root=os.path.join(base, f"node{rank}"),
                                          timeout_s=60))
    manager.extend(tier)
    return manager, model, tier


def step(manager: ExtensionsManager, model: torch.nn.Module) -> None:
    optimizer = manager.optimizers["main"]
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(manager.iteration))
    with manager.run_iteration():
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()


def reference() -> list[float]:
    """The weights of an uninterrupted run (no snapshots), for comparison."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for iteration in range(UNTIL):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(iteration))
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()
    return model.weight.detach().flatten().tolist()


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, base, phase, replicas = sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    storage = os.path.join(base, "storage")
    reads: list[str] = []
    recording = [phase == "resume"]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not recording[0] or not isinstance(args[0], str):
            return
        path, mode, flags = args
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and flags & (os.O_WRONLY | os.O_RDWR))
        if path.startswith(storage) and os.path.basename(path).startswith("snapshot_iter_") \
                and "/.snapkeep/" not in path and not writes:  # data, not manifest/lock/dir
            reads.append(path)

    sys.addaudithook(hook)
    if phase == "missing":  # rank 1 dies before the recovery agreement; rank 0 must not hang
        from snapkeep.distributed import background_groups

        background_groups(60)  # the tier's groups (a collective: every rank creates them)
        if rank == 1:
            os._exit(0)
        manager, model, tier = build(base, rank, replicas)
        began = time.monotonic()
        try:
            manager.start_extensions()
            outcome = "resumed"
        except Exception as e:
            outcome = type(e).__name__
        with open(os.path.join(base, f"report_rank{rank}.json"), "w") as f:
            json.dump({"outcome": outcome, "elapsed_s": time.monotonic() - began}, f)
        os._exit(0)
    manager, model, tier = build(base, rank, replicas)
    manager.start_extensions()
    recording[0] = False
    start = manager.iteration
    if phase == "train":
        while manager.iteration < 5:
            step(manager, model)
        tier.wait()
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    persisted = sorted(n for n in os.listdir(storage) if n.startswith("snapshot_"))
    while manager.iteration < UNTIL:
        step(manager, model)
    manager.finalize()
    restored = tier.restored
    report = {"start": start, "storage_reads": reads, "persisted": persisted,
              "source": restored.source if restored else None,
              "weights": model.weight.detach().flatten().tolist(),
              "tier_left": os.listdir(os.path.join(base, f"node{rank}"))}
    with open(os.path.join(base, f"report_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
