"""every="auto" through the doors that choose when to save (issue 34 item 2): the Checkpointer
saves at the interval it chose and resumes bit-identical; the ppe snapshot extension fires at
the AutoTrigger's interval in a real ExtensionsManager loop; after a SIGKILL and a rerun,
``snapkeep status`` reports the job's goodput (the restart, the failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import snapkeep
import snapkeep.training as ppe
from snapkeep.cli import cli
from snapkeep.training import extensions, triggers

WORKER = Path(__file__).with_name("auto_cadence_worker.py")
BOUND_S = 180
# short: an interval of a few 10 ms steps (at most 15 on a loaded machine, where a slow fsync
# raises the time to durable, so that 60 steps hold at least 3 snapshots)
AUTO = snapkeep.AutoInterval(mtbf_s=0.5, max_steps=15)


def _assert_saved_at_the_chosen_interval(saved: list[int], chosen: dict[int, int],
                                         start: int) -> None:
    """Each snapshot after the first came at the first step where the steps since the previous
    one reached the interval chosen at that step."""
    assert len(saved) >= 3, saved
    for before, at in zip(saved, saved[1:]):
        assert at - before >= chosen[at], (before, at, chosen[at])
        assert all(step - before < chosen[step] for step in range(before + 1, at)), (before, at)
    assert saved[0] > start


def _train(directory: Path, steps: int, *, until: int | None = None
           ) -> tuple[torch.nn.Module, list[int], dict[int, int], int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    saved: list[int] = []
    chosen: dict[int, int] = {}
    with snapkeep.Checkpointer(directory, every=AUTO) as ckpt:
        state = {"model": model, "optim": optim}
        start = ckpt.load(into=state) or 0
        for step in range(start + 1, (until or steps) + 1):
            optim.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optim.step()
            time.sleep(0.01)
            if ckpt.save(step, state) is not None:
                saved.append(step)
            if ckpt.choice is not None:
                chosen[step] = ckpt.choice.interval_steps
    return model, saved, chosen, start


def test_checkpointer_auto_saves_at_its_chosen_interval_and_resumes_bit_identical(
        tmp_path: Path) -> None:
    whole, saved, chosen, _ = _train(tmp_path / "whole", 60)
    _assert_saved_at_the_chosen_interval(saved, chosen, 0)
    _, first_saves, _, _ = _train(tmp_path / "cut", 60, until=35)
    resumed, _, _, start = _train(tmp_path / "cut", 60)
    assert start == max(s for s in first_saves if s <= 35)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    runs = json.loads((tmp_path / "cut" / ".snapkeep" / "goodput.json").read_text())["runs"]
    assert [(r["ended"], r["resumed_step"]) for r in runs] == [("finished", None),
                                                               ("finished", start)]


def test_ppe_auto_trigger_fires_the_snapshot_at_its_chosen_interval(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = ppe.ExtensionsManager({"model": model}, {"optim": optim}, max_epochs=1,
                                    iters_per_epoch=60, out_dir=str(tmp_path))
    trigger = triggers.AutoTrigger(settings=AUTO)
    manager.extend(extensions.snapshot(n_retains=-1), trigger=trigger)
    chosen: dict[int, int] = {}
    while not manager.stop_trigger:
        with manager.run_iteration():
            optim.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optim.step()
            time.sleep(0.01)
        if trigger.choice is not None:
            chosen[manager.iteration] = trigger.choice.interval_steps
    saved = sorted(int(p.name.rsplit("_", 1)[1]) for p in tmp_path.glob("snapshot_iter_*"))
    _assert_saved_at_the_chosen_interval(saved, chosen, 0)
    runs = json.loads((tmp_path / ".snapkeep" / "goodput.json").read_text())["runs"]
    assert [(r["ended"], r["saves"]) for r in runs] == [("finished", len(saved))]
    assert isinstance(triggers.get_trigger("auto"), triggers.AutoTrigger)


def _run(out: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(WORKER), str(out), "80", str(kill_at)],
                          capture_output=True, text=True, timeout=BOUND_S)


@pytest.mark.slow
def test_status_reports_goodput_after_a_sigkill_and_a_rerun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    killed = _run(out, kill_at=30)
    assert killed.returncode == -9, killed.stderr
    rerun = _run(out, kill_at=0)
    assert rerun.returncode == 0, rerun.stderr
    result = CliRunner().invoke(cli, ["status", str(out)])
    assert result.exit_code == 0, result.output
    line = result.output.splitlines()[-1]
    assert line.startswith("goodput ") and "over 2 run(s)" in line, line
    assert "restarts" in line and "(1, 1 after a failure)" in line, line
    as_json = CliRunner().invoke(cli, ["status", str(out), "--json"])
    goodput: dict[str, Any] = json.loads(as_json.output)["goodput"]
    assert (goodput["runs"], goodput["failures"], len(goodput["restarts"])) == (2, 1, 1)
    assert goodput["restart_s"] > 0 and goodput["trained_s"] > 0
    parts = goodput["trained_s"] + goodput["save_s"] + goodput["restart_s"] + goodput["replay_s"]
    assert parts == pytest.approx(goodput["wall_s"])


@pytest.mark.parametrize("history", [
    b"{\"format\": 1, \"runs\": [{\"ended\": \"\\u001b]0;x\"}]}", b" " * (2 << 20), "fifo"])
def test_a_hostile_run_history_is_said_and_replaced_never_a_traceback(
        tmp_path: Path, history: bytes | str) -> None:
    """``.snapkeep/goodput.json`` is untrusted: a bad one is named on stderr by ``snapkeep
    status`` (the exit code stays the status's) and replaced by the next run, which trains."""
    out = tmp_path / "run"
    (out / ".snapkeep").mkdir(parents=True)
    path = out / ".snapkeep" / "goodput.json"
    if history == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(history)  # type: ignore[arg-type]
    storage, where = snapkeep.store.resolve_storage(str(out))
    snapkeep.session.write_run_status(storage, where, state="finished", step=3)
    result = CliRunner().invoke(cli, ["status", str(out)])
    assert result.exit_code == 0 and "invalid run history" in result.output, result.output
    lines = result.output.splitlines()
    assert not any(line.startswith("goodput ") for line in lines) and "\x1b" not in result.output
    _train(out, 20)
    runs = json.loads(path.read_text())["runs"]
    assert [r["ended"] for r in runs] == ["finished"]
