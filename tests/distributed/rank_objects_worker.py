"""One rank of the per-rank non-tensor state tests (run by test_rank_objects.py).

Usage: ``python rank_objects_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR REPORT_DIR MODE``.

Each rank holds non-tensor values that differ per rank, saved by both sharded paths in one run:

- the manager's ``SnapshotMode.SHARDED`` snapshot (``OUT_DIR/manager``, every iteration): a
  state object ``tally`` (``state_dict``/``load_state_dict``) whose value is
  ``1000 * rank + iteration``;
- ``snapkeep.Checkpointer`` (``OUT_DIR/checkpointer``, every step): a plain value
  ``metrics`` (a dict) and an object ``counter`` with ``state_dict``/``load_state_dict``, both
  rank-specific.

MODE ``save``: 3 iterations, then a clean stop. MODE ``resume``: fresh objects (values -1),
autoload / ``Checkpointer.load``; writes ``REPORT_DIR/resume_rank<R>.json`` with the values
each path restored and snapkeep's WARNING log lines.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import snapkeep
from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

ITERS = 3


class Tally:
    """A per-rank state object (as demo_sharded's ``last_loss``)."""

    def __init__(self) -> None:
        self.value = -1

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _manager(out_dir: str, rank: int, mode: str) -> int:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tally = Tally()
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=ITERS, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir),
                                state_objects={"tally": tally})
    manager.extend(ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, autoload=True,
                                timeout_s=60, quiet=True), trigger=(1, "iteration"))
    manager.start_extensions()
    if mode == "save":
        while manager.iteration < ITERS:
            with manager.run_iteration(step_optimizers=["main"]):
                model(torch.ones(2, 4)).sum().backward()
                tally.value = 1000 * rank + manager.iteration + 1
    manager.finalize()
    return tally.value


def _checkpointer(out_dir: str, rank: int, mode: str) -> dict[str, Any]:
    model = torch.nn.Linear(4, 2)
    counter = Tally()
    state: dict[str, Any] = {"model": model, "metrics": {"rank": -1}, "counter": counter}
    with snapkeep.Checkpointer(out_dir, timeout_s=60) as ckpt:
        if mode == "save":
            for step in range(1, ITERS + 1):
                state["metrics"] = {"rank": rank, "seen": [rank] * step}
                counter.value = 1000 * rank + step
                ckpt.save(step, state)
        else:
            ckpt.load(into=state)
    return {"metrics": state["metrics"], "counter": counter.value}


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, report_dir, mode = sys.argv[3:7]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    warned = _Warnings()
    logging.getLogger("snapkeep").addHandler(warned)
    report: dict[str, Any] = {"rank": rank}
    report["tally"] = _manager(os.path.join(out_dir, "manager"), rank, mode)
    report["checkpointer"] = _checkpointer(os.path.join(out_dir, "checkpointer"), rank, mode)
    report["warnings"] = warned.lines
    with open(os.path.join(report_dir, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
