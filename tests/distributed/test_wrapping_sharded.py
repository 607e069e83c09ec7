"""FSDP2 in the wrapping matrix: a SHARDED snapshot (DCP, keys canonical through
``get_state_dict``) saved from FSDP2 on 2 gloo ranks resumes into a compiled DDP model on 1 rank,
and one saved from compiled DDP on 1 rank resumes into FSDP2 on 2 ranks: the same full
parameters and Adam moments, by canonical name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed

from support.ranks import finish, start

WORKER = Path(__file__).with_name("wrapping_worker.py")
TIMEOUT_S = 120

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


def _run(tmp_path: Path, tag: str, world_size: int, mode: str, wrapping: str) -> dict:
    report = tmp_path / f"{tag}.pt"
    procs = start(WORKER, world_size, [str(tmp_path / f"init_{tag}"), str(tmp_path / "out"),
                                       str(report), mode, wrapping])
    outputs = finish(procs, TIMEOUT_S)
    assert [p.returncode for p in procs] == [0] * world_size, outputs
    return torch.load(report, weights_only=True)


@pytest.mark.parametrize(("saved", "loaded"), [((2, "fsdp2"), (1, "compiled_ddp")),
                                               ((1, "compiled_ddp"), (2, "fsdp2"))],
                         ids=["fsdp2-to-compiled_ddp", "compiled_ddp-to-fsdp2"])
def test_sharded_snapshot_resumes_across_fsdp2(tmp_path, saved, loaded):
    want = _run(tmp_path, "save", saved[0], "save", saved[1])
    got = _run(tmp_path, "load", loaded[0], "load", loaded[1])
    assert (got["loaded"], got["iteration"]) == ("snapshot_iter_2", 2)
    assert list(want["params"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for part in ("params", "exp_avg"):
        assert got[part].keys() == want[part].keys()
        assert all(torch.equal(got[part][k], want[part][k]) for k in want[part]), part
