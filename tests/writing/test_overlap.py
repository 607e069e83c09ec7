"""Overlapped staging with a mutation tripwire (issue 12): inside the manager, a snapshot copies
at once everything but the optimizers' parameters and state, which are copied in the background
while the next forward/backward runs; the optimizer's step waits for that copy. Every file holds
the values of the call; an in-place edit of an optimizer-owned tensor between the call and the
verdict (on the training thread, at the next step) drops that snapshot with one warning instead of
writing it torn, and ``overlap='strict'`` raises.

The background copy is held on a gate (``_overlap_before_copy``) until the test has done what
training would do after the call, so each ordering is deterministic."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import snapkeep
from snapkeep import writing
from snapkeep._core.save.overlap import OverlapPlan, owned_storages
from snapkeep.training import ExtensionsManager, extensions
from support.ema import Ema
from support.writer_gates import CopyGate

WRITERS = ["ThreadWriter", "ThreadQueueWriter", "ProcessWriter", "ProcessQueueWriter"]
WAIT_S = 60


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(512, 512)  # 1 MiB weight: staged in the background
        self.bn = torch.nn.BatchNorm1d(512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))  # type: ignore[no-any-return]



def _setup(tmp_path, writer_name, **snapshot_kwargs):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    ema = Ema(model)
    writer = getattr(writing, writer_name)(out_dir=str(tmp_path), timeout_s=WAIT_S)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=3, writer=writer,
                                state_objects={"ema": ema})
    ext = extensions.snapshot(**snapshot_kwargs)
    manager.extend(ext, trigger=(1, "iteration"))
    return model, optimizer, ema, writer, manager, ext


def _step(manager, model):
    with manager.run_iteration(step_optimizers=["main"]):
        model(torch.randn(8, 512)).pow(2).mean().backward()


@pytest.mark.parametrize("writer_name", WRITERS)
def test_every_file_holds_the_state_of_the_call(tmp_path, writer_name):
    model, optimizer, ema, writer, manager, ext = _setup(tmp_path, writer_name)
    gate = CopyGate(WAIT_S)
    ext._overlap_before_copy = gate
    _step(manager, model)  # iteration 1: snapshot at its end; the deferred copy waits
    assert gate.entered.wait(WAIT_S)
    at_call = copy.deepcopy(manager.state_dict())
    handle = writer.last_handle
    assert not handle.staged.done()  # the parameters are still being staged
    ema.update(model)  # in place, right after the call: captured at the call
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 512))  # the next forward updates BatchNorm's running stats
    stepped = threading.Event()
    seen_by_step: list[bool] = []  # runs after the extension's pre-hook (registered later)
    optimizer.register_step_pre_hook(lambda *_: seen_by_step.append(handle.staged.done()))

    def train_on() -> None:  # the next step must wait for the background copy
        optimizer.zero_grad()
        model(torch.randn(8, 512)).pow(2).mean().backward()
        optimizer.step()
        stepped.set()

    thread = threading.Thread(target=train_on)
    thread.start()
    assert not handle.staged.done()  # held by the gate
    gate.open()
    thread.join(WAIT_S)
    assert stepped.is_set() and seen_by_step == [True]  # the step ran only after staging
    manager.finalize()
    saved = torch.load(tmp_path / "snapshot_iter_1", weights_only=True)
    now = manager.state_dict()
    for section in ("models", "optimizers", "state_objects"):
        differs = _differs(now[section], at_call[section])
        assert differs  # training changed the state after the call ...
        assert not _differs(saved[section], at_call[section])  # ... the file did not


def _differs(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return not torch.equal(a, b)
    if isinstance(a, dict):
        return set(a) != set(b) or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    return bool(a != b)


@pytest.mark.parametrize("writer_name", WRITERS)
def test_a_manual_edit_before_the_step_drops_that_snapshot(tmp_path, writer_name):
    model, optimizer, ema, writer, manager, ext = _setup(tmp_path, writer_name)
    gate = CopyGate(WAIT_S)
    ext._overlap_before_copy = gate
    _step(manager, model)
    assert gate.entered.wait(WAIT_S)
    first = writer.last_handle
    with torch.no_grad():
        model.fc.weight.mul_(0.0)  # a manual in-place edit of an optimizer-owned parameter
    gate.open()
    with pytest.warns(RuntimeWarning) as warned:
        _step(manager, model)  # the step validates the copy: dropped; the run goes on
    (warning,) = [w for w in warned if "overlap" in str(w.message)]
    assert "models/main/fc.weight" in str(warning.message)
    assert "overlap=False" in str(warning.message) and "dropped" in str(warning.message)
    assert isinstance(first.committed.exception(WAIT_S), snapkeep.StagingRaceError)
    assert not ext._overlap_on
    at_call = copy.deepcopy(manager.state_dict())  # snapshot_iter_2 was copied in the call
    assert writer.last_handle.staged.done()
    with torch.no_grad():
        model.fc.weight.add_(1.0)  # harmless now
    _step(manager, model)  # iteration 3, the last: finalizes
    assert not (tmp_path / "snapshot_iter_1").exists()  # never written torn
    saved = torch.load(tmp_path / "snapshot_iter_2", weights_only=True)
    for section in ("models", "optimizers", "state_objects"):
        assert not _differs(saved[section], at_call[section])
    assert (tmp_path / "snapshot_iter_3").exists()


@pytest.mark.parametrize("writer_name", ["ThreadWriter", "ProcessQueueWriter"])
def test_strict_overlap_raises_the_race(tmp_path, writer_name):
    model, optimizer, ema, writer, manager, ext = _setup(tmp_path, writer_name, overlap="strict")
    gate = CopyGate(WAIT_S)
    ext._overlap_before_copy = gate
    _step(manager, model)
    assert gate.entered.wait(WAIT_S)
    with torch.no_grad():
        model.fc.weight.mul_(0.0)
    gate.open()
    with pytest.raises(snapkeep.StagingRaceError, match="models/main/fc.weight"):
        _step(manager, model)  # the step's pre-hook gives the verdict and raises
    manager.finalize()
    assert not (tmp_path / "snapshot_iter_1").exists()


@pytest.mark.parametrize("value", ["yes", 1, None, "STRICT"])
def test_overlap_argument_is_checked(value):
    with pytest.raises(ValueError, match="overlap must be one of True, False or 'strict'"):
        extensions.snapshot(overlap=value)


@pytest.mark.parametrize("writer_name", ["ThreadWriter", "ProcessWriter"])
def test_overlap_off_stages_everything_in_the_call(tmp_path, writer_name):
    model, optimizer, ema, writer, manager, ext = _setup(tmp_path, writer_name, overlap=False)
    _step(manager, model)
    assert writer.last_handle.staged.done()
    with torch.no_grad():
        model.fc.weight.mul_(0.0)  # no tripwire needed: the copy was made in the call
    manager.finalize()
    saved = torch.load(tmp_path / "snapshot_iter_1", weights_only=True)
    assert saved["models"]["main"]["fc.weight"].abs().sum() > 0


def test_writers_used_directly_keep_staging_in_the_call(tmp_path):
    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    writer = writing.ThreadWriter(out_dir=str(tmp_path))
    writer("snap", str(tmp_path), {"m": model.state_dict(), "o": optimizer.state_dict()})
    assert writer.last_handle.staged.done()
    writer.finalize()


def test_small_tensors_and_unowned_tensors_are_not_deferred():
    model = Net()
    optimizer = torch.optim.Adam(model.parameters())
    owned = owned_storages([optimizer])
    plan = OverlapPlan(deferred=frozenset(owned))
    from snapkeep._core.save.staging import BufferSet

    tree = {"model": model.state_dict(), "ema": {k: v.clone() for k, v in
                                                 model.state_dict().items()}}
    staged, stats, deferred = plan.stage(BufferSet(), tree)
    assert deferred is not None
    # copied now: the 2 KiB bias, BatchNorm's buffers and weights, the whole EMA copy
    assert torch.equal(staged["ema"]["fc.weight"], model.fc.weight)
    assert torch.equal(staged["model"]["fc.bias"], model.fc.bias)
    assert stats.tensor_bytes == sum(t.untyped_storage().nbytes() for t in tree["ema"].values()) \
        + sum(t.untyped_storage().nbytes() for k, t in tree["model"].items() if k != "fc.weight")
    final = deferred.copy()
    assert torch.equal(staged["model"]["fc.weight"], model.fc.weight)
    assert final.tensor_bytes == stats.tensor_bytes + model.fc.weight.nbytes


@pytest.mark.parametrize("writer_name", ["ThreadWriter", "ProcessWriter"])
def test_waiting_for_an_overlapped_snapshot_on_the_training_thread_validates_it(tmp_path,
                                                                                writer_name):
    model, optimizer, ema, writer, manager, ext = _setup(tmp_path, writer_name)
    _step(manager, model)
    handle = writer.last_handle
    assert handle.verdict is not None  # the parameters were staged in the background
    record = handle.wait(WAIT_S)  # a safe point: no step needed, and no deadlock
    assert record.step == 1 and (tmp_path / "snapshot_iter_1").exists()
    manager.finalize()


def test_the_end_of_run_iteration_validates_a_finished_copy(tmp_path):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    writer = writing.ThreadWriter(out_dir=str(tmp_path), timeout_s=WAIT_S)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=10,
                                writer=writer)
    manager.extend(extensions.snapshot(), trigger=(2, "iteration"))
    _step(manager, model)
    _step(manager, model)  # snapshot_iter_2
    handle = writer.last_handle
    handle.verdict.copied.result(timeout=WAIT_S)  # the copy is done; no verdict yet
    assert not handle.staged.done()
    with manager.run_iteration():  # no step, no edit, no snapshot, not the last iteration:
        pass                       # only the end of run_iteration can give the verdict
    assert handle.staged.done() and handle.committed.result(timeout=WAIT_S).step == 2
    manager.finalize()


@pytest.mark.parametrize("writer_name", ["ThreadQueueWriter", "ProcessWriter"])
def test_strict_overlap_raises_at_finalize_after_finalizing_the_writer(tmp_path, writer_name):
    model, optimizer, ema, writer, manager, ext = _setup(tmp_path, writer_name, overlap="strict")
    _step(manager, model)
    with torch.no_grad():
        model.fc.weight.add_(1.0)  # after the call; no step follows
    with pytest.raises(snapkeep.StagingRaceError, match="models/main/fc.weight"):
        manager.finalize()
    assert writer.pending == 0 and writer._finalized  # nothing left running
    assert not (tmp_path / "snapshot_iter_1").exists()
