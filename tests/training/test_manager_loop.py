"""Iteration/epoch counting, optimizer stepping, finalize and writer calls."""

from __future__ import annotations

import pytest
import torch

from snapkeep import training


def test_counts_iterations_and_epochs(make_manager):
    manager = make_manager(iters_per_epoch=4, max_epochs=3)
    assert manager.is_before_training
    seen = []
    while not manager.stop_trigger:
        with manager.run_iteration():
            pass
        seen.append((manager.iteration, manager.epoch, manager.epoch_detail))
    assert seen[0] == (1, 0, 0.25)
    assert seen[3] == (4, 1, 1.0)
    assert seen[-1] == (12, 3, 3.0)
    assert len(seen) == 12
    assert not manager.is_before_training


def test_stop_trigger_finalizes_and_closes(make_manager, writer):
    manager = make_manager(iters_per_epoch=2, max_epochs=1)
    assert writer.calls == [("initialize", "fake-out")]
    for _ in range(2):
        with manager.run_iteration():
            pass
    assert writer.calls == [("initialize", "fake-out"), ("finalize", None)]
    with pytest.raises(RuntimeError, match="closed manager"):
        with manager.run_iteration():
            pass
    manager.finalize()  # idempotent
    assert writer.calls.count(("finalize", None)) == 1


def test_out_is_the_writers_out_dir(make_manager):
    assert make_manager().out == "fake-out"


def test_finalize_runs_extension_finalizers_before_the_writer(make_manager, writer):
    events = []

    class Ext(training.Extension):
        def __call__(self, manager):
            pass

        def finalize(self, manager):
            events.append(("ext", list(writer.calls)))

    with make_manager() as manager:
        manager.extend(Ext())
        with manager.run_iteration():
            pass
    assert events == [("ext", [("initialize", "fake-out")])]
    assert writer.calls[-1] == ("finalize", None)


def test_writer_is_finalized_even_if_an_extension_finalize_raises(make_manager, writer):
    class Broken(training.Extension):
        def __call__(self, manager):
            pass

        def finalize(self, manager):
            raise OSError("disk gone")

    manager = make_manager()
    manager.extend(Broken())
    with manager.run_iteration():
        pass
    with pytest.raises(OSError, match="disk gone"):
        manager.finalize()
    assert writer.calls[-1] == ("finalize", None)


def test_step_optimizers_zero_and_step():
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    manager = training.ExtensionsManager(
        torch.nn.Linear(1, 1), optimizer, 1, iters_per_epoch=5, writer=_NullWriter()
    )
    param.grad = torch.tensor([100.0])  # stale gradient, zeroed on entry
    with manager.run_iteration(step_optimizers=["main"]):
        assert param.grad is None or float(param.grad) == 0.0
        param.grad = torch.tensor([2.0])
    assert torch.equal(param.detach(), torch.tensor([-1.0]))


def test_unknown_step_optimizer_is_named(make_manager):
    manager = make_manager()
    with pytest.raises(KeyError, match="adam"):
        with manager.run_iteration(step_optimizers=["adam"]):
            pass


def test_elapsed_time_needs_a_first_iteration(make_manager):
    manager = make_manager()
    with pytest.raises(RuntimeError, match="run_iteration"):
        _ = manager.elapsed_time
    with manager.run_iteration():
        pass
    assert manager.elapsed_time >= 0.0


def test_updater_alias_is_deprecated(make_manager):
    manager = make_manager()
    with pytest.warns(DeprecationWarning):
        assert manager.updater is manager


class _NullWriter:
    out_dir = "unused"

    def initialize(self, out_dir):
        pass

    def finalize(self):
        pass

    def __call__(self, *args, **kwargs):
        pass
