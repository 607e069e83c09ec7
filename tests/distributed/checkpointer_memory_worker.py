"""The worker of test_checkpointer_memory_kill.py:
``checkpointer_memory_worker.py BASE ITERS KILL_AT``.

A plain loop saved by ``snapkeep.Checkpointer(BASE/ckpt, keep=2, every=4,
memory=MemoryTier(every=2, replicas=1, root=BASE/shm))``: an MLP with dropout, Adam, a StepLR
scheduler and a StatefulDataLoader. In one process (``python``) the model is plain; under
``torchrun`` (WORLD_SIZE > 1, gloo) it is sharded with FSDP2 ``fully_shard`` and each rank has
its own data and dropout stream. Storage reads of the snapshot files present at start are
recorded (``support.storage_reads``) across ``load``. With KILL_AT > 0, once the RAM snapshot of
step KILL_AT is committed (and copied to the peer) on every rank, the last rank SIGKILLs itself
and the others wait in a barrier until the job dies. At the end rank 0 writes
``BASE/final.pt`` (full parameters, Adam state, scheduler, RNG) and every rank
``BASE/report<r>.json`` (the step resumed at, the storage reads of ``load``).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

import snapkeep
from support.storage_reads import StorageReads


def main() -> None:
    base, iters, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 4))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 4))
    part = torch.utils.data.Subset(data, range(rank, len(data), world))
    loader = StatefulDataLoader(part, batch_size=4, shuffle=True)
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    out = os.path.join(base, "ckpt")
    reads = StorageReads(out) if os.path.isdir(out) else None
    memory = snapkeep.MemoryTier(every=2, replicas=1, root=os.path.join(base, "shm"),
                                 timeout_s=60)
    with snapkeep.Checkpointer(out, keep=2, every=4, memory=memory, timeout_s=60) as ckpt:
        step = ckpt.load(into=state) or 0
        if reads is not None:
            reads.recording = False
        with open(os.path.join(base, f"report{rank}.json"), "w") as f:
            json.dump({"resumed": step, "reads": [] if reads is None else reads.reads}, f)
        while step < iters:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                step += 1
                ckpt.save(step, state)
                print("step", step, flush=True)
                if step == kill_at:
                    ckpt.wait()  # the RAM snapshot of this step committed and copied
                    if world > 1:
                        dist.barrier()
                    if rank == world - 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                    dist.barrier()  # the others wait here until the job dies
                if step == iters:
                    break
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        params, optim = get_state_dict(model, optimizer, options=options)
    else:
        params, optim = model.state_dict(), optimizer.state_dict()
    if rank == 0:
        torch.save({"params": params, "optim": optim, "scheduler": scheduler.state_dict(),
                    "rng": torch.get_rng_state()}, os.path.join(base, "final.pt"))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
