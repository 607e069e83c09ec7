"""State of the loop extensions in the manager's state_dict (what a snapshot holds): a manager
restored from it continues the log, the schedule and an owned LogReport without gaps or
duplicates (without ppe installed)."""

from __future__ import annotations

import io
import json

import torch

import snapkeep
from snapkeep.training import ExtensionsManager, extensions


def _build(tmp_path, name):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 4], gamma=0.5)
    out = io.StringIO()
    owned = extensions.LogReport(trigger=(2, "iteration"), filename="owned_log")
    manager = ExtensionsManager(model, optimizer, 3, iters_per_epoch=3,
                                out_dir=str(tmp_path / name))
    manager.extend(extensions.LogReport(trigger=(2, "iteration")))
    manager.extend(extensions.observe_lr(optimizer), trigger=(1, "iteration"))
    manager.extend(extensions.LRScheduler(scheduler, trigger=(1, "iteration")))
    manager.extend(extensions.PrintReport(["iteration", "x", "lr"], log_report=owned, out=out))
    return manager, optimizer, out


def _iterate(manager, until):
    while manager.iteration < until:
        with manager.run_iteration(step_optimizers=["main"]):
            snapkeep.report({"x": float(manager.iteration) ** 2})


def _log(path):
    return [{k: v for k, v in e.items() if k != "elapsed_time"}
            for e in json.loads(path.read_text())]


def test_restored_manager_continues_log_schedule_and_owned_report(tmp_path):
    straight, straight_opt, straight_out = _build(tmp_path, "straight")
    _iterate(straight, 9)

    first, _, _ = _build(tmp_path, "resumed")
    _iterate(first, 5)  # mid-period for both LogReports (periods end at 2, 4, 6, 8)
    state = first.state_dict()
    assert json.loads(state["extensions"]["LogReport"]["extension"]["_log"])[-1][
        "iteration"] == 4
    assert state["extensions"]["LogReport"]["extension"]["_summary"]["x"]["_n"] == 1
    assert state["extensions"]["LRScheduler"]["extension"]["scheduler"]["last_epoch"] == 5
    assert "_log_report" in state["extensions"]["PrintReport"]["extension"]

    resumed, resumed_opt, resumed_out = _build(tmp_path, "resumed")
    resumed.load_state_dict(state)
    _iterate(resumed, 9)
    assert resumed_opt.param_groups[0]["lr"] == straight_opt.param_groups[0]["lr"] == 0.25
    assert _log(tmp_path / "resumed" / "log") == _log(tmp_path / "straight" / "log")
    assert [e["iteration"] for e in _log(tmp_path / "resumed" / "log")] == [2, 4, 6, 8]
    assert _log(tmp_path / "resumed" / "owned_log") == _log(tmp_path / "straight" / "owned_log")
    # the resumed PrintReport prints the restored rows, then the new ones: each once
    assert resumed_out.getvalue() == straight_out.getvalue()
