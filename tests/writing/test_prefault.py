"""No first-snapshot penalty: the snapshot extension prepares the writer's staging buffers (heap
or shared-memory arena) in the background before the first snapshot, so that snapshot only
copies -- into the same single set of buffers later snapshots reuse."""

from __future__ import annotations

import pytest
import torch

from snapkeep import writing
from snapkeep._core.staging import BufferSet, prefault
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
    from snapkeep._core.prefault import prefault_before_first_snapshot

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
