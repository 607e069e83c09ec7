"""ProgressBar (tqdm), FailOnNonNumber, Evaluator's bar, observe_lr and bad arguments, in
snapkeep's manager without ppe installed."""

from __future__ import annotations

import io
import json
import re
import threading

import pytest
import torch

import snapkeep
from snapkeep.training import ExtensionsManager, extensions
from snapkeep.training.triggers import ManualScheduleTrigger


def _manager(tmp_path, model=None, optimizer=None, max_epochs=5, iters_per_epoch=5, **kw):
    model = model if model is not None else torch.nn.Linear(1, 3)
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), 1.0)
    return ExtensionsManager({"main": model}, {"main": optimizer}, max_epochs,
                             iters_per_epoch=iters_per_epoch, out_dir=str(tmp_path), **kw)


def test_progress_bar_prints_ppe_s_status_every_update_interval(tmp_path):
    out = io.StringIO()
    threads_before = set(threading.enumerate())
    manager = _manager(tmp_path)
    manager.extend(extensions.ProgressBar(update_interval=2, bar_length=20, out=out))
    for _ in range(25):
        with manager.run_iteration():
            pass
    text = out.getvalue()
    for iteration in range(2, 26, 2):
        assert f"{iteration} iter, {iteration // 5} epoch / 5 epochs" in text
    for iteration in range(1, 26, 2):
        assert f"{iteration} iter," not in re.sub(r"\d*[02468] iter,", "", text)
    assert "[####################] 100.00%" not in text  # 25 is odd: never drawn full
    assert re.search(r"\[#{16}\.{4}\]  80\.00%", text)  # 20 of 25 iterations
    assert set(threading.enumerate()) == threads_before  # no tqdm monitor thread left


def _bar_output(tmp_path, iterations: int, update_interval: int) -> str:
    """What a ProgressBar printed over ``iterations`` iterations and the manager's finalize."""
    out = io.StringIO()
    manager = _manager(tmp_path)
    manager.extend(extensions.ProgressBar(update_interval=update_interval, out=out))
    for _ in range(iterations):
        with manager.run_iteration():
            pass
    manager.finalize()
    return out.getvalue()


def test_progress_bar_prints_nothing_before_its_first_update_interval(tmp_path):
    """As ppe: a run shorter than update_interval shows no (empty) bar at all."""
    assert _bar_output(tmp_path, 3, update_interval=100) == ""


def test_progress_bar_ends_its_line_when_closed(tmp_path):
    text = _bar_output(tmp_path, 4, update_interval=2)
    assert "4 iter, 0 epoch / 5 epochs" in text and text.endswith("\n")


def test_progress_bar_resumes_at_the_restored_iteration(tmp_path):
    out = io.StringIO()
    manager = _manager(tmp_path, max_epochs=2)
    manager.extend(extensions.ProgressBar(training_length=(20, "iteration"), update_interval=1,
                                          out=out))
    manager.load_state_dict({**_manager(tmp_path).state_dict(), "_start_iteration": 12})
    with manager.run_iteration():
        pass
    assert "13 iter, 2 epoch / 20 iterations" in out.getvalue()
    assert re.search(r"\[#{32}\.{18}\]  65\.00%", out.getvalue())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"update_interval": 0}, "update_interval must be an int >= 1"),
        ({"bar_length": 2.5}, "bar_length must be an int >= 1"),
        ({"training_length": (10, "step")}, "training_length unit must be 'iteration' or"),
        ({"training_length": 10}, "training_length must be \\(length"),
    ],
)
def test_progress_bar_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        extensions.ProgressBar(**kwargs)


def test_progress_bar_without_length_needs_an_interval_stop_trigger(tmp_path):
    manager = _manager(tmp_path, stop_trigger=ManualScheduleTrigger([3], "iteration"))
    manager.extend(extensions.ProgressBar(out=io.StringIO()))
    with pytest.raises(ValueError, match="training_length=.*ManualScheduleTrigger"):
        with manager.run_iteration():
            pass


@pytest.mark.parametrize(("check_grad", "raises"), [(True, True), (False, False)])
def test_fail_on_non_number_checks_gradients_only_when_asked(tmp_path, check_grad, raises):
    model = torch.nn.Linear(1, 3)
    manager = _manager(tmp_path, model=model)
    manager.extend(extensions.FailOnNonNumber(check_grad=check_grad))
    with manager.run_iteration():  # finite: passes
        model(torch.ones(1, 1)).sum().backward()

    def nan_gradient_iteration() -> None:
        with manager.run_iteration():
            model.zero_grad()
            (model(torch.ones(1, 1)).sum() * float("nan")).backward()

    if not raises:
        nan_gradient_iteration()
        return
    with pytest.raises(RuntimeError, match="diverge.*gradient 'weight' of model 'main'"):
        nan_gradient_iteration()


def test_fail_on_non_number_names_the_parameter(tmp_path):
    model = torch.nn.Linear(1, 3)
    manager = _manager(tmp_path, model=model)
    manager.extend(extensions.FailOnNonNumber())
    with torch.no_grad():
        model.bias[1] = float("inf")
    with pytest.raises(RuntimeError, match="diverge.*parameter 'bias' of model 'main'"):
        with manager.run_iteration():
            pass


def test_evaluator_progress_bar_runs_over_the_batches(capsys):
    model = torch.nn.Linear(2, 1)
    seen = []

    def eval_func(x):
        seen.append(x.shape[0])
        snapkeep.report({"val/loss": float(x.sum())})

    evaluator = extensions.Evaluator(torch.utils.data.DataLoader(torch.ones(5, 2), batch_size=2),
                                     model, eval_func=eval_func, progress_bar=True)
    evaluator.name = "my_eval"
    with snapkeep.reporting.Reporter():
        result = evaluator()
    assert seen == [2, 2, 1]
    assert result == {"val/loss": pytest.approx((4 + 4 + 2) / 3)}
    err_and_out = capsys.readouterr().out
    # drawn at every batch with ppe's text, on one line
    assert "my_eval [" + "." * 50 + "]   0.00%       0 iterations     inf iters/sec." in \
        err_and_out
    assert "my_eval [" + "#" * 33 + "." * 17 + "]  66.67%       2 iterations" in err_and_out


def test_evaluator_rejects_a_target_that_is_not_a_module():
    with pytest.raises(TypeError, match="target must be a torch.nn.Module"):
        extensions.Evaluator([], object())  # type: ignore[arg-type]


def test_observe_lr_checks_the_param_group():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    with pytest.raises(IndexError, match="param_group 1 is out of range: the optimizer has 1"):
        extensions.observe_lr(optimizer, param_group=1)
    ext = extensions.observe_lr(optimizer, observation_key="my_lr")
    assert ext.priority == snapkeep.training.PRIORITY_WRITER  # type: ignore[attr-defined]
    assert ext.trigger == (1, "epoch")  # type: ignore[attr-defined]


def test_log_report_rejects_bad_formats():
    with pytest.raises(ValueError, match="format must be one of"):
        extensions.LogReport(format="csv")
    with pytest.raises(ValueError, match="cannot append to a 'json' log"):
        extensions.LogReport(append=True)


def test_log_report_writes_through_its_own_writer(tmp_path):
    manager = _manager(tmp_path / "manager", max_epochs=1, iters_per_epoch=2)
    own = snapkeep.writing.ThreadWriter(out_dir=str(tmp_path / "own"))
    manager.extend(extensions.LogReport(writer=own, trigger=(1, "iteration")))
    for _ in range(2):
        with manager.run_iteration():
            snapkeep.report({"x": 1.5})
    # finalize (run_iteration's stop trigger) finalized the extension's writer: all committed
    entries = json.loads((tmp_path / "own" / "log").read_text())
    assert [(e["iteration"], e["x"]) for e in entries] == [(1, 1.5), (2, 1.5)]
    assert (tmp_path / "own" / ".snapkeep" / "log.json").exists()  # checksum manifest
    assert not (tmp_path / "manager" / "log").exists()


def test_print_report_rejects_a_wrong_log_report(tmp_path):
    with pytest.raises(TypeError, match="log_report must be the name"):
        extensions.PrintReport(log_report=3)  # type: ignore[arg-type]
    manager = _manager(tmp_path)
    manager.extend(extensions.observe_value("x", lambda m: 1.0), name="LogReport")
    manager.extend(extensions.PrintReport(out=io.StringIO()))
    with pytest.raises(TypeError, match="'LogReport' names a"):
        with manager.run_iteration():
            pass
