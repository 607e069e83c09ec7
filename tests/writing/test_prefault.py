"""No first-snapshot penalty: the snapshot extension prepares the writer's staging buffers (heap
or shared-memory arena) in the background before the first snapshot, so that snapshot only
copies -- into the same single set of buffers later snapshots reuse."""

from __future__ import annotations

import pytest
import torch

from snapkeep import writing
from snapkeep._core.save.staging import BufferSet, prefault
from snapkeep.training import ExtensionsManager, extensions

STAGING_WRITERS = ["ThreadWriter", "ThreadQueueWriter", "ProcessWriter", "ProcessQueueWriter"]


def test_prefault_allocates_once_and_stage_then_allocates_nothing():
    tree = {"a": torch.arange(1000.0), "b": [torch.ones(3, 4), torch.zeros(0)], "n": 3}
    buffers = BufferSet()
    assert prefault(buffers, tree) == 4000 + 48
    assert prefault(buffers, tree) == 0  # already there
    staged, stats = buffers.stage(tree)
    assert stats.allocated_bytes == 0
    assert torch.equal(staged["a"], tree["a"]) and torch.equal(staged["b"][0], tree["b"][0])


def test_prefault_reads_no_values():
    buffers = BufferSet()
    source = torch.full((256,), 7.0)
    prefault(buffers, {"x": source})
    staged, _ = buffers.stage({"x": source})
    assert torch.equal(staged["x"], source)


@pytest.mark.parametrize("writer_name", STAGING_WRITERS)
def test_first_snapshot_stages_into_prefaulted_buffers(tmp_path, writer_name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)  # no state until its first step
    writer = getattr(writing, writer_name)(out_dir=str(tmp_path), timeout_s=60)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=2, writer=writer)
    manager.extend(extensions.snapshot(), trigger=(2, "iteration"))
    saver = writer._saver
    with manager.run_iteration(step_optimizers=["main"]):
        model(torch.randn(4, 64)).pow(2).mean().backward()
    # the first step gave Adam its state; the prefault started from its post-step hook
    assert saver._prefaulted.wait(60)
    assert len(saver._slots) == 1 and saver._slots[0].handle is None
    prepared = saver._slots[0].buffers.allocator.total_bytes
    state_bytes = sum(t.untyped_storage().nbytes() for t in [
        *model.state_dict().values(),
        *(v for s in optimizer.state.values() for v in s.values())])
    assert prepared >= state_bytes
    with manager.run_iteration(step_optimizers=["main"]):
        model(torch.randn(4, 64)).pow(2).mean().backward()
    handle = writer.last_handle
    assert handle.staged.result(timeout=60).allocated_bytes == 0  # the snapshot only copied
    manager.finalize()
    assert len(saver._slots) <= 1  # still one staging copy
    saved = torch.load(tmp_path / "snapshot_iter_2", weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(saved["models"]["main"][key], value)


def test_simple_writer_needs_no_prefault(tmp_path, model_and_optimizer):
    model, optimizer = model_and_optimizer
    writer = writing.SimpleWriter(out_dir=str(tmp_path))
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=1, writer=writer)
    manager.extend(extensions.snapshot(), trigger=(1, "iteration"))
    with manager.run_iteration():
        pass
    assert writer._saver._slots == [] or all(
        s.buffers.allocator.total_bytes == 0 for s in writer._saver._slots)
    manager.finalize()


def test_a_state_that_cannot_be_built_yet_does_not_stop_training(tmp_path, model_and_optimizer):
    from snapkeep._core.save.prefault import prefault_before_first_snapshot

    model, optimizer = model_and_optimizer  # has state: prepared at once
    writer = writing.ThreadWriter(out_dir=str(tmp_path))
    calls = []

    def state_fn():
        calls.append(1)
        raise RuntimeError("an extension is not initialized yet")

    prefault_before_first_snapshot(writer._saver, state_fn, [optimizer])
    assert calls == [1] and writer._saver._slots == []  # nothing prepared, nothing raised
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: prepared after its step
    prefault_before_first_snapshot(writer._saver, state_fn, [fresh])
    model(torch.randn(3, 8)).sum().backward()
    fresh.step()  # the post-step hook's failure must not reach the training loop
    assert calls == [1, 1]
    writer.finalize()


def _resumable(out, writer_name, *, autoload):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    writer = getattr(writing, writer_name)(out_dir=str(out), timeout_s=60)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=4, writer=writer)
    manager.extend(extensions.snapshot(autoload=autoload), trigger=(1, "iteration"))
    return manager, model, writer


def _iterate(manager, model, until):
    while manager.iteration < until:
        with manager.run_iteration(step_optimizers=["main"]):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, 0.1 * (i + 1) * (manager.iteration + 1))


@pytest.mark.parametrize("writer_name", ["ThreadWriter", "ProcessWriter"])
def test_after_a_resume_buffers_are_prepared_once_training_runs_and_the_first_snapshot_is_exact(
        tmp_path, writer_name):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    manager, model, _ = _resumable(reference, writer_name, autoload=False)
    _iterate(manager, model, 4)
    manager.finalize()
    manager, model, _ = _resumable(resumed, writer_name, autoload=False)
    _iterate(manager, model, 2)
    manager.finalize()

    manager, model, writer = _resumable(resumed, writer_name, autoload=True)
    manager.start_extensions()  # autoload: step 2
    assert manager.iteration == 2
    saver = writer._saver
    # nothing prepared before training resumes (the state has its optimizer state already)
    assert saver._slots == [] and saver._prefaulted.is_set()
    # the first iteration's step starts the preparation; its snapshot comes right after,
    # before that preparation may have finished, and waits for it
    _iterate(manager, model, 3)
    assert writer.last_handle.staged.result(timeout=60).allocated_bytes == 0
    _iterate(manager, model, 4)
    manager.finalize()
    for name in ("snapshot_iter_3", "snapshot_iter_4"):
        expected = torch.load(reference / name, weights_only=True)
        got = torch.load(resumed / name, weights_only=True)
        for section in ("models", "optimizers"):
            flat_e = [t for t in _leaves(expected[section])]
            flat_g = [t for t in _leaves(got[section])]
            assert len(flat_e) == len(flat_g) > 0
            for a, b in zip(flat_e, flat_g):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _leaves(node):
    if isinstance(node, dict):
        for key in node:
            yield from _leaves(node[key])
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _leaves(value)
    else:
        yield node
