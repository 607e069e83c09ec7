"""Overlapped staging under hand edits that race the background copy (issue 18, item 1).

A loop under snapkeep's ``ExtensionsManager`` snapshots every iteration and edits every
parameter and optimizer-state tensor by hand, in place under ``no_grad``, so that each tensor's
value *is* the iteration: after iteration ``k`` every tensor holds ``k`` at the snapshot call
(``k - 1`` after an ``idle`` iteration). A committed ``snap_k`` whose tensors do not all hold
that value is torn. The edits come at varying moments
relative to the previous snapshot's background copy:

- ``after``: only after the optimizer step (which validates the copy): the snapshot is published;
- ``idle``: no step and no edit (the end of ``run_iteration`` or the next snapshot validates);
  that snapshot holds the previous iteration's values;
- ``held``: while the copy is held on a gate (``_overlap_before_copy``), then again while it runs;
- ``free``: at once, the copy free-running beside the edits;
- ``during``: the gate is opened and the edits start at once, racing the copy's ``memmove``.

The last three drop that snapshot (its counters moved before the verdict), with one warning for
the whole run; overlap then turns off, the next snapshot is copied in the call and is exact, and
the test turns overlap back on to race again. Every writer that stages is run; each committed
file is checked by a post-commit hook as it commits (retention keeps the disk use small).

With a memory tier on the same trigger (``tier``), the tier borrows each snapshot's staged copy
instead of staging its own (no second staging): every RAM snapshot it commits is checked the same
way as it is committed, and it must commit exactly the steps the writer committed (a dropped
snapshot drops the RAM snapshot of that step).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from snapkeep import writing
from snapkeep._core.save.shm import reclaim_dead_arenas
from snapkeep._core.tiers.memory_store import MemoryStore
from snapkeep.training import ExtensionsManager, extensions
from support.writer_gates import CopyGate

WAIT_S = 60
#: Iteration k edits per MODES[k % 7]; each racing mode follows an overlapped snapshot (the one
#: after a drop is copied in the call).
MODES = ("after", "held", "after", "idle", "free", "after", "during")
#: Snapshots per writer; the process writers pass each one through the worker process as well.
SNAPSHOTS = 200


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(256, 1024))  # 1 MiB: staged in the background
        self.b = torch.nn.Parameter(torch.zeros(256, 1024))
        self.scale = torch.nn.Parameter(torch.zeros(8))  # small: copied in the call



@pytest.fixture
def one_torch_thread():
    """Intra-op threads make each 1 MiB ``fill_`` cost ~6 ms on a loaded 2-core machine (their
    spin-waits compete with the writer); the race needs none of them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.parameters())
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


@torch.no_grad()
def _fill(tensors: list[torch.Tensor], value: float) -> None:
    for t in tensors:
        t.fill_(value)


class Checker:
    """A post-commit hook: every committed file holds one moment, the iteration it is named for."""

    def __init__(self) -> None:
        self.at_call: dict[int, float] = {}  # step -> the value of every tensor at its call
        self.committed: list[int] = []
        self.torn: list[tuple[int, str, float, float]] = []

    def __call__(self, record) -> None:
        self.check(torch.load(record.path, weights_only=True), record.step)

    def check(self, state, step: int) -> None:
        tensors = dict(state["models"]["main"])
        for key, entry in state["optimizers"]["main"]["state"].items():
            tensors.update({f"state/{key}/{k}": v for k, v in entry.items()
                            if isinstance(v, torch.Tensor)})
        assert len(tensors) == 6  # 3 parameters, 3 momentum buffers
        for name, t in tensors.items():
            if not bool((t == self.at_call[step]).all()):
                self.torn.append((step, name, float(t.min()), float(t.max())))
        self.committed.append(step)


@pytest.mark.parametrize(("writer_name", "tier"), [
    ("ThreadWriter", False), ("ThreadQueueWriter", False), ("ProcessWriter", False),
    ("ProcessQueueWriter", False), ("ThreadWriter", True), ("ProcessWriter", True)])
def test_no_torn_snapshot_under_racing_hand_edits(tmp_path, writer_name, tier, one_torch_thread,
                                                  monkeypatch):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # creates the momentum buffers
    writer = getattr(writing, writer_name)(out_dir=str(tmp_path), timeout_s=WAIT_S)
    checker = Checker()
    writer.add_post_commit_hook(checker)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=SNAPSHOTS,
                                writer=writer)
    ext = extensions.snapshot(filename="snap_{.iteration}", n_retains=2)
    manager.extend(ext, trigger=(1, "iteration"))
    ram = Checker()
    if tier:
        ram.at_call = checker.at_call
        commit_state = MemoryStore.commit_state

        def checked(store, step, data, write):
            ram.check(torch.load(io.BytesIO(data), weights_only=True), step)
            return commit_state(store, step, data, write)

        monkeypatch.setattr(MemoryStore, "commit_state", checked)
        memory = extensions.memory_tier(extensions.MemoryTier(
            every=1, replicas=0, root=str(tmp_path / "shm")))
        manager.extend(memory)
    tensors = _tensors(model, optimizer)
    _fill(tensors, 0)
    expected_drops: list[int] = []
    gate: CopyGate | None = None
    previous_gate: CopyGate | None = None
    overlapped = False  # the previous snapshot's deferred part is copied in the background
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for k in range(1, SNAPSHOTS + 1):
            mode = MODES[k % len(MODES)]
            # the next iteration races a gated copy: hold this iteration's snapshot copy
            next_mode = MODES[(k + 1) % len(MODES)]
            gate = CopyGate(WAIT_S) if next_mode in ("held", "during") else None
            with manager.run_iteration():
                if overlapped and mode not in ("after", "idle"):
                    expected_drops.append(k - 1)
                if mode == "held" and previous_gate is not None and overlapped:
                    assert previous_gate.entered.wait(WAIT_S)
                    _fill(tensors, -k)  # before the copy starts
                    previous_gate.open()
                    _fill(tensors, k + 0.5)  # while it runs
                elif mode == "during" and previous_gate is not None and overlapped:
                    assert previous_gate.entered.wait(WAIT_S)
                    previous_gate.open()
                    for _ in range(20):  # races the memmove of the same storages
                        _fill(tensors, -k)
                elif mode == "free":
                    _fill(tensors, -k)
                elif previous_gate is not None:
                    previous_gate.open()  # the copy was not overlapped: nothing to hold
                if mode == "idle":
                    checker.at_call[k] = checker.at_call.get(k - 1, 0.0)
                else:
                    optimizer.step()  # a safe point: waits for the copy, gives its verdict
                    _fill(tensors, k)  # the state of iteration k, at its snapshot call
                    checker.at_call[k] = k
                ext._overlap_before_copy = gate
            was_on = ext._overlap_on
            overlapped = not writer.last_handle.staged.done()
            if not was_on:
                assert not overlapped  # after a drop, the next snapshot is copied in the call
                ext._overlap_on = True  # race again
            if gate is not None and not overlapped:
                gate.open()
            previous_gate = gate
        assert manager._finalized  # the stop trigger finalized the manager: every verdict given
    assert checker.torn == [], f"{len(checker.torn)} torn: {checker.torn[:5]}"
    races = [w for w in warned if "Overlapped staging is now off" in str(w.message)]
    assert len(races) == 1 and issubclass(races[0].category, RuntimeWarning)
    assert sorted(checker.committed) == sorted(set(range(1, SNAPSHOTS + 1)) -
                                                set(expected_drops))
    assert len(expected_drops) >= SNAPSHOTS // 4
    if tier:  # the RAM snapshots: the same steps, none torn, none staged by the tier itself
        assert ram.torn == [], f"{len(ram.torn)} torn RAM snapshots: {ram.torn[:5]}"
        assert sorted(ram.committed) == sorted(checker.committed)
        assert memory.engine is not None and memory.engine._buffers is None
    print(f"{writer_name}: {len(checker.committed)} committed, {len(expected_drops)} dropped, "
          f"{len(checker.torn)} torn of {SNAPSHOTS} snapshots"
          + (f"; {len(ram.committed)} RAM snapshots, {len(ram.torn)} torn" if tier else ""))


TRAINER = """
    import concurrent.futures, os, signal, sys, torch
    from snapkeep import writing
    from snapkeep.training import ExtensionsManager, extensions
    model = torch.nn.Linear(512, 512, bias=False)  # 1 MiB: staged in the background
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    writer = getattr(writing, sys.argv[2])(out_dir=sys.argv[1], timeout_s=60)
    writer("warm", sys.argv[1], {"x": torch.zeros(1)})  # the worker is up: a commit is quick
    writer.wait()
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=3, writer=writer)
    manager.extend(extensions.snapshot(), trigger=(1, "iteration"))
    with manager.run_iteration(step_optimizers=["main"]):
        model(torch.ones(2, 512)).sum().backward()
    handle = writer.last_handle
    try:  # no safe point comes: the worker must not be handed the snapshot
        handle.committed.exception(timeout=float(sys.argv[3]))
        print("COMMITTED", flush=True)
    except concurrent.futures.TimeoutError:
        print("NOT VALIDATED, NOT COMMITTED", flush=True)
    os.killpg(os.getpid(), signal.SIGKILL)  # the trainer and its worker die before any verdict
"""


@pytest.mark.parametrize("writer_name", ["ProcessWriter"])  # ProcessQueueWriter: same gate
def test_a_trainer_killed_before_the_verdict_publishes_nothing(tmp_path, writer_name):
    """The write waits for the verdict: a trainer that dies before giving it (here 3 s after
    the call, long after the copy and a warm worker's commit time) leaves no snapshot."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(TRAINER), str(tmp_path), writer_name, "3"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        out, err = proc.communicate(timeout=WAIT_S * 2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        reclaim_dead_arenas()  # the killed trainer's staging arena, once its group is gone
    assert proc.returncode == -signal.SIGKILL, err
    assert out.strip() == "NOT VALIDATED, NOT COMMITTED", err
    assert (tmp_path / "warm").exists()
    assert not (tmp_path / "snapshot_iter_1").exists()
    assert not list(tmp_path.glob(".snapkeep/snapshot_iter_1*"))  # no manifest either
