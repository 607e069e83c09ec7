"""The import-swap extensions behave as ppe 0.9.0's: the same loop, run once with
``pytorch_pfn_extras`` and once with ``snapkeep`` as ``ppe``, writes the same ``log`` file, prints
the same report, schedules the same learning rates and evaluates to the same numbers."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

import snapkeep

ppe_original = pytest.importorskip("pytorch_pfn_extras")

ITERS_PER_EPOCH = 4
EPOCHS = 3
LIBS = {"ppe": ppe_original, "snapkeep": snapkeep}


def _zero_time(entry: dict[str, Any]) -> None:
    entry["elapsed_time"] = 0.0  # the only value that differs between two runs


def _run(
    lib: ModuleType, out_dir: str, make_extensions: Callable[[ModuleType, Any], list[Any]],
    *, seed: int = 0, iterations: int = EPOCHS * ITERS_PER_EPOCH,
) -> dict[str, Any]:
    """A small ppe-example loop; returns the model, optimizer and manager at the end."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    extensions = make_extensions(lib, optimizer)
    manager = lib.training.ExtensionsManager(
        model, optimizer, EPOCHS, iters_per_epoch=ITERS_PER_EPOCH, extensions=extensions,
        out_dir=out_dir,
    )
    x = torch.linspace(-1, 1, 24).reshape(8, 3)
    for step in range(iterations):
        with manager.run_iteration(step_optimizers=["main"]):
            loss = model(x[step % 8:step % 8 + 1]).pow(2).sum()
            lib.reporting.report({"train/loss": loss.item(), "t": loss.detach()})
            lib.reporting.report({"acc": float(step % 3)}, observer=model)
            loss.backward()
    lrs = [group["lr"] for group in optimizer.param_groups]
    return {"model": model, "optimizer": optimizer, "manager": manager, "lrs": lrs}


@pytest.mark.parametrize(
    ("kwargs", "parse"),
    [
        ({}, json.loads),
        ({"filename": "log.jsonl"}, lambda t: [json.loads(line) for line in t.splitlines()]),
        ({"filename": "out", "format": "json-lines", "append": True,
          "trigger": (3, "iteration")}, lambda t: [json.loads(line) for line in t.splitlines()]),
        ({"filename": "log.yaml", "keys": ["train/loss", "main/acc"]}, yaml.safe_load),
        ({"filename": "log.yaml", "append": True, "trigger": (2, "iteration")}, yaml.safe_load),
        ({"filename": "log_{epoch}", "trigger": (2, "iteration")}, json.loads),
    ],
    ids=["json", "jsonl-by-name", "jsonl-append", "yaml-keys", "yaml-append", "formatted-name"],
)
def test_log_file_is_ppe_s(tmp_path, kwargs, parse):
    texts = {}
    for name, lib in LIBS.items():
        out = tmp_path / name
        _run(lib, str(out), lambda lib, _opt: [
            lib.training.extensions.LogReport(postprocess=_zero_time, **kwargs)])
        files = sorted(f for f in os.listdir(out) if not f.startswith("."))
        texts[name] = {f: (out / f).read_text() for f in files}
    assert texts["snapkeep"].keys() == texts["ppe"].keys()
    for filename, text in texts["ppe"].items():
        ours = parse(texts["snapkeep"][filename])
        assert ours == parse(text), filename
        assert len(ours) >= 1 and all(entry["elapsed_time"] == 0.0 for entry in ours)
    if "format" not in kwargs and not kwargs.get("filename", "").endswith((".jsonl", ".yaml")):
        assert texts["snapkeep"] == texts["ppe"]  # json: byte-identical text


@pytest.mark.parametrize("entries", [["epoch", "iteration", "train/loss", "main/acc", "lr"], None])
def test_printed_report_is_ppe_s(tmp_path, entries):
    printed = {}
    for name, lib in LIBS.items():
        out = io.StringIO()

        def make(lib: ModuleType, optimizer: Any, out: io.StringIO = out) -> list[Any]:
            ext = lib.training.extensions
            return [ext.LogReport(postprocess=_zero_time), ext.observe_lr(optimizer),
                    ext.PrintReport(entries, out=out)]

        _run(lib, str(tmp_path / name), make)
        printed[name] = out.getvalue()
    assert printed["snapkeep"] == printed["ppe"]
    rows = [row for row in printed["snapkeep"].splitlines() if row]  # ppe: '\n' before rows
    assert len(rows) == 1 + EPOCHS and rows[0].startswith("epoch ")
    assert [row.split()[0] for row in rows[1:]] == ["\x1b[J1", "\x1b[J2", "\x1b[J3"]


def test_lr_scheduler_and_observe_value_follow_ppe(tmp_path):
    observed = {}
    for name, lib in LIBS.items():
        seen: list[float] = []

        def make(lib: ModuleType, optimizer: Any, seen: list[float] = seen) -> list[Any]:
            ext = lib.training.extensions
            sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 5], gamma=0.1)
            record = lib.training.make_extension(trigger=(1, "iteration"), priority=50)(
                lambda manager: seen.append(manager.observation.get("lr")))
            # observe_value runs first (PRIORITY_WRITER), once per epoch unless told otherwise
            return [ext.LRScheduler(sched, trigger=(1, "iteration")),
                    ext.observe_value("lr", lambda m: optimizer.param_groups[0]["lr"]), record]

        result = _run(lib, str(tmp_path / name), make)
        observed[name] = (list(seen), result["lrs"])
    assert observed["snapkeep"] == observed["ppe"]
    seen, final_lrs = observed["snapkeep"]
    # observed at the ends of epochs (iterations 4, 8, 12), before that iteration's step
    assert seen == [None, None, None, pytest.approx(0.05)] + [None] * 3 + [
        pytest.approx(0.005)] + [None] * 3 + [pytest.approx(0.005)]
    assert final_lrs == [pytest.approx(0.005)]


def test_reduce_lr_on_plateau_steps_on_val_loss_as_ppe(tmp_path):
    lrs = {}
    for name, lib in LIBS.items():
        param = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([param], lr=1.0)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1)
        manager = lib.training.ExtensionsManager(
            {}, {"main": optimizer}, 1, iters_per_epoch=6, out_dir=str(tmp_path / name),
            extensions=[lib.training.extensions.LRScheduler(sched, trigger=(1, "iteration"))])
        history = []
        for _ in range(6):
            with manager.run_iteration():
                lib.reporting.report({"val/loss": 1.0})
            history.append(optimizer.param_groups[0]["lr"])
        lrs[name] = history
    assert lrs["snapkeep"] == lrs["ppe"] == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


class _TwoArgs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        out = self.lin(x)
        snapkeep.report({"loss": (out - y).pow(2).mean()}, self)
        ppe_original.reporting.report({"loss": (out - y).pow(2).mean()}, self)
        return out


def _metric(lib: ModuleType) -> Callable[[Any, Any, bool], None]:
    def metric(batch: Any, output: Any, last: bool) -> None:
        lib.reporting.report({"out_sum": output.sum(), "last": float(last)})

    return metric


@pytest.mark.parametrize("batch_kind", ["tuple", "dict"])
def test_evaluator_means_and_names_are_ppe_s(tmp_path, batch_kind):
    torch.manual_seed(0)
    xs, ys = torch.randn(6, 2), torch.randn(6, 1)
    data: Any = (list(zip(xs, ys)) if batch_kind == "tuple"
                 else [{"x": x, "y": y} for x, y in zip(xs, ys)])
    results = {}
    for name, lib in LIBS.items():
        model = _TwoArgs()
        model.load_state_dict({"lin.weight": torch.ones(1, 2), "lin.bias": torch.zeros(1)})
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        evaluator = lib.training.extensions.Evaluator(loader, model, metrics=[_metric(lib)])
        manager = lib.training.ExtensionsManager(model, {}, 1, iters_per_epoch=2,
                                                 out_dir=str(tmp_path / name))
        manager.extend(evaluator, trigger=(1, "iteration"))
        with manager.run_iteration():
            pass
        results[name] = ({k: float(v) for k, v in manager.observation.items()}, model.modes,
                         model.training)
    assert results["snapkeep"] == results["ppe"]
    observation, modes, training = results["snapkeep"]
    assert set(observation) == {"validation/main/loss", "out_sum", "last"}
    assert observation["last"] == pytest.approx(1 / 3)  # True at the last of three batches
    assert modes == [False] * 3 and training is True  # eval mode inside, restored after


def test_log_report_state_loads_in_ppe_and_back(tmp_path):
    """snapkeep's LogReport state has ppe's layout: each loads the other's."""
    ours = _run(snapkeep, str(tmp_path / "a"), lambda lib, _o: [
        lib.training.extensions.LogReport(trigger=(3, "iteration"))], iterations=7)
    theirs = _run(ppe_original, str(tmp_path / "b"), lambda lib, _o: [
        lib.training.extensions.LogReport(trigger=(3, "iteration"))], iterations=7)
    our_state = ours["manager"].get_extension("LogReport").state_dict()
    their_state = theirs["manager"].get_extension("LogReport").state_dict()
    assert our_state.keys() == their_state.keys() == {"_trigger", "_summary", "_log"}
    assert our_state["_summary"] == their_state["_summary"]  # the partial period (iteration 7)
    assert [{k: v for k, v in e.items() if k != "elapsed_time"} for e in
            json.loads(our_state["_log"])] == [
        {k: v for k, v in e.items() if k != "elapsed_time"} for e in
        json.loads(their_state["_log"])]

    in_ppe = ppe_original.training.extensions.LogReport()
    in_ppe.load_state_dict(our_state)
    assert in_ppe.log == json.loads(our_state["_log"])
    in_ours = snapkeep.training.extensions.LogReport()
    in_ours.load_state_dict(their_state)
    assert in_ours.log == json.loads(their_state["_log"])
    expected = theirs["manager"].get_extension("LogReport")._summary.compute_mean()
    means = in_ours._summary.compute_mean()
    assert means.keys() == expected.keys() == {"train/loss", "t", "main/acc"}
    assert {k: float(v) for k, v in means.items()} == pytest.approx(
        {k: float(v) for k, v in expected.items()})
