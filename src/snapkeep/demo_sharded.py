"""The demo at scale: the digits MLP of :mod:`snapkeep.demo`, sharded with FSDP2 on gloo,
snapshotted with ``snapshot_mode=SHARDED`` and preemptible.

    torchrun --nproc-per-node 2 -m snapkeep.demo_sharded --out result/demo-sharded
    python -m snapkeep.demo_sharded ...            # one process (no torchrun) works too

Every rank holds a shard of the parameters and of Adam's moments (``fully_shard`` on each
linear layer and the root) and trains on its slice of each global batch (the global batch and
data order do not depend on the number of ranks). Every ``--snapshot-interval`` iterations each
rank writes its shards into ``snapshot_iter_<n>/``, committed by rank 0's marker once every
rank's files are durable.

- SIGKILL any rank (torchrun then stops the others): run the same command again; every rank
  resumes from the newest committed snapshot. A snapshot being written when the kill came has
  no marker and is never loaded.
- SIGTERM (or SIGUSR1) to any rank: all ranks snapshot the same iteration, wait until it is
  committed and exit with code 143 (:data:`snapkeep.training.extensions.EXIT_CODE_PREEMPTED`);
  run the command again to continue.
- Another ``--nproc-per-node`` on the rerun reshards the snapshot (saved on 2, resumed on 1 or 3).
- ``--memory-every K --replicas R`` turns the memory tier on: every K iterations each rank
  commits its local shards to node RAM (``--memory-root``, default ``/dev/shm``) and copies
  them to R peer ranks; a rerun after a kill resumes from RAM (its own, else a peer's) without
  reading storage when RAM is at least as new, and writes that step to storage first. A rerun
  on another number of ranks resumes from storage (resharded).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy
import torch
import torch.distributed as dist
import torch.nn.functional as F

import snapkeep
from snapkeep.demo import (
    MODEL_SIZES,
    LastLoss,
    ReachedIteration,
    SnapshotSchedule,
    augment,
    build_model,
    evaluate,
    load_digits_split,
)
from snapkeep.training import ExtensionsManager, extensions
from snapkeep.writing import SimpleWriter

logger = logging.getLogger(__name__)

TEMPLATE = "snapshot_iter_{.iteration}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardedDemoConfig:
    """Settings of one sharded demo run (the command-line options).

    Attributes:
        out_dir: shared directory for the snapshot directories.
        iterations: the run stops at this iteration.
        snapshot_interval: iterations between snapshots; one is also taken at ``iterations``.
        n_retains: snapshots kept (newest by step); <= 0 keeps all.
        hidden_size: width of the MLP's hidden layers.
        seed: model init, data order and augmentation seed.
        batch_size: global batch size (split between the ranks; a multiple of the world size).
        timeout_s: bound of snapkeep's collectives (seconds).
        lr: Adam learning rate.
        memory_every: commit each rank's shards to node RAM every this many iterations (the
            memory tier); 0: off.
        replicas: peer ranks holding a copy of each rank's RAM snapshot (less than the world
            size; with ``memory_every``).
        memory_root: the tmpfs directory of the memory tier.
    """

    out_dir: str = "result/demo-sharded"
    iterations: int = 300
    snapshot_interval: int = 50
    n_retains: int = 3
    hidden_size: int = MODEL_SIZES["small"]
    seed: int = 0
    batch_size: int = 60
    timeout_s: float = 120.0
    lr: float = 1e-3
    memory_every: int = 0
    replicas: int = 1
    memory_root: str = "/dev/shm"


def _shard(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run_sharded_demo(config: ShardedDemoConfig, echo: Callable[[str], None] = print
                     ) -> dict[str, Any]:
    """Train (or resume) on every rank of the current process group (or alone); rank 0 echoes
    progress. Returns rank 0's summary (iteration, loss, accuracy, resumed_from, world_size).

    Raises:
        SystemExit: 143 after a preemption snapshot (SIGTERM/SIGUSR1 on any rank).
        NoCommonSnapshotError: snapshots exist but none is readable by every rank.
        ValueError: ``batch_size`` is not a multiple of the world size.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    if config.batch_size % world_size:
        raise ValueError(f"batch_size must be a multiple of the world size {world_size}, got "
                         f"{config.batch_size}")

    def say(line: str) -> None:
        if rank == 0:
            echo(line)

    train_x, train_y, test_x, test_y = load_digits_split()
    random.seed(config.seed)
    numpy.random.seed(config.seed)
    torch.manual_seed(config.seed)  # the same initial parameters on every rank
    model = build_model(config.hidden_size)
    if distributed:
        model = _shard(model, world_size)
    torch.manual_seed(config.seed * 1000 + rank)  # each rank its own dropout/augmentation
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    # the global batch order, the same on every rank and for any number of ranks; each rank
    # takes its slice of each global batch
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(train_x, train_y), batch_size=config.batch_size,
        shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(config.seed))
    last_loss = LastLoss()
    writer = SimpleWriter(out_dir=config.out_dir)
    manager = ExtensionsManager(
        model, optimizer, max_epochs=1, iters_per_epoch=len(loader),
        out_dir=config.out_dir, writer=writer, stop_trigger=ReachedIteration(config.iterations),
        state_objects={"last_loss": last_loss})
    snapshot = extensions.snapshot(
        filename=TEMPLATE, snapshot_mode=extensions.SnapshotMode.SHARDED,
        n_retains=config.n_retains, autoload=True, timeout_s=config.timeout_s,
        loaders={"train": loader})
    manager.extend(snapshot, trigger=SnapshotSchedule(config.snapshot_interval,
                                                      config.iterations))
    manager.extend(extensions.preemption(timeout_s=config.timeout_s))
    tier = None
    if config.memory_every > 0:
        # the default job: named by the training (out_dir, template), found by every rerun
        tier = extensions.memory_tier(extensions.MemoryTier(
            every=config.memory_every, replicas=config.replicas if world_size > 1 else 0,
            root=config.memory_root, timeout_s=config.timeout_s))
        manager.extend(tier)
    say(f"snapkeep sharded demo: digits MLP hidden={config.hidden_size} on {world_size} "
        f"rank(s) (FSDP2 on gloo), out={config.out_dir}")
    start = time.perf_counter()
    manager.start_extensions()  # every rank agrees on the snapshot to resume, then loads it
    loaded = snapshot.loaded_entry
    first = manager.iteration
    restored = tier.restored if tier is not None else None
    if restored is not None:
        say(f"resumed from RAM (step {first}, rank 0's copy: {restored.source}; storage's "
            f"newest: {restored.storage_step}) on {world_size} rank(s) in "
            f"{time.perf_counter() - start:.2f} s")
    elif loaded is None:
        say(f"starting fresh; training {config.iterations} iterations")
    else:
        say(f"resumed from {loaded.name} (iteration {first}) on {world_size} rank(s) in "
            f"{time.perf_counter() - start:.2f} s")
    per_rank = config.batch_size // world_size
    try:
        while not manager.stop_trigger:
            for x, y in loader:
                with manager.run_iteration(step_optimizers=["main"]):
                    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:
                                                                       (rank + 1) * per_rank]
                    loss = F.cross_entropy(model(augment(x)), y)
                    snapkeep.report({"loss": loss})
                    loss.backward()
                    last_loss.value = float(loss.detach())
                if manager.iteration % config.snapshot_interval == 0:
                    accuracy, _ = evaluate(model, test_x, test_y)  # collective under FSDP2
                    say(f"iter {manager.iteration:>6}  loss {last_loss.value:.4f}  "
                        f"accuracy {accuracy:.4f}")
                if manager.stop_trigger:  # --iterations need not end an epoch
                    break
    finally:
        manager.finalize()
    accuracy, _ = evaluate(model, test_x, test_y)
    summary = {"iteration": manager.iteration, "loss": last_loss.value, "accuracy": accuracy,
               "resumed_from": loaded.name if loaded else None,
               "resumed_iteration": first if loaded or restored else None,
               "resumed_from_ram": restored.source if restored else None,
               "world_size": world_size}
    say(f"done: iteration {manager.iteration}, loss {last_loss.value:.4f}, accuracy "
        f"{accuracy:.4f}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m snapkeep.demo_sharded`` (under torchrun or alone)."""
    defaults = ShardedDemoConfig()
    parser = argparse.ArgumentParser(prog="python -m snapkeep.demo_sharded",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", default=defaults.out_dir, help="shared snapshot directory")
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument("--snapshot-interval", type=int, default=defaults.snapshot_interval)
    parser.add_argument("--n-retains", type=int, default=defaults.n_retains)
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="small")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s)
    parser.add_argument("--memory-every", type=int, default=defaults.memory_every,
                        help="memory tier: commit each rank's shards to node RAM every K "
                             "iterations (0: off)")
    parser.add_argument("--replicas", type=int, default=defaults.replicas,
                        help="memory tier: peer ranks holding a copy of each rank's RAM snapshot")
    parser.add_argument("--memory-root", default=defaults.memory_root,
                        help="memory tier: the tmpfs directory (default /dev/shm)")
    args = parser.parse_args(argv)
    config = ShardedDemoConfig(
        out_dir=args.out, iterations=args.iterations, snapshot_interval=args.snapshot_interval,
        n_retains=args.n_retains, hidden_size=MODEL_SIZES[args.model_size], seed=args.seed,
        batch_size=args.batch_size, timeout_s=args.timeout_s, memory_every=args.memory_every,
        replicas=args.replicas, memory_root=args.memory_root)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    try:
        run_sharded_demo(config)
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
