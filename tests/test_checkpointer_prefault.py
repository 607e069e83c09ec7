"""The Checkpointer prepares its writer's staging buffers in the background after ``load`` (as
the snapshot extension after its autoload), so the first ``save`` after a restart only copies:
into the buffers the prefault thread allocated and faulted in, the same ones later saves reuse.
Real writers, real files; no timings."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import snapkeep
from snapkeep import writing
from snapkeep._core.save import staging
from snapkeep._core.save.staging import iter_tensors

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)  # state only after its first step
    return {
        "model": model, "optim": optim,
        "sched": torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5),
        "gen": torch.Generator().manual_seed(seed),
        "data": StatefulDataLoader(list(range(64)), batch_size=8, shuffle=True,
                                   generator=torch.Generator().manual_seed(seed)),
        "epoch": seed,
    }


def _train(state: dict[str, Any], steps: int) -> None:
    it = iter(state["data"])
    for _ in range(steps):
        batch = next(it).float()
        state["optim"].zero_grad()
        state["model"](batch[:, None].expand(-1, 64)).pow(2).mean().backward()
        state["optim"].step()
        state["sched"].step()
        torch.randint(0, 10, (3,), generator=state["gen"])


def _storage_bytes(tree: Any) -> int:
    """Bytes of the distinct storages of ``tree``'s tensors (what staging copies)."""
    seen = {}
    for t in iter_tensors(tree):
        s = t.untyped_storage()
        seen[(str(s.device), s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def _prepared(saver: Any) -> dict[int, int]:
    """The first slot's staging buffers, data_ptr -> bytes (private heap buffers, or views of a
    process writer's shared-memory arena)."""
    allocator = saver._slots[0].buffers.allocator
    buffers = allocator._buffers.values() if hasattr(allocator, "_buffers") else allocator._views
    return {b.data_ptr(): b.nbytes() for b in buffers if b.nbytes()}


def _buffer_ptrs(saver: Any) -> set[int]:
    return set(_prepared(saver))


def _record_staged(saver: Any, slot_index: int = 0) -> list[set[int]]:
    """Record the storages each staging into slot ``slot_index`` copied into."""
    buffers = saver._slots[slot_index].buffers
    stage = buffers.stage
    seen: list[set[int]] = []

    def recording(tree: Any) -> Any:
        staged, stats = stage(tree)
        seen.append({t.untyped_storage().data_ptr() for t in iter_tensors(staged) if t.numel()})
        return staged, stats

    buffers.stage = recording
    return seen


def _assert_saved_equals(path: Any, state: dict[str, Any]) -> None:
    saved = torch.load(path, weights_only=True)["state"]
    live_model = state["model"].state_dict()
    assert saved["model"].keys() == live_model.keys()
    for key, value in live_model.items():
        assert torch.equal(saved["model"][key], value), key
    live_optim = state["optim"].state_dict()
    assert saved["optim"]["param_groups"] == live_optim["param_groups"]
    for index, entry in live_optim["state"].items():
        for name, value in entry.items():
            assert torch.equal(saved["optim"]["state"][index][name], value), (index, name)
    assert saved["sched"] == state["sched"].state_dict()
    assert torch.equal(saved["gen"], state["gen"].get_state())
    assert saved["epoch"] == state["epoch"]


def _snapshot_at(directory: Any, step: int) -> None:
    state = _state(0)
    _train(state, step)
    with snapkeep.Checkpointer(directory) as ckpt:
        ckpt.save(step, state)


@pytest.mark.parametrize("writer_name", ["ThreadWriter", "ProcessWriter"])
def test_after_load_the_first_save_copies_into_the_prefaulted_buffers(
        tmp_path: Any, writer_name: str) -> None:
    _snapshot_at(tmp_path, 3)
    state = _state(1)
    writer = getattr(writing, writer_name)(timeout_s=60)
    with snapkeep.Checkpointer(tmp_path, writer=writer) as ckpt:
        assert ckpt.load(into=state) == 3
        saver = writer._saver
        # resumed: nothing prepared until training runs again (the optimizer's first step)
        assert saver._slots == [] and saver._prefaulted.is_set()
        _train(state, 1)  # the step's post-hook starts the prefault thread
        assert saver._prefaulted.wait(60)
        assert len(saver._slots) == 1 and saver._slots[0].handle is None
        expected = _storage_bytes(ckpt._payload(4, state))
        assert sum(_prepared(saver).values()) == expected > 64 * 64 * 4 * 3
        prepared = _buffer_ptrs(saver)
        staged_into = _record_staged(saver)

        handle = ckpt.save(4, state)
        assert handle.staged.result(timeout=60).allocated_bytes == 0  # it only copied
        assert len(staged_into) == 1 and staged_into[0] and staged_into[0] <= prepared
        handle.wait(timeout_s=60)
        _assert_saved_equals(tmp_path / "ckpt_4", state)

        _train(state, 1)
        handle = ckpt.save(5, state)  # later saves reuse the same single set of buffers
        assert handle.staged.result(timeout=60).allocated_bytes == 0
        assert len(saver._slots) == 1 and _buffer_ptrs(saver) == prepared
        handle.wait(timeout_s=60)
        _assert_saved_equals(tmp_path / "ckpt_5", state)


def test_a_save_during_the_prefault_waits_for_it_and_is_exact(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _snapshot_at(tmp_path, 3)
    release, started = threading.Event(), threading.Event()
    real_prefault = staging.prefault

    def held_prefault(buffers: Any, tree: Any) -> int:
        started.set()
        assert release.wait(60)
        return real_prefault(buffers, tree)

    monkeypatch.setattr(staging, "prefault", held_prefault)
    state = _state(1)
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        assert ckpt.load(into=state) == 3
        saver = ckpt.writer._saver
        _train(state, 1)
        assert started.wait(60)  # the prefault thread is running, held before it allocates
        assert not saver._prefaulted.is_set()
        prepared_slot = saver._slots[0]
        staged_into = _record_staged(saver)
        result: dict[str, Any] = {}

        def save() -> None:
            try:
                result["handle"] = ckpt.save(4, state)
            except BaseException as e:  # noqa: BLE001 -- re-raised below, on the test thread
                result["error"] = e

        saver_thread = threading.Thread(target=save)
        saver_thread.start()
        saver_thread.join(0.5)
        assert saver_thread.is_alive() and staged_into == []  # waiting, nothing copied
        assert prepared_slot.handle is not None  # it holds the slot being prepared
        release.set()
        saver_thread.join(60)
        assert not saver_thread.is_alive() and "error" not in result
        handle = result["handle"]
        assert handle.staged.result(timeout=60).allocated_bytes == 0
        assert len(staged_into) == 1 and staged_into[0] <= _buffer_ptrs(saver)
        assert saver._slots == [prepared_slot]
        handle.wait(timeout_s=60)
        _assert_saved_equals(tmp_path / "ckpt_4", state)


def test_a_first_run_prepares_the_buffers_after_the_first_step(tmp_path: Any) -> None:
    state = _state(0)
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        assert ckpt.load(into=state) is None  # nothing to resume: as the extension, prepared
        saver = ckpt.writer._saver             # once Adam has state (its first step)
        assert saver._slots == []
        _train(state, 1)
        assert saver._prefaulted.wait(60) and len(saver._slots) == 1
        handle = ckpt.save(1, state)
        assert handle.staged.result(timeout=60).allocated_bytes == 0
        handle.wait(timeout_s=60)
        _assert_saved_equals(tmp_path / "ckpt_1", state)


def test_load_leaves_a_stateful_loader_alone_when_no_optimizer_steps(tmp_path: Any) -> None:
    # a prefault from load() itself would call state_dict(), which builds the loader's iterator
    # (drawing its seeds) before the loop's iter(loader): not done without an optimizer
    state = {"model": torch.nn.Linear(4, 4),
             "data": StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True)}
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        assert ckpt.load(into=state) is None
        assert state["data"]._iterator is None
        assert ckpt.writer._saver._slots == []


def test_without_optimizers_the_buffers_are_prepared_at_load(tmp_path: Any) -> None:
    state = {"weights": torch.arange(4096.0), "model": torch.nn.Linear(32, 32)}
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        assert ckpt.load(into=state) is None
        saver = ckpt.writer._saver
        assert saver._prefaulted.wait(60) and len(saver._slots) == 1
        assert sum(_prepared(saver).values()) == _storage_bytes(ckpt._payload(0, state))
        handle = ckpt.save(1, state)
        assert handle.staged.result(timeout=60).allocated_bytes == 0
        handle.wait(timeout_s=60)
    saved = torch.load(tmp_path / "ckpt_1", weights_only=True)["state"]
    assert torch.equal(saved["weights"], state["weights"])


def test_a_synchronous_writer_prepares_nothing(tmp_path: Any) -> None:
    _snapshot_at(tmp_path, 3)
    state = _state(1)
    writer = writing.SimpleWriter()
    with snapkeep.Checkpointer(tmp_path, writer=writer) as ckpt:
        assert ckpt.load(into=state) == 3
        _train(state, 1)
        assert writer._saver._prefaulted.is_set() and writer._saver._slots == []
        ckpt.save(4, state)
    _assert_saved_equals(tmp_path / "ckpt_4", state)


def test_a_forgotten_checkpointer_is_not_kept_alive_by_the_pending_prefault(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # the preparation waits in the optimizer's step hook; that hook must not hold the
    # Checkpointer (a notebook cell run again takes over a forgotten one once it is collected)
    state = _state(0)
    writer = writing.ThreadWriter(timeout_s=60)
    ckpt = snapkeep.Checkpointer(tmp_path, writer=writer)
    loaded = ckpt.load(into=state)  # not inside an assert: pytest keeps its operands
    assert loaded is None
    del ckpt
    gc.collect()
    assert "garbage-collected without close()" in caplog.text  # its __del__ ran
    writer.finalize()
    _train(state, 1)  # the hook finds no open Checkpointer: nothing prepared, nothing raised
    assert writer._saver._slots == [] and writer._saver._prefaulted.is_set()
