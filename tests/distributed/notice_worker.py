"""A training script for the resume-notice tests (test_resume_notice.py): a plain process, or
one rank under torchrun (``WORLD_SIZE`` set: gloo process group from the environment).

Usage: ``python notice_worker.py MODE OUT_DIR ITERATIONS [quiet]``, MODE ``plain`` (snapshot),
``distributed`` (``snapshot(saver_rank=0)``) or ``sharded`` (``SnapshotMode.SHARDED``); a
snapshot every iteration with ``autoload=True``; trains up to ITERATIONS and prints
``done <iteration>`` on stdout.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def main() -> None:
    mode, out_dir, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
    quiet = sys.argv[4:] == ["quiet"]
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1000, iters_per_epoch=100, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    if mode == "plain":
        snapshot = ext.snapshot(autoload=True, quiet=quiet)
    elif mode == "distributed":
        snapshot = ext.snapshot(saver_rank=0, autoload=True, timeout_s=60, quiet=quiet)
    else:
        snapshot = ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, autoload=True,
                                timeout_s=60, quiet=quiet)
    manager.extend(snapshot, trigger=(1, "iteration"))
    data = torch.Generator().manual_seed(1)
    while manager.iteration < iterations:
        with manager.run_iteration():
            model(torch.randn(2, 4, generator=data)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    manager.finalize()
    print(f"done {manager.iteration}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
