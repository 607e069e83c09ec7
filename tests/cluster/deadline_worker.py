"""A plain loop with ``snapkeep.Checkpointer(OUT, every=4, memory=..., preemption=True)`` on a
really slow storage (run by test_preemption_deadline.py and benchmarks' trial script).

Usage: ``python deadline_worker.py OUT_DIR TIER_ROOT STEPS``. Environment: ``PAUSE_AT``
(after that step, print ``paused N rank R pid P`` and wait for a line on stdin, or for the file
``GO_FILE`` when set, so a test signals it there), ``EVERY`` (storage interval, default 4),
``STEP_SLEEP_S`` (a sleep after each step),
``SLOW_BPS`` (bytes per second of the storage; unset: local files), ``SNAPKEEP_GRACE_S``
(snapkeep's), and under torchrun ``RANK``/``WORLD_SIZE`` (gloo; sharded snapshots: local
files). Prints ``resumed at N``, ``step N``, ``committed N`` once a durable save is committed
before the pause, and at the end ``final <repr of the parameters' sum>``; saves ``final.pt``
(rank 0) beside OUT_DIR.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import snapkeep
from snapkeep.writing import ThreadWriter
from support.ranks import say


def main() -> None:
    out_dir, tier_root, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    pause_at = int(os.environ.get("PAUSE_AT", "-1"))
    slow = os.environ.get("SLOW_BPS")
    writer = None
    if slow:
        from support.slow_storage import SlowPfio

        writer = ThreadWriter(fs=SlowPfio(float(slow)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Dropout(0.2),
                                torch.nn.Linear(256, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.randn(64, 256)
    state = {"model": model, "optimizer": optimizer}
    memory = snapkeep.MemoryTier(every=4, replicas=1 if world_size > 1 else 0, root=tier_root,
                                 timeout_s=60)
    every = int(os.environ.get("EVERY", "4"))
    step_sleep_s = float(os.environ.get("STEP_SLEEP_S", "0"))
    with snapkeep.Checkpointer(out_dir, every=every, preemption=True, timeout_s=60,
                               writer=writer, memory=memory) as ckpt:
        step = ckpt.load(into=state) or 0
        say("resumed at", step)
        while step < steps:
            optimizer.zero_grad()
            model(data[step % 56:step % 56 + 8]).pow(2).mean().backward()
            optimizer.step()
            step += 1
            handle = ckpt.save(step, state)
            say("step", step)
            if step_sleep_s:
                time.sleep(step_sleep_s)  # a slower step: launchers' signals land mid-training
            if step == pause_at:
                if handle is not None or step > every:
                    ckpt.wait()  # a durable save measured before the signal
                    say("committed", step - step % every)
                rank = int(os.environ.get("RANK", "0"))
                say("paused", step, "rank", rank, "pid", os.getpid())
                go = os.environ.get("GO_FILE")  # the test signals a rank, then lets them go on
                if go:
                    deadline = time.monotonic() + 120
                    while not os.path.exists(go) and time.monotonic() < deadline:
                        time.sleep(0.05)
                else:
                    sys.stdin.readline()
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    say("final", repr(total))
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()},
                   os.path.join(os.path.dirname(os.path.abspath(out_dir)), "final.pt"))
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
