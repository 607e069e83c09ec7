"""``extensions.preemption`` in one process: a signal becomes one committed snapshot of the
iteration where it arrived, then ``SystemExit(exit_code)``; the rerun resumes from it."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def _run(out_dir: str, *, signal_at: int | None, signals: int = 1, iterations: int = 20
         ) -> tuple[ExtensionsManager, torch.nn.Module, ext.Preemption]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    manager = ExtensionsManager(model, {}, 1, iters_per_epoch=iterations, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    manager.extend(ext.snapshot(autoload=True), trigger=(10, "iteration"))
    preemption = ext.preemption(exit_code=77)
    manager.extend(preemption)
    while not manager.stop_trigger:
        with manager.run_iteration():
            with torch.no_grad():
                model.weight.add_(1.0)
            if manager.iteration + 1 == signal_at:  # arrives during iteration `signal_at`
                for _ in range(signals):
                    os.kill(os.getpid(), signal.SIGTERM)
    return manager, model, preemption


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_snapshots_that_iteration_and_exits_with_the_code(tmp_path, signals):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        _run(str(tmp_path), signal_at=4, signals=signals)
    assert info.value.code == 77
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored at finalize
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snapshot_iter_4"]
    state = torch.load(tmp_path / "snapshot_iter_4", weights_only=True)
    assert state["_start_iteration"] == 4
    # the rerun resumes from the preemption snapshot and finishes
    manager, model, _ = _run(str(tmp_path), signal_at=None)
    assert manager.iteration == 20
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snapshot_iter_10", "snapshot_iter_20",
                                            "snapshot_iter_4"]
    torch.manual_seed(0)
    expected = torch.nn.Linear(3, 2).weight.detach().clone()
    for _ in range(20):  # the same float additions as an uninterrupted run
        expected.add_(1.0)
    assert torch.equal(model.weight, expected)


def test_a_preemption_at_a_snapshot_iteration_saves_it_once(tmp_path):
    writes = []

    class Counting(writing.SimpleWriter):
        def __call__(self, filename, *args, **kwargs):
            writes.append(filename)
            return super().__call__(filename, *args, **kwargs)

    model = torch.nn.Linear(3, 2)
    manager = ExtensionsManager(model, {}, 1, iters_per_epoch=20, out_dir=str(tmp_path),
                                writer=Counting(out_dir=str(tmp_path)))
    manager.extend(ext.snapshot(), trigger=(10, "iteration"))
    manager.extend(ext.preemption())
    with pytest.raises(SystemExit) as info:
        while not manager.stop_trigger:
            with manager.run_iteration():
                if manager.iteration + 1 == 10:
                    os.kill(os.getpid(), signal.SIGUSR1)
    assert info.value.code == ext.EXIT_CODE_PREEMPTED == 143
    assert writes == ["snapshot_iter_10"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"signals": (signal.SIGKILL,)}, "signals must be catchable"),
    ({"signals": ("TERM",)}, "signals must be signal numbers"),
    ({"exit_code": 256}, "exit_code must be an int in 0..255"),
    ({"timeout_s": 0}, "timeout_s must be a finite number of seconds > 0"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ext.preemption(**kwargs)
