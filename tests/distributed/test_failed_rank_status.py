"""The run status names an error raised on a rank other than 0: on 2 gloo ranks with
``extensions.preemption``, rank 1 raises in its 5th iteration; rank 0 hears of it at the same
iteration's agreement, raises ``RankFailedError`` naming rank 1, and records ``failed`` with
rank 1's error in ``.snapkeep/status.json``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed

from snapkeep.session import run_status
from support.ranks import finish, start

WORKER = Path(__file__).with_name("failing_rank_worker.py")
TIMEOUT_S = 120

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


@pytest.mark.parametrize("fail_rank", [1, 0])
def test_an_error_on_one_rank_is_recorded_as_failed_with_that_ranks_error(tmp_path, fail_rank):
    out = tmp_path / "out"
    began = time.monotonic()
    procs = start(WORKER, 2, [str(tmp_path / "init"), str(out), str(fail_rank)])
    outputs = finish(procs, TIMEOUT_S)
    elapsed_s = time.monotonic() - began
    assert [p.returncode for p in procs] == [1, 1], outputs
    assert f"raised ValueError: boom on rank {fail_rank}" in outputs[fail_rank], outputs
    other = outputs[1 - fail_rank]
    # the other rank fails at the same iteration, naming the failing rank and its error
    assert f"raised RankFailedError: training (iteration 5) failed on rank(s) [{fail_rank}]: " \
           f"rank {fail_rank}: ValueError: boom on rank {fail_rank}" in other, outputs
    assert elapsed_s < 60, outputs  # promptly, not after the 60 s collective timeout
    status = run_status(str(out))
    assert status is not None and status.state == "failed", outputs
    # rank 0's own error as raised; another rank's named
    expected = "ValueError: boom on rank 0" if fail_rank == 0 else \
        "rank 1: ValueError: boom on rank 1"
    assert status.reason == expected, status
    assert status.world_size == 2 and status.step == 4 + (fail_rank == 1), status
