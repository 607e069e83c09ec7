"""One rank of test_sharded_overlap.py: overlapped sharded staging under FSDP2.

Usage: ``python sharded_overlap_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR REPORT_DIR MODE``.

The model is two ``Linear(1024, 1024)`` layers sharded with ``fully_shard`` (each weight's local
shard 4 MiB / WORLD_SIZE, above the 1 MiB a deferred copy needs) and Adam.

MODE ``saver``: :class:`ShardedSaver` with ``overlap`` and a :class:`StagingGuard` on the
optimizer. Snapshot 1: saved, one training step (its pre-hook validates the copy), committed;
then loaded into a zeroed copy of the state and compared with the local shards cloned at the
call. Snapshot 2: saved, then rank 1 (only) adds 1 to a weight in place before any safe point;
both ranks ``wait``. Snapshot 3: saved, one step, committed. Reports
``REPORT_DIR/saver_rank<R>.json``.

MODE ``train``: an ExtensionsManager with ``snapshot(snapshot_mode=SHARDED, autoload=True)``
every iteration (overlap on: the default), 4 iterations; reports how many saves deferred a
copy and ``REPORT_DIR/full_rank<R>.pt`` (the full parameters and moments after iteration 4).
MODE ``resume``: a differently initialised model autoloads; reports the same file as
``resumed_rank<R>.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep._core.distributed import staging as sharded_staging
from snapkeep._core.distributed.sharded import ShardedJob, ShardedSaver, load_sharded
from snapkeep._core.distributed.sharded_store import ShardedStore
from snapkeep._core.storage import resolve_storage
from snapkeep.errors import StagingRaceError
from snapkeep.staging import StagingGuard, owned_storages
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def build(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 1024)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"models": {"main": msd}, "optimizers": {"main": osd}}


def locals_of(tree: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of ``tree`` (a DTensor's local shard), cloned, by dotted path."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: v for key, value in tree.items()
                for k, v in locals_of(value, f"{path}.{key}").items()}
    if isinstance(tree, DTensor):
        return {path: tree.to_local().detach().clone()}
    if isinstance(tree, torch.Tensor):
        return {path: tree.detach().clone()}
    return {}


def zeroed(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: zeroed(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return tree


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {"params": {k: v.detach().clone() for k, v in msd.items()},
            "exp_avg": {k: v["exp_avg"].clone() for k, v in osd["state"].items()}}


def saver_mode(rank: int, world_size: int, out_dir: str, report: dict[str, Any]) -> None:
    model, optimizer = build(0, world_size)
    step(model, optimizer)  # Adam's state exists
    storage, directory = resolve_storage(out_dir)
    store = ShardedStore(storage, directory, "snap_{step}")
    saver = ShardedSaver(store, None if world_size == 1 else _groups())
    guard = StagingGuard()
    guard.guard([optimizer])
    guard.track(saver)
    owned = frozenset(owned_storages([optimizer]))

    at_call = locals_of(state(model, optimizer))
    handle = saver.save(state(model, optimizer), ShardedJob(name="snap_1", step=1), overlap=owned)
    report["deferred_until_a_safe_point"] = not handle.staged.done()
    step(model, optimizer)  # the pre-hook waits for the copy and validates it
    report["validated_at_the_step"] = handle.staged.done() and handle.staged.exception() is None
    saver.wait()
    into = zeroed(state(model, optimizer))
    load_sharded(store, store.entries()[-1], into, groups=saver.groups)
    loaded = locals_of(into)
    report["snapshot_1_keys"] = len(loaded)
    report["snapshot_1_mismatches"] = sorted(k for k in at_call
                                             if not torch.equal(loaded[k], at_call[k]))
    report["moved_since"] = sorted(k for k in at_call if not torch.equal(
        locals_of(state(model, optimizer))[k], at_call[k]))

    saver.save(state(model, optimizer), ShardedJob(name="snap_2", step=2), overlap=owned)
    if rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)  # in place, before any safe point
    try:
        saver.wait()
        report["race"] = None
    except StagingRaceError as e:
        report["race"] = str(e)
    saver.save(state(model, optimizer), ShardedJob(name="snap_3", step=3), overlap=owned)
    step(model, optimizer)
    saver.close()
    report["committed"] = [entry.name for entry in store.entries()]
    report["snap_2_marker"] = os.path.exists(os.path.join(out_dir, "snap_2",
                                                          ".snapkeep-commit.json"))


def _groups() -> Any:
    from snapkeep._core.distributed.groups import background_groups

    return background_groups(120)


def manager_mode(rank: int, world_size: int, out_dir: str, report_dir: str, mode: str,
                 report: dict[str, Any]) -> None:
    model, optimizer = build(0 if mode == "train" else 50 + rank, world_size)
    manager = ExtensionsManager(model, optimizer, 1000, iters_per_epoch=100, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    snapshot = ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, autoload=True, timeout_s=120)
    manager.extend(snapshot, trigger=(1, "iteration"))
    deferred = []
    stage = sharded_staging.Stager.stage

    def counting(self: Any, tree: Any, owned: Any, **kwargs: Any) -> Any:
        staged, copies = stage(self, tree, owned, **kwargs)
        deferred.append(0 if copies is None else copies.nbytes)
        return staged, copies

    sharded_staging.Stager.stage = counting  # type: ignore[method-assign]
    manager.start_extensions()
    torch.manual_seed(1000 + rank)
    if mode == "train":
        while manager.iteration < 4:
            with manager.run_iteration():
                step(model, optimizer)
    manager.finalize()
    report["deferred_bytes"] = deferred
    report["loaded"] = snapshot.loaded_entry.name if snapshot.loaded_entry else None
    name = "full" if mode == "train" else "resumed"
    torch.save(full_state(model, optimizer), os.path.join(report_dir, f"{name}_rank{rank}.pt"))


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, report_dir, mode = sys.argv[3:7]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    report: dict[str, Any] = {"rank": rank}
    if mode == "saver":
        saver_mode(rank, world_size, out_dir, report)
    else:
        manager_mode(rank, world_size, out_dir, report_dir, mode, report)
    with open(os.path.join(report_dir, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
