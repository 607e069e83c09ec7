"""One torchrun rank for test_run_status.py: ``snapshot(saver_rank=0)`` with
``extensions.preemption`` on gloo, trained until ITERATIONS or a signal.

Usage: ``torchrun ... status_worker.py OUT_DIR READY_FILE ITERATIONS``; rank 0 writes READY_FILE
after iteration 3.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def main() -> None:
    out_dir, ready, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, iterations, iters_per_epoch=100,
                                out_dir=out_dir, writer=writing.SimpleWriter(out_dir=out_dir),
                                stop_trigger=(iterations, "iteration"))
    manager.extend(ext.snapshot(saver_rank=0, autoload=True, timeout_s=60),
                   trigger=(iterations, "iteration"))
    manager.extend(ext.preemption(timeout_s=60))
    data = torch.Generator().manual_seed(1)
    while not manager.stop_trigger:
        with manager.run_iteration():
            model(torch.randn(2, 4, generator=data)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if manager.iteration == 3 and dist.get_rank() == 0:
            with open(ready, "w") as f:
                f.write("ready")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
