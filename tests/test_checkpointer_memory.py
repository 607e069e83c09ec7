"""``snapkeep.Checkpointer(..., memory=MemoryTier(...))`` in one process: what RAM lacks falls
back to storage and says why, a corrupt RAM copy is never loaded, a resume from RAM newer than
storage persists it first, and ``close`` removes the tier only when storage holds its newest
step. (The kill -9 and torchrun scenarios: tests/distributed/test_checkpointer_memory_kill.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import snapkeep
from support.killing import assert_identical


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.1)}


def _train(state: dict[str, Any], ckpt: snapkeep.Checkpointer, steps: range) -> None:
    for step in steps:
        state["model"](torch.randn(2, 4)).pow(2).sum().backward()
        state["optim"].step()
        state["optim"].zero_grad()
        ckpt.save(step, state)


def _open(tmp_path: Path, **kwargs: Any) -> snapkeep.Checkpointer:
    memory = snapkeep.MemoryTier(every=1, root=str(tmp_path / "shm"))
    return snapkeep.Checkpointer(tmp_path / "ckpt", every=2, memory=memory, **kwargs)


def _ram_files(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "shm").glob("snapkeep-*/rank0/ram_iter_*"))


def test_a_corrupt_ram_copy_falls_back_to_storage_and_says_why(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    state = _state(0)
    with _open(tmp_path) as ckpt:
        assert ckpt.load(into=state) is None
        _train(state, ckpt, range(1, 4))  # storage: 2; RAM: 3
        expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    ram = _ram_files(tmp_path)
    assert [p.name for p in ram] == ["ram_iter_3"]  # newer than storage: kept by close
    data = bytearray(ram[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    ram[0].write_bytes(bytes(data))
    capfd.readouterr()
    fresh = _state(1)
    with _open(tmp_path) as ckpt:
        assert ckpt.load(into=fresh) == 2
    err = capfd.readouterr().err
    assert "snapkeep: memory tier (" in err and "no step held in RAM by every rank is at " \
        "least storage's newest (step 2) (rank 0's copy of step 3 from own: " in err, err
    assert "checksum" in err and "snapkeep: resuming from ckpt_2 (step 2)" in err, err
    assert not torch.equal(fresh["model"].weight, expected["weight"])  # step 2's, not 3's


def test_a_ram_step_newer_than_storage_is_resumed_and_persisted(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    state = _state(0)
    with _open(tmp_path) as ckpt:
        ckpt.load(into=state)
        _train(state, ckpt, range(1, 4))
    capfd.readouterr()
    fresh = _state(1)
    with _open(tmp_path) as ckpt:
        assert ckpt.load(into=fresh) == 3
        assert ckpt.all_steps() == [2, 3]  # step 3 persisted to storage first
        assert_identical(state["model"].state_dict(), fresh["model"].state_dict())
        assert_identical(state["optim"].state_dict()["state"],
                         fresh["optim"].state_dict()["state"])
    err = capfd.readouterr().err
    assert err.count("snapkeep: resuming") == 1 and \
        "snapkeep: resuming from RAM step 3 (own copy; storage's newest: 2) in " in err, err
    assert _ram_files(tmp_path) == []  # storage holds its newest step (3): close removed it


def test_close_keeps_the_tier_when_the_loop_raised(tmp_path: Path) -> None:
    state = _state(0)
    with pytest.raises(RuntimeError, match="boom"), _open(tmp_path) as ckpt:
        ckpt.load(into=state)
        _train(state, ckpt, range(1, 3))  # storage and RAM: 2
        raise RuntimeError("boom")
    assert [p.name for p in _ram_files(tmp_path)] == ["ram_iter_2"]


def test_memory_must_be_a_memory_tier(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="memory must be a snapkeep.MemoryTier"):
        snapkeep.Checkpointer(tmp_path / "ckpt", memory=50)  # type: ignore[arg-type]
