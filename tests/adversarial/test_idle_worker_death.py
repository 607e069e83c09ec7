"""The process writers' worker killed (SIGKILL: the OOM killer, an operator) while idle between
snapshots, not inside a save (``tests/writing/test_faults.py`` covers mid-save and
right-after-commit). The next snapshot must still commit, whole and verified, with no error
surfacing and no temp file or shared-memory arena left; a later one gets a fresh worker, and
``finalize`` after a death with nothing pending raises nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from snapkeep import writing
from snapkeep.store import open_store

WRITERS = [pytest.param(writing.ProcessWriter, id="ProcessWriter"),
           pytest.param(writing.ProcessQueueWriter, id="ProcessQueueWriter")]


def _state(i: int) -> dict[str, Any]:
    return {"w": torch.full((300_000,), float(i)), "step": i}


def _kill_idle_worker(writer: Any) -> int:
    pid = writer._saver.runner.pid
    assert pid is not None and pid != os.getpid()
    worker = psutil.Process(pid)
    os.kill(pid, signal.SIGKILL)
    worker.wait(timeout=30)  # dead (and reaped or a zombie) before the next call
    return int(pid)


def _check(out: Path, names: list[str]) -> None:
    store = open_store(str(out), "s{step}")
    entries = store.entries()
    assert sorted(e.name for e in entries) == sorted(names)
    for entry in entries:
        assert store.verify(entry) is not None  # raises on a size or checksum mismatch
        state = torch.load(out / entry.name, weights_only=True)
        i = int(entry.name[1:])
        assert torch.equal(state["w"], torch.full((300_000,), float(i))) and state["step"] == i
    assert sorted(os.listdir(out)) == sorted([".snapkeep", *names])  # no temp file
    assert sorted(os.listdir(out / ".snapkeep")) == sorted(f"{n}.json" for n in names)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("writer_cls", WRITERS)
def test_a_worker_killed_while_idle_costs_no_snapshot(writer_cls: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    writer = writer_cls(out_dir=str(out), start_method="forkserver", timeout_s=60)
    try:
        writer("s1", str(out), _state(1))
        writer.wait(timeout_s=60)
        dead = _kill_idle_worker(writer)

        state = _state(2)
        writer("s2", str(out), state)  # to the dead worker: written all the same
        state["w"].add_(100.0)  # the snapshot keeps the values of the call
        writer.wait(timeout_s=60)
        writer("s3", str(out), _state(3))
        writer.wait(timeout_s=60)
        fresh = writer._saver.runner.pid
        assert fresh is not None and fresh != dead

        _kill_idle_worker(writer)  # and with nothing pending, finalize raises nothing
    finally:
        writer.finalize()
    writer.finalize()
    _check(out, ["s1", "s2", "s3"])
