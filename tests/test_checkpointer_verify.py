"""``Checkpointer.verify(step)``: a committed snapshot read back against the checksums recorded
at its commit (what ``snapkeep.ray.report`` requires before it tells Ray of a step), for single
files and sharded directories."""

from __future__ import annotations

import pathlib

import pytest
import torch

import snapkeep
from snapkeep.errors import NoValidSnapshotError, SnapshotCorruptError


def _flip_a_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_verify_reads_the_snapshot_back_and_names_what_is_wrong(tmp_path: pathlib.Path,
                                                                 sharded: bool) -> None:
    model = torch.nn.Linear(64, 64)
    with snapkeep.Checkpointer(tmp_path, sharded=sharded) as ckpt:
        ckpt.save(2, {"model": model})
        ckpt.wait()
        path = pathlib.Path(ckpt.verify(2))
        assert path == tmp_path / "ckpt_2"
        with pytest.raises(NoValidSnapshotError, match=r"no committed snapshot of step 3.*\[2\]"):
            ckpt.verify(3)
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            ckpt.verify(-1)
        victim = max((p for p in path.glob("*.distcp")), key=lambda p: p.stat().st_size) \
            if sharded else path
        _flip_a_byte(victim)
        with pytest.raises(SnapshotCorruptError, match=victim.name):
            ckpt.verify(2)
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.verify(2)
