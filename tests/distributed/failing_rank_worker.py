"""One rank of the failed-rank status test (run by test_failed_rank_status.py).

Usage: ``python failing_rank_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR FAIL_RANK``.

A plain loop with ``extensions.preemption`` and a snapshot every 2 iterations on 2 gloo ranks;
at iteration 5 rank FAIL_RANK raises ``ValueError`` in the body of its iteration. Each rank
prints ``raised <type>: <message>`` for what escaped its loop.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, fail_rank = sys.argv[3], sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=100, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    manager.extend(ext.snapshot(saver_rank=0, timeout_s=60), trigger=(2, "iteration"))
    manager.extend(ext.preemption(timeout_s=60))
    try:
        while not manager.stop_trigger:
            with manager.run_iteration(step_optimizers=["main"]):
                model(torch.ones(2, 4)).sum().backward()
                if manager.iteration == 4 and rank == fail_rank:  # the 5th iteration
                    raise ValueError(f"boom on rank {rank}")
    except Exception as e:
        print(f"raised {type(e).__name__}: {e}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
