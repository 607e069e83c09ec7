"""One rank of test_preemption_distributed.py: ``snapshot(saver_rank=0)`` (DISTRIBUTED mode)
with ``extensions.preemption`` on a gloo job.

Usage: ``python preemption_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR REPORT_DIR MODE``.

MODE ``preempt``: a Linear model trained on the same data on every rank (so the ranks hold equal
parameters), snapshot trigger far away (1000 iterations), ``preemption(timeout_s=60)``; trains
until a signal. After iteration 3 each rank writes ``REPORT_DIR/ready_rank<R>`` (its pid). On
``SystemExit`` it writes ``REPORT_DIR/preempt_rank<R>.json`` (exit code, iteration, parameters)
and re-raises; at interpreter exit (an ``atexit`` hook registered first, so it runs last) it
writes ``REPORT_DIR/atexit_rank<R>`` with whether the process group was still initialized then.
MODE ``resume``: a differently initialised model autoloads and reports what it loaded, its
iteration and parameters to ``REPORT_DIR/resume_rank<R>.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, report_dir, mode = sys.argv[3:7]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    torch.manual_seed(0 if mode == "preempt" else 100 + rank)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1000, iters_per_epoch=100, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    snapshot = ext.snapshot(saver_rank=0, autoload=True, timeout_s=60)
    manager.extend(snapshot, trigger=(1000, "iteration"))
    manager.extend(ext.preemption(timeout_s=60))
    report: dict[str, Any] = {"rank": rank}
    if mode == "resume":
        manager.start_extensions()
        report.update(loaded=snapshot.loaded_entry.name if snapshot.loaded_entry else None,
                      iteration=manager.iteration,
                      params=[p.detach().flatten().tolist() for p in model.parameters()])
        with open(os.path.join(report_dir, f"resume_rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
        dist.destroy_process_group()
        return
    def record_at_exit() -> None:
        with open(os.path.join(report_dir, f"atexit_rank{rank}"), "w") as f:
            f.write("initialized" if dist.is_initialized() else "destroyed")

    atexit.register(record_at_exit)  # first registered, last run: after snapkeep's hook
    data = torch.Generator().manual_seed(1)  # the same batches on every rank
    try:
        while not manager.stop_trigger:
            with manager.run_iteration():
                model(torch.randn(2, 4, generator=data)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            if manager.iteration == 3:
                with open(os.path.join(report_dir, f"ready_rank{rank}"), "w") as f:
                    f.write(str(os.getpid()))
    except SystemExit as e:
        report.update(exit_code=e.code, iteration=manager.iteration,
                      params=[p.detach().flatten().tolist() for p in model.parameters()])
        with open(os.path.join(report_dir, f"preempt_rank{rank}.json"), "w") as f:
            json.dump(report, f)
        raise


if __name__ == "__main__":
    main()
