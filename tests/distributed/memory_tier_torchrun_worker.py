"""The worker of test_memory_tier_torchrun.py, started by ``torchrun --standalone`` with the same
command every time: ``memory_tier_torchrun_worker.py BASE``.

A replicated ``Linear`` with SGD (momentum), storage snapshots every 3 iterations into
``BASE/storage``, the memory tier every 2 into ``BASE/shm`` with its default job name. The first
launch (no ``BASE/killed`` yet) trains to iteration 5, waits for its RAM snapshot (step 4),
records its ``TORCHELASTIC_RUN_ID`` and the tiers under the root, and SIGKILLs itself. A later
launch resumes, trains to 8, finalizes and writes ``BASE/report.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

TEMPLATE = "snapshot_iter_{.iteration}"
UNTIL = 8


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, iteration: int) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(iteration))
    optimizer.zero_grad()
    model(x).pow(2).sum().backward()
    optimizer.step()


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    base = sys.argv[1]
    dist.init_process_group("gloo")
    out, root = os.path.join(base, "storage"), os.path.join(base, "shm")
    model, optimizer = build()
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=UNTIL, out_dir=out,
                                writer=writing.SimpleWriter(out_dir=out))
    manager.extend(ext.snapshot(filename=TEMPLATE, saver_rank=0, autoload=True, timeout_s=60),
                   trigger=(3, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=2, replicas=0, root=root, timeout_s=60))
    manager.extend(tier)
    manager.start_extensions()
    start = manager.iteration
    first = not os.path.exists(os.path.join(base, "killed"))
    while manager.iteration < (5 if first else UNTIL):
        with manager.run_iteration():
            train(model, optimizer, manager.iteration)
    if first:
        tier.wait()
        with open(os.path.join(base, "killed"), "w") as f:
            json.dump({"run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                       "tiers": sorted(os.listdir(root))}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    restored = tier.restored
    manager.finalize()
    with open(os.path.join(base, "report.json"), "w") as f:
        json.dump({"start": start, "source": restored.source if restored else None,
                   "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                   "weights": [p.detach().flatten().tolist() for p in model.parameters()],
                   "tiers_left": sorted(os.listdir(root))}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
