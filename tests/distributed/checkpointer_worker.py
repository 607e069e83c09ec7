"""One rank of the sharded Checkpointer test (run by test_checkpointer_sharded.py).

Usage: ``python checkpointer_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR REPORT_DIR ITERS``.

A plain loop: an MLP with dropout sharded with FSDP2 ``fully_shard`` (CPU, gloo), Adam, a StepLR
scheduler, a StatefulDataLoader over this rank's part of the data and this rank's own random
stream (dropout), saved by ``snapkeep.Checkpointer(OUT_DIR, keep=2, every=2)`` (sharded: under
torch.distributed) and resumed from it. Prints ``step N`` after each step; at the end rank 0
writes the full parameters and Adam moments to ``REPORT_DIR/final.pt``. With ITERS 0 it only
opens the Checkpointer and prints ``opened`` or the error's type.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader

import snapkeep


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, report_dir, iters = sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    if iters == 0:
        try:
            snapkeep.Checkpointer(out_dir, timeout_s=60).close()
            print("opened", flush=True)
        except Exception as e:  # the test reads which error each rank got
            print("refused:", type(e).__name__, flush=True)
        dist.destroy_process_group()
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 4))
    part = torch.utils.data.Subset(data, range(rank, len(data), world_size))
    loader = StatefulDataLoader(part, batch_size=4, shuffle=True)
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    with snapkeep.Checkpointer(out_dir, keep=2, every=2) as ckpt:
        step = ckpt.load(into=state) or 0
        print("resumed at", step, flush=True)
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
                if step == iters:
                    break
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer, options=options)
    if rank == 0:
        torch.save({"params": msd, "optim": osd, "scheduler": scheduler.state_dict(),
                    "rng": torch.get_rng_state()}, os.path.join(report_dir, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
