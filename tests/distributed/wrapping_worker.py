"""One rank of test_wrapping_sharded.py: a SHARDED snapshot saved from a model in one wrapping
and resumed into another, FSDP2 among them.

Usage: ``python wrapping_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR REPORT_FILE MODE WRAPPING``.
WRAPPING: ``fsdp2`` (``fully_shard`` on every layer and the root), ``compiled_ddp``
(``torch.compile(DDP(net), backend='eager')``). MODE ``save``: 2 iterations of Adam, a snapshot
each; ``load``: a differently seeded model autoloads. Rank 0 writes the full (unsharded)
parameters and Adam moments, keyed by canonical name, to REPORT_FILE (``torch.save``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, report, mode, wrapping = sys.argv[3:8]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    torch.manual_seed(0 if mode == "save" else 7)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model: torch.nn.Module = net
    if wrapping == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    else:
        model = torch.compile(torch.nn.parallel.DistributedDataParallel(net), backend="eager")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = ExtensionsManager({"main": model}, {"main": optimizer}, 1, iters_per_epoch=100,
                                out_dir=out_dir, writer=writing.SimpleWriter(out_dir=out_dir))
    snapshot = ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, autoload=True,
                            timeout_s=60, quiet=True)
    manager.extend(snapshot, trigger=(1, "iteration"))
    manager.start_extensions()
    data = torch.Generator().manual_seed(3)
    iterations = 2 if mode == "save" else int(manager.iteration)
    while manager.iteration < iterations:
        with manager.run_iteration():
            net(torch.randn(4, 4, generator=data)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    manager.finalize()
    msd, osd = get_state_dict(model, optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"loaded": snapshot.loaded_entry.name if snapshot.loaded_entry else None,
                    "iteration": manager.iteration,
                    "params": {k: v.clone() for k, v in msd.items()},
                    "exp_avg": {k: v["exp_avg"].clone() for k, v in osd["state"].items()}},
                   report)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
