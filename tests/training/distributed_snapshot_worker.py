"""One rank of the 2-process ``saver_rank`` test (run by test_distributed_snapshot.py).

Usage: ``python distributed_snapshot_worker.py RANK WORLD_SIZE STORE_FILE OUT_DIR REPORT_DIR``.

Phase 1 trains 3 iterations on every rank with ``snapshot(saver_rank=1, n_retains=2)`` and
counts the writer calls of this rank. Phase 2 builds a differently initialised model on every
rank and autoloads. The rank writes what it observed to ``REPORT_DIR/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

SAVER_RANK = 1


class CountingWriter(writing.SimpleWriter):
    """A SimpleWriter that counts the snapshots this rank writes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().__call__(*args, **kwargs)


def build(seed: int, out_dir: str, writer: writing.Writer) -> tuple[Any, ExtensionsManager]:
    # No torch.optim optimizer: its first construction imports torch._dynamo (seconds per
    # process); a manual SGD step changes the weights just as well for this test.
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    manager = ExtensionsManager(model, {}, 10, iters_per_epoch=5, out_dir=out_dir, writer=writer)
    return model, manager


def sgd_step(model: torch.nn.Module) -> None:
    model.zero_grad()
    model(torch.ones(2, 4)).pow(2).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


def main(rank: int, world_size: int, store_file: str, out_dir: str, report_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size)
    report: dict[str, Any] = {"rank": rank}
    try:
        bad_rank = ext.snapshot(saver_rank=world_size)
    except ValueError as e:
        report["bad_saver_rank_error"] = str(e)
    else:
        report["bad_saver_rank_error"] = repr(bad_rank)

    # phase 1: identical training on every rank; only the saver rank writes
    writer = CountingWriter(out_dir=out_dir)
    model, manager = build(0, out_dir, writer)
    manager.extend(ext.snapshot(saver_rank=SAVER_RANK, n_retains=2), trigger=(1, "iteration"))
    torch.manual_seed(1000 + rank)  # each rank has its own random stream
    for _ in range(3):
        with manager.run_iteration():
            sgd_step(model)
    manager.finalize()
    dist.barrier()
    report["writer_calls"] = writer.calls
    report["listing"] = sorted(os.listdir(out_dir))
    report["draw_after_snapshot"] = torch.rand(3).tolist()  # this rank's stream after iteration 3
    trained = {k: v.clone() for k, v in model.state_dict().items()}

    # phase 2: a different model on every rank; every rank autoloads the saver's choice
    model2, manager2 = build(100 + rank, out_dir, CountingWriter(out_dir=out_dir))
    report["differs_before"] = not torch.equal(model2.weight, trained["weight"])
    snapshot = ext.snapshot(saver_rank=SAVER_RANK, autoload=True)
    report["loaded"] = snapshot.initialize(manager2)
    report["iteration"] = manager2.iteration
    report["draw_after_resume"] = torch.rand(3).tolist()
    report["equal_after"] = all(torch.equal(v, trained[k]) for k, v in
                                model2.state_dict().items())
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
