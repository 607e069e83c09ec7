"""One rank of the sharded-snapshot tests (run by test_sharded.py, tools/sharded_crash_trials.py).

Usage: ``python sharded_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR REPORT_DIR MODE [ITERS]``.

MODE ``train``: a 2-layer MLP sharded with FSDP2 ``fully_shard`` (a plain model when
WORLD_SIZE is 1), Adam, an ExtensionsManager with ``snapshot(snapshot_mode=SHARDED,
n_retains=2, autoload=True)`` every iteration until iteration ITERS (default 4; a resumed run
continues to it); reports the full parameters after each iteration to
``REPORT_DIR/params_rank<R>.pt`` (not with ``SNAPKEEP_TEST_NO_RECORD``, which writes
``REPORT_DIR/started_rank<R>`` once training starts instead).
MODE ``preempt``: trains until a signal; ``extensions.preemption`` snapshots and exits 143 (rank 1
writes ``REPORT_DIR/ready`` after iteration 3).
MODE ``resume``: builds a differently initialised model, autoloads, reports what it loaded and
its full parameters and Adam state. ``SNAPKEEP_TEST_FAIL_RANK=<r>`` makes rank r's storage
writer raise during the save of iteration 2 (the fault test);
``SNAPKEEP_TEST_DIE_RANK=<r>`` makes rank r exit with code 3 before the last snapshot;
``SNAPKEEP_TEST_TIMEOUT_S`` is the snapshot's ``timeout_s`` (default 120);
``SNAPKEEP_TEST_STORAGE_OPTIONS`` (JSON) is the writer's ``storage_options`` (an ``s3://`` OUT_DIR).
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

ITERS_PER_EPOCH = 100


def build(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded parameters and Adam moments (collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(model, optimizer, options=options)
    moments = {k: v["exp_avg"].clone() for k, v in osd["state"].items()}
    return {"params": {k: v.detach().clone() for k, v in msd.items()}, "exp_avg": moments}


def inject_write_fault() -> None:
    """From now on, this rank's DCP storage writer raises (a disk failing on one rank)."""
    from snapkeep._core.distributed import sharded

    def failing_write_data(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device (injected)")

    sharded._RecordingWriter.write_data = failing_write_data  # type: ignore[method-assign]


def preempt(manager: ExtensionsManager, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, rank: int, report_dir: str,
            report: dict[str, Any]) -> None:
    """Train until a signal ends the run; rank 1 says when it is past iteration 3."""
    try:
        while not manager.stop_trigger:
            with manager.run_iteration():
                model(torch.randn(4, 8)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            if manager.iteration == 3 and rank == 1:
                with open(os.path.join(report_dir, "ready"), "w") as f:
                    f.write(str(os.getpid()))
    except SystemExit as e:
        report["exit_code"] = e.code
        report["iteration"] = manager.iteration
        report["listing"] = sorted(os.listdir(manager.out))
        with open(os.path.join(report_dir, f"preempt_rank{rank}.json"), "w") as f:
            json.dump(report, f)
        raise


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, report_dir, mode = sys.argv[3:7]
    iters = int(sys.argv[7]) if len(sys.argv) > 7 else 4
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
    report: dict[str, Any] = {"rank": rank, "world_size": world_size}
    seed = 0 if mode == "train" else 100 + rank
    model, optimizer = build(seed, world_size)
    options = json.loads(os.environ.get("SNAPKEEP_TEST_STORAGE_OPTIONS", "null"))
    writer = writing.SimpleWriter(out_dir=out_dir, storage_options=options)
    manager = ExtensionsManager(model, optimizer, 1000, iters_per_epoch=ITERS_PER_EPOCH,
                                out_dir=out_dir, writer=writer)
    snapshot = ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, n_retains=2, autoload=True,
                            timeout_s=float(os.environ.get("SNAPKEEP_TEST_TIMEOUT_S", "120")))
    manager.extend(snapshot, trigger=(1000 if mode == "preempt" else 1, "iteration"))
    if mode == "preempt":
        manager.extend(ext.preemption(timeout_s=60))
    fail_rank = os.environ.get("SNAPKEEP_TEST_FAIL_RANK")
    try:
        report["loaded"] = None
        if mode == "preempt":
            preempt(manager, model, optimizer, rank, report_dir, report)
        elif mode == "resume":
            manager.start_extensions()  # initialize extensions (autoload) now
            report["loaded"] = snapshot.loaded_entry.name if snapshot.loaded_entry else None
            report["iteration"] = manager.iteration
            torch.save(full_state(model, optimizer),
                       os.path.join(report_dir, f"resumed_rank{rank}.pt"))
        else:
            torch.manual_seed(1000 + rank)
            states = {}
            record = "SNAPKEEP_TEST_DIE_RANK" not in os.environ \
                and "SNAPKEEP_TEST_NO_RECORD" not in os.environ
            if "SNAPKEEP_TEST_NO_RECORD" in os.environ:  # crash trials: say when training runs
                started = os.path.join(report_dir, f"started_rank{rank}")
                with open(started + ".tmp", "w") as f:
                    f.write(str(manager.iteration))
                os.replace(started + ".tmp", started)
            while manager.iteration < iters:
                i = manager.iteration
                with manager.run_iteration():
                    x = torch.randn(4, 8)
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if fail_rank is not None and i == 1 and rank == int(fail_rank):
                        snapshot.wait()  # snapshot_iter_1 is written: only later ones fail
                        inject_write_fault()
                    if i == iters - 1 and rank == int(os.environ.get("SNAPKEEP_TEST_DIE_RANK",
                                                                     "-1")):
                        snapshot.wait()  # the previous snapshot is committed everywhere
                        os._exit(3)  # dies before the last snapshot (SIGKILL-like)
                if record:  # a collective of its own
                    states[manager.iteration] = full_state(model, optimizer)
            manager.finalize()
            torch.save(states, os.path.join(report_dir, f"params_rank{rank}.pt"))
            report["iteration"] = manager.iteration
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    report["listing"] = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    with open(os.path.join(report_dir, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if world_size > 1 and "error" not in report:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
