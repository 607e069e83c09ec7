"""One torchrun rank of test_sampler_epoch_torchrun.py: the plain-loop page's torchrun loop
(a StatefulDataLoader with a DistributedSampler, ``sampler.set_epoch(epoch)`` at each epoch,
``snapkeep.Checkpointer`` sharded under torch.distributed).

Usage: ``torchrun ... epoch_worker.py OUT_DIR REPORT_DIR ITERS``. Prints ``step N`` after each
step (rank 0); at the end each rank writes ``REPORT_DIR/final_rank<r>.pt``: its weights and the
sample indices it was fed at each step after the resume.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import snapkeep
from support.ranks import say


def main() -> None:
    out_dir, report_dir, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = TensorDataset(torch.arange(48, dtype=torch.float32))
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)  # 24 samples a rank
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler)  # 6 batches an epoch
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    fed: dict[int, list[int]] = {}
    pause_at = int(os.environ.get("PAUSE_AT", "-1"))
    with snapkeep.Checkpointer(out_dir, keep=2, every=2) as ckpt:
        step = ckpt.load(into=state) or 0
        while step < iters:
            sampler.set_epoch(step // len(loader))  # the docs' loop: the epoch it is in
            for (x,) in loader:
                loss = (model(x[:, None]) - x[:, None]).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                for p in model.parameters():  # as DDP: one model on every rank
                    dist.all_reduce(p.grad)
                optimizer.step()
                step += 1
                fed[step] = [int(i) for i in x.tolist()]
                ckpt.save(step, state)
                if step == pause_at:  # step 8's snapshot committed before the line says so
                    ckpt.wait()
                if rank == 0:
                    say("step", step)
                if step == pause_at:  # the test kills the job here: nothing saved after it
                    deadline = time.monotonic() + 300
                    while time.monotonic() < deadline:
                        time.sleep(0.1)
                if step == iters:
                    break
    torch.save({"weight": model.weight.detach(), "bias": model.bias.detach(), "fed": fed},
               os.path.join(report_dir, f"final_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
