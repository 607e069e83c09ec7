"""A plain loop with ``snapkeep.Checkpointer(OUT_DIR, every=4, preemption=True)`` (run by
test_checkpointer_preemption.py).

Usage: ``python checkpointer_preemption_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR STEPS``.
WORLD_SIZE 1 runs without torch.distributed (single-file snapshots); more ranks run under gloo
(sharded snapshots). Prints ``resumed at N``, ``step N`` after each step (each rank), waits for
a line on stdin after the step named by the environment variable ``PAUSE_AT`` (so a test can
signal it there), and at the end ``final <sum of the parameters, repr>``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import snapkeep


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, steps = sys.argv[3], sys.argv[4], int(sys.argv[5])
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
    pause_at = int(os.environ.get("PAUSE_AT", "-1"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.randn(64, 4)
    state = {"model": model, "optimizer": optimizer}
    with snapkeep.Checkpointer(out_dir, every=4, preemption=True, timeout_s=60) as ckpt:
        step = ckpt.load(into=state) or 0
        print("resumed at", step, flush=True)
        while step < steps:
            optimizer.zero_grad()
            model(data[step % 64:step % 64 + 8]).pow(2).mean().backward()
            optimizer.step()
            step += 1
            ckpt.save(step, state)
            print("step", step, flush=True)
            if step == pause_at:
                sys.stdin.readline()  # the test signals this process, then lets it go on
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    print("final", repr(total), flush=True)
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
