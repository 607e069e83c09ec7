"""The memory tier as a layer on the engine session (``snapkeep.tiers.TieredSession``): the
session's interface, whose ``save`` also keeps due steps in RAM and whose ``resume`` takes the
newer of RAM (verified) and storage. The doors' end-to-end cells: the matrix's tier scenario."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import torch

from snapkeep.session import Session
from snapkeep.store import open_store
from snapkeep.tiers import MemoryTier, TieredSession
from snapkeep.writing import SimpleWriter


def _session(tmp_path: pathlib.Path) -> TieredSession:
    directory = str(tmp_path / "ckpt")
    tier = MemoryTier(every=1, replicas=0, root=str(tmp_path / "shm"))
    return TieredSession(Session(open_store(directory, "s_{step}")), tier,
                         directory=directory, template="s_{step}", quiet=True)


def _resume(tmp_path: pathlib.Path) -> tuple[int | None, Any]:
    session = _session(tmp_path)
    session.open()
    got: dict[str, Any] = {}
    try:
        entry = session.resume(lambda e, state: got.update(state=state))
    finally:
        session.close()
    return (None if entry is None else entry.step), got.get("state")


def test_save_keeps_due_steps_in_ram_and_resume_takes_the_newer_copy(
        tmp_path: pathlib.Path) -> None:
    """Step 1 saved (storage and RAM), step 2 kept in RAM only: the next session resumes RAM's
    step 2; with the RAM lost, storage's step 1."""
    session = _session(tmp_path)
    session.open()
    writer = SimpleWriter()
    writer.initialize(str(tmp_path / "ckpt"))
    try:
        session.save(writer, "s_1", str(tmp_path / "ckpt"), {"w": torch.ones(2)}, step=1,
                     metrics={})
        session.keep(2, lambda: {"w": torch.full((2,), 2.0)})
        session.wait()
    finally:
        writer.finalize()
        session.close()  # storage's 1 < RAM's 2: the tier is kept
    step, state = _resume(tmp_path)
    assert step == 2 and torch.equal(state["w"], torch.full((2,), 2.0))
    shutil.rmtree(tmp_path / "shm")
    step, state = _resume(tmp_path)
    assert step == 1 and torch.equal(state["w"], torch.ones(2))
