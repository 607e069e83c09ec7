"""No second staging: at a step where the snapshot extension and the memory tier both fire, the
tier serialises the copy the snapshot's writer staged (a :class:`~snapkeep.staging.StagedLoan`)
instead of copying the state again; the writer does not stage over a copy while it is lent.

The race itself (a lent copy read only once the overlapped staging's verdict is given) is tried
200 times per writer in ``tests/writing/test_overlap_race.py`` (``tier=True``)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from snapkeep import writing
from snapkeep._core.tiers.memory_store import MemoryStore, job_id, tier_dir
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext
from support.killing import assert_identical

TEMPLATE = "snapshot_iter_{.iteration}"
WAIT_S = 30


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(512, 512)  # 1 MiB: staged in the background (overlap)
        self.b = torch.nn.Linear(512, 4)


def _run(out: Path, root: Path, writer: Any, *, tier_first: bool = False,
         every: int = 3, storage_every: int = 3) -> tuple[ExtensionsManager, Net, Any]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=12, out_dir=str(out),
                                writer=writer)
    tier = ext.memory_tier(ext.MemoryTier(every=every, replicas=0, root=str(root)))
    if tier_first:
        manager.extend(tier)
    manager.extend(ext.snapshot(filename=TEMPLATE, autoload=True),
                   trigger=(storage_every, "iteration"))
    if not tier_first:
        manager.extend(tier)
    return manager, model, tier


def _step(manager: ExtensionsManager, model: Net) -> None:
    optimizer = manager.optimizers["main"]
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(manager.iteration))
    with manager.run_iteration():
        optimizer.zero_grad()
        model.b(torch.relu(model.a(x))).pow(2).sum().backward()
        optimizer.step()


def _train(manager: ExtensionsManager, model: Net, until: int) -> None:
    manager.start_extensions()
    while manager.iteration < until:
        _step(manager, model)


def _ram(out: Path, root: Path) -> tuple[int, Any]:
    held = MemoryStore(str(root), job_id(str(out), TEMPLATE), 0).newest_verified()
    assert held is not None
    return held.step, torch.load(held.path, weights_only=True)


WRITERS = {
    "ThreadWriter": lambda out: writing.ThreadWriter(out_dir=out, timeout_s=WAIT_S),
    "ThreadQueueWriter": lambda out: writing.ThreadQueueWriter(out_dir=out, timeout_s=WAIT_S),
    "ProcessWriter": lambda out: writing.ProcessWriter(out_dir=out, timeout_s=WAIT_S),
}


@pytest.mark.parametrize("writer_name", sorted(WRITERS))
def test_a_step_both_take_is_staged_once_and_resumed_from(tmp_path: Path,
                                                          writer_name: str) -> None:
    """Steps 3 and 6: one staging (the writer's), the RAM copy holds what the durable snapshot
    holds, and a restart resumes from that RAM copy and trains on bit-identically."""
    out, root = tmp_path / "out", tmp_path / "shm"
    writer = WRITERS[writer_name](str(out))
    manager, model, tier = _run(out, root, writer)
    _train(manager, model, 6)
    tier.wait()
    writer.wait()
    assert tier.engine._buffers is None  # the tier never staged a copy of its own
    step, ram = _ram(out, root)
    assert step == 6
    assert_identical(ram, torch.load(out / "snapshot_iter_6", weights_only=True))
    writer.finalize()  # the process "dies" here: no manager.finalize, the tier stays

    resumed, model2, tier2 = _run(out, root, WRITERS[writer_name](str(out)))
    resumed.start_extensions()
    assert resumed.iteration == 6
    assert tier2.restored is not None and tier2.restored.source == "own"
    ref, ref_model, _ = _run(tmp_path / "ref", tmp_path / "ref_shm", writing.SimpleWriter(
        out_dir=str(tmp_path / "ref")))
    _train(ref, ref_model, 12)
    ref.finalize()
    while resumed.iteration < 12:
        _step(resumed, model2)
    resumed.finalize()
    assert_identical(model2.state_dict(), ref_model.state_dict())
    assert not os.path.exists(tier_dir(str(root), job_id(str(out), TEMPLATE)))


def test_a_step_only_the_tier_takes_is_staged_by_the_tier(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    writer = writing.ThreadWriter(out_dir=str(out), timeout_s=WAIT_S)
    manager, model, tier = _run(out, root, writer, every=2, storage_every=4)
    _train(manager, model, 2)  # the tier alone
    tier.wait()
    assert tier.engine._buffers is not None
    buffers = tier.engine._buffers
    _train(manager, model, 4)  # both: borrowed
    tier.wait()
    writer.wait()
    assert tier.engine._buffers is buffers  # its own buffers were not used again at step 4
    step, ram = _ram(out, root)
    assert step == 4
    assert_identical(ram, torch.load(out / "snapshot_iter_4", weights_only=True))
    manager.finalize()


@pytest.mark.parametrize("case", ["SimpleWriter", "tier registered first"])
def test_the_tier_stages_its_own_copy_when_there_is_none_to_borrow(
        tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    """A ``SimpleWriter`` stages nothing (it writes the live state in the call), and a tier
    registered before the snapshot runs first: the tier copies the state itself (the same
    bytes); the second case is logged at start, naming the fix."""
    out, root = tmp_path / "out", tmp_path / "shm"
    writer: Any = (writing.SimpleWriter(out_dir=str(out)) if case == "SimpleWriter"
                   else writing.ThreadWriter(out_dir=str(out), timeout_s=WAIT_S))
    with caplog.at_level(logging.INFO, logger="snapkeep.training.extensions._memory_tier"):
        manager, model, tier = _run(out, root, writer, tier_first=case != "SimpleWriter")
        _train(manager, model, 3)
    tier.wait()
    writer.wait()
    assert tier.engine._buffers is not None
    assert ("registered before the snapshot extension" in caplog.text) == (
        case != "SimpleWriter")
    assert_identical(_ram(out, root)[1], torch.load(out / "snapshot_iter_3", weights_only=True))
    manager.finalize()


@pytest.mark.parametrize("on_full", ["block", "skip", "replace"])
def test_the_writer_does_not_stage_over_a_lent_copy(tmp_path: Path, on_full: str) -> None:
    """One slot (``max_pending=1``): the next snapshot waits while the committed copy is lent,
    then stages over it; the loan saw the first snapshot's values throughout. A lent slot holds
    no snapshot in flight, so with ``on_full='skip'`` or ``'replace'`` too the next snapshot
    waits for the return (bounded: the tier's serialisation) instead of being dropped (a tier
    serialising a large state used to make every other snapshot of a ``skip`` writer vanish,
    logged as '0 snapshot(s) still in flight')."""
    writer = writing.ThreadWriter(out_dir=str(tmp_path), timeout_s=WAIT_S, max_pending=1,
                                  on_full=on_full)
    t = torch.full((1000,), 1.0)
    writer("a", str(tmp_path), {"t": t})
    handle = writer.last_handle
    assert handle is not None
    loan = writer.lend_staged(handle)
    assert loan is not None
    loan.wait_staged()
    handle.committed.result(WAIT_S)
    t.fill_(2.0)
    second = threading.Thread(target=writer, args=("b", str(tmp_path), {"t": t}))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waits for the loan (not skipped, nothing replaced)
    assert torch.equal(loan.tree["t"], torch.full((1000,), 1.0))
    loan.release()
    second.join(WAIT_S)
    assert not second.is_alive()
    assert writer.last_handle is not None and writer.last_handle is not handle  # taken
    loan.release()  # a second return does nothing
    writer.wait()
    assert torch.equal(torch.load(tmp_path / "b", weights_only=True)["t"], t)
    assert writer.lend_staged(handle) is None  # staged over by "b"
    writer.finalize()
    assert writing.SimpleWriter(out_dir=str(tmp_path)).lend_staged(handle) is None


def test_a_process_writer_finalized_with_a_loan_out_keeps_the_copy_until_returned(
        tmp_path: Path) -> None:
    """The staged copy of a process writer lives in its shared-memory arena: finalizing the
    writer while it is lent leaves the arena to the loan, and the return unlinks it."""
    writer = writing.ProcessWriter(out_dir=str(tmp_path), timeout_s=WAIT_S)
    t = torch.arange(300_000, dtype=torch.float32)
    writer("a", str(tmp_path), {"t": t})
    handle = writer.last_handle
    assert handle is not None
    loan = writer.lend_staged(handle)
    assert loan is not None
    name = writer._saver._slots[0].buffers.allocator.name
    assert name is not None and os.path.exists(f"/dev/shm/{name}")
    writer.finalize()
    assert os.path.exists(f"/dev/shm/{name}")  # kept for the loan
    loan.wait_staged()
    assert torch.equal(loan.tree["t"], t)
    loan.release()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert torch.equal(torch.load(tmp_path / "a", weights_only=True)["t"], t)
