"""One rank of test_memory_tier_distributed.py: snapshots to a shared storage directory every 3
iterations, and the memory tier every 2 iterations with peer copies.

Usage: ``python memory_tier_worker.py RANK WORLD_SIZE INIT_FILE BASE PHASE REPLICAS [KIND]``.

KIND ``distributed`` (default): a replicated ``Linear`` with SGD, DISTRIBUTED snapshots (saver
rank 0). KIND ``distributed-lent``: the same with a ``ThreadWriter`` and storage every 2
iterations, so that rank 0's tier borrows the writer's staged copy at steps 2 and 4 (no second
staging; the train phase records in ``BASE/train_rank<RANK>.json`` whether the tier staged a
copy of its own). KIND ``sharded``: an MLP sharded with FSDP2 ``fully_shard`` with Adam, SHARDED
snapshots (every rank its shards; the RAM snapshots hold each rank's local shards).

Each rank's node RAM is ``BASE/node<RANK>`` (a directory per simulated node); storage is
``BASE/storage``. Phases:

- ``train``: train to iteration 5 (RAM at 2 and 4, storage at 3), wait for the peer copies,
  then every rank SIGKILLs itself (no finalize: the tiers stay).
- ``resume``: start again (an audit hook records every snapshot data file of storage opened for
  reading during the start: single-file snapshots, or a sharded directory's ``.distcp`` and
  ``.metadata`` files, so every byte of saved state), train to 8, finalize; write
  ``BASE/report_rank<RANK>.json`` (with the full weights, gathered under FSDP2).
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
from support.storage_reads import StorageReads

TEMPLATE = "snapshot_iter_{.iteration}"
UNTIL = 8


def _model(kind: str, world: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank
    if kind.startswith("distributed"):
        return torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind.startswith("distributed"):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def build(base: str, rank: int, replicas: int, kind: str = "distributed", world: int = 1
          ) -> tuple[ExtensionsManager, torch.nn.Module, Any, Any]:
    model = _model(kind, world)
    optimizer = _optimizer(kind, model)
    out = os.path.join(base, "storage")
    writer: writing.Writer = (writing.ThreadWriter(out_dir=out, timeout_s=60)
                              if kind == "distributed-lent" else writing.SimpleWriter(out_dir=out))
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=UNTIL, out_dir=out,
                                writer=writer)
    if kind.startswith("distributed"):
        snapshot = ext.snapshot(filename=TEMPLATE, saver_rank=0, autoload=True, timeout_s=60)
    else:
        snapshot = ext.snapshot(filename=TEMPLATE, snapshot_mode=ext.SnapshotMode.SHARDED,
                                autoload=True, timeout_s=60)
    manager.extend(snapshot, trigger=(2 if kind == "distributed-lent" else 3, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=2, replicas=replicas, stride=1, job="test",
                                          root=os.path.join(base, f"node{rank}"),
                                          timeout_s=60))
    manager.extend(tier)
    return manager, model, tier, snapshot


def step(manager: ExtensionsManager, model: torch.nn.Module) -> None:
    optimizer = manager.optimizers["main"]
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(manager.iteration))
    with manager.run_iteration():
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()


def full_weights(model: torch.nn.Module) -> list[float]:
    """Every parameter, whole (a DTensor's shards gathered: collective under FSDP2)."""
    values: list[float] = []
    for param in model.parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        values += full.detach().flatten().tolist()
    return values


def reference(kind: str = "distributed") -> list[float]:
    """The weights of an uninterrupted run (no snapshots, one process), for comparison."""
    model = _model(kind, 1)
    optimizer = _optimizer(kind, model)
    for iteration in range(UNTIL):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(iteration))
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()
    return full_weights(model)


def _is_state(path: str) -> bool:
    """A snapshot file or a sharded directory's DCP files, not a manifest/marker/lock."""
    name = os.path.basename(path)
    return (name.startswith("snapshot_iter_") or name.endswith(".distcp")
            or name == ".metadata") and "/.snapkeep/" not in path


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, base, phase, replicas = sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
    kind = sys.argv[7] if len(sys.argv) > 7 else "distributed"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    storage = os.path.join(base, "storage")
    storage_reads = StorageReads(storage, recording=phase == "resume", is_state=_is_state)
    if phase == "missing":  # rank 1 dies before the recovery agreement; rank 0 must not hang
        from snapkeep.distributed import background_groups

        background_groups(60)  # the tier's groups (a collective: every rank creates them)
        ready = os.path.join(base, "groups_ready_rank0")
        if rank == 1:  # only once rank 0's groups exist: under load, rank 1 returned first and
            deadline = time.monotonic() + 60  # its exit broke rank 0's connectFullMesh (2 in 10)
            while not os.path.exists(ready) and time.monotonic() < deadline:
                time.sleep(0.01)
            os._exit(0)
        with open(ready, "w"):
            pass
        manager, model, tier, snapshot = build(base, rank, replicas, kind, world)
        began = time.monotonic()
        try:
            manager.start_extensions()
            outcome = "resumed"
        except Exception as e:
            outcome = type(e).__name__
        with open(os.path.join(base, f"report_rank{rank}.json"), "w") as f:
            json.dump({"outcome": outcome, "elapsed_s": time.monotonic() - began}, f)
        os._exit(0)
    manager, model, tier, snapshot = build(base, rank, replicas, kind, world)
    timed = tier.initialize  # the tier's recovery alone (without persisting to storage)
    tier_s = [0.0]

    def initialize(manager: ExtensionsManager) -> None:
        began = time.perf_counter()
        timed(manager)  # recovers at the first call (before the snapshot's autoload), once
        tier_s[0] = max(tier_s[0], time.perf_counter() - began)

    tier.initialize = initialize
    began = time.perf_counter()
    manager.start_extensions()
    resume_s = time.perf_counter() - began
    storage_reads.recording = False
    start = manager.iteration
    if phase == "train":
        while manager.iteration < 5:
            step(manager, model)
        tier.wait()
        if kind == "sharded":
            snapshot.wait()  # storage's step 3 committed (a background commit)
        manager.writer.wait()  # a ThreadWriter's commit of step 4 (distributed-lent)
        with open(os.path.join(base, f"train_rank{rank}.json"), "w") as f:
            json.dump({"tier_staged_own": tier.engine._buffers is not None}, f)
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    persisted = sorted(n for n in os.listdir(storage) if n.startswith("snapshot_"))
    while manager.iteration < UNTIL:
        step(manager, model)
    manager.finalize()
    restored = tier.restored
    report = {"start": start, "storage_reads": storage_reads.reads, "persisted": persisted,
              "resume_s": resume_s, "tier_s": tier_s[0],
              "source": restored.source if restored else None,
              "weights": full_weights(model),
              "tier_left": os.listdir(os.path.join(base, f"node{rank}"))}
    with open(os.path.join(base, f"report_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
