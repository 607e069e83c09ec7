"""One rank of test_agreement.py: ``snapshot(saver_rank=0)`` with node-local directories.

Usage: ``python agreement_worker.py RANK WORLD_SIZE INIT_FILE BASE_DIR``, or under torchrun
``agreement_worker.py env BASE_DIR``.

Each rank's ``out_dir`` is ``BASE_DIR/node<RANK>`` (its own disk): only the saver rank's holds
snapshots. Phases, each written to ``BASE_DIR/report_rank<RANK>.json``:

- ``newest``: fresh models autoload; every rank must resume at iteration 3 (rank 1 receives the
  saver rank's bytes);
- ``fallback``: the saver rank's snapshot_iter_3 is corrupted; every rank falls back to 2;
- ``none``: every snapshot corrupted; every rank raises the same NoCommonSnapshotError;
- ``failing_save``: the saver rank's writer raises at iteration 2; every rank raises.
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


def build(seed: int, out_dir: str) -> tuple[torch.nn.Module, ExtensionsManager]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    manager = ExtensionsManager(model, {}, 10, iters_per_epoch=5, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    return model, manager


def corrupt(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))


def resume(rank: int, out_dir: str) -> dict[str, Any]:
    model, manager = build(100 + rank, out_dir)
    snapshot = ext.snapshot(saver_rank=0, autoload=True)
    try:
        loaded = snapshot.initialize(manager)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"loaded": loaded, "iteration": manager.iteration,
            "weight": model.weight.detach().flatten().tolist()}


class FailingWriter(writing.SimpleWriter):
    """Raises like a full disk from its second snapshot on."""

    calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls >= 2:
            raise OSError(28, "No space left on device (injected)")
        return super().__call__(*args, **kwargs)


def failing_save(rank: int, out_dir: str) -> dict[str, Any]:
    """The saver rank's writer fails at iteration 2: every rank must raise, naming rank 0."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    manager = ExtensionsManager(model, {}, 10, iters_per_epoch=5, out_dir=out_dir,
                                writer=FailingWriter(out_dir=out_dir))
    manager.extend(ext.snapshot(saver_rank=0, timeout_s=30), trigger=(1, "iteration"))
    try:
        for _ in range(3):
            with manager.run_iteration():
                pass
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "iteration": manager.iteration}
    return {"error": None, "iteration": manager.iteration}


def main() -> None:
    if sys.argv[1] == "env":  # under torchrun: RANK, WORLD_SIZE and the rendezvous from env
        base = sys.argv[2]
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        rank, world_size = int(sys.argv[1]), int(sys.argv[2])
        init_file, base = sys.argv[3], sys.argv[4]
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
    out_dir = os.path.join(base, f"node{rank}")
    model, manager = build(0, out_dir)
    manager.extend(ext.snapshot(saver_rank=0), trigger=(1, "iteration"))
    weights = {}
    for _ in range(3):
        with manager.run_iteration():
            with torch.no_grad():
                model.weight.add_(1.0)
        weights[manager.iteration] = model.weight.detach().flatten().tolist()
    manager.finalize()
    dist.barrier()
    report: dict[str, Any] = {"listing": sorted(os.listdir(out_dir)), "trained": weights}
    report["newest"] = resume(rank, out_dir)
    dist.barrier()
    if rank == 0:
        corrupt(os.path.join(out_dir, "snapshot_iter_3"))
    dist.barrier()
    report["fallback"] = resume(rank, out_dir)
    dist.barrier()
    if rank == 0:
        for step in (1, 2):
            corrupt(os.path.join(out_dir, f"snapshot_iter_{step}"))
    dist.barrier()
    report["none"] = resume(rank, out_dir)
    dist.barrier()
    report["failing_save"] = failing_save(rank, os.path.join(base, f"fail{rank}"))
    with open(os.path.join(base, f"report_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
