"""Stop triggers decide the same after a resume (issue 25 item 4), under snapkeep's manager
(single-file and SHARDED snapshots: the SHARDED extension never bound its manager, so no stop
trigger state travelled) and under ppe's (which wraps snapkeep's EarlyStoppingTrigger in its
``_CallableTrigger``, whose own state is empty: the trigger's state did not travel at all). In
one process: a run stopped right after an epoch-end snapshot, then a new manager autoloads it
(the kill and rerun are tests/integration/test_stop_trigger_kill.py)."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_pfn_extras as ppe
import torch

import snapkeep.reporting as reporting
from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext
from snapkeep.training.triggers import EarlyStoppingTrigger

LOSSES = [None, 10.0, 9.0, 8.0, 8.5, 8.4, 8.3, 8.2, 8.1, 8.05, 8.04, 8.03]


def _run(out: str, kind: str, stop_at: int | None = None) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = EarlyStoppingTrigger(check_trigger=(1, "epoch"), monitor="main/loss", patience=3,
                                max_trigger=(10, "epoch"))
    make = ExtensionsManager if kind != "ppe" else ppe.training.ExtensionsManager
    manager = make(model, {"main": optimizer}, 10, iters_per_epoch=3, stop_trigger=stop,
                   out_dir=out)
    if kind == "sharded":
        manager.extend(ext.snapshot(autoload=True, snapshot_mode=ext.SnapshotMode.SHARDED),
                       trigger=(1, "epoch"))
    else:
        manager.extend(ext.snapshot(autoload=True, writer=writing.SimpleWriter(out_dir=out)),
                       trigger=(1, "epoch"))
    report = reporting.report if kind != "ppe" else ppe.reporting.report
    while not manager.stop_trigger:
        with manager.run_iteration():
            iteration = manager.iteration + 1
            report({"main/loss": LOSSES[(iteration - 1) // 3 + 1] + 0.01 * (iteration % 3)})
            model.weight.data += 0.01 * iteration
        if manager.iteration == stop_at:
            manager.finalize()
            return None
    return manager.iteration, model.weight.detach().clone(), stop.state_dict()


@pytest.mark.parametrize(("kind", "stopped_at"), [("snapkeep", 15), ("ppe", 12),
                                                  ("sharded", 12)])
def test_a_resumed_run_stops_where_the_uninterrupted_one_did(tmp_path, kind, stopped_at):
    iteration, weight, state = _run(str(tmp_path / "reference"), kind)
    assert iteration == 18
    _run(str(tmp_path / "run"), kind, stop_at=stopped_at)
    resumed = _run(str(tmp_path / "run"), kind)
    assert resumed[0] == 18 and torch.equal(resumed[1], weight) and resumed[2] == state


def _with_tier(out: str, root: str) -> tuple[Any, torch.nn.Module, EarlyStoppingTrigger, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = EarlyStoppingTrigger(check_trigger=(1, "epoch"), monitor="main/loss", patience=3,
                                max_trigger=(10, "epoch"))
    manager = ExtensionsManager(model, {"main": optimizer}, 10, iters_per_epoch=3,
                                stop_trigger=stop, out_dir=out,
                                writer=writing.SimpleWriter(out_dir=out))
    manager.extend(ext.snapshot(autoload=True), trigger=(100, "iteration"))  # storage: never
    tier = ext.memory_tier(ext.MemoryTier(every=3, replicas=0, root=root))
    manager.extend(tier)
    return manager, model, stop, tier


def _train(manager: Any, model: torch.nn.Module, until: int | None = None) -> None:
    while not manager.stop_trigger:
        with manager.run_iteration():
            iteration = manager.iteration + 1
            reporting.report({"main/loss": LOSSES[(iteration - 1) // 3 + 1]
                              + 0.01 * (iteration % 3)})
            model.weight.data += 0.01 * iteration
        if manager.iteration == until:
            return


def test_a_ram_resume_restores_the_stop_triggers_state(tmp_path):
    """The memory tier resumes before the snapshot extension's autoload; the extension binds
    its manager first, so the continuation state (stop triggers included) is restored from
    RAM as from storage (before: best = inf, count = 0 after a RAM resume)."""
    manager, model, stop, _ = _with_tier(str(tmp_path / "ref"), str(tmp_path / "ref_shm"))
    _train(manager, model)
    manager.finalize()
    reference = (manager.iteration, model.weight.detach().clone(), stop.state_dict())
    assert reference[0] == 18
    out, root = str(tmp_path / "out"), str(tmp_path / "shm")
    manager, model, stop, tier = _with_tier(out, root)
    _train(manager, model, until=12)
    tier.wait()  # then the process "dies": no finalize
    resumed, model, stop, tier = _with_tier(out, root)
    resumed.start_extensions()
    assert tier.restored is not None and resumed.iteration == 12  # from RAM
    assert stop.state_dict()["count"] == 1 and stop.state_dict()["best"] < 8.1
    _train(resumed, model)
    resumed.finalize()
    assert resumed.iteration == 18 and torch.equal(model.weight.detach(), reference[1])
    assert stop.state_dict() == reference[2]
