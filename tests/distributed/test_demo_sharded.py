"""``torchrun -m snapkeep.demo_sharded``: FSDP2 on 2 gloo ranks with SHARDED snapshots, resumed
on 1 rank (resharded) and finished there."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch.distributed

from support.ranks import rank_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]

TIMEOUT_S = 180


def _torchrun(nproc: int, out: str, iterations: int) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "snapkeep.demo_sharded", "--out", out,
               "--iterations", str(iterations), "--snapshot-interval", "10",
               "--timeout-s", "60"]
    done = subprocess.run(command, env=rank_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S, start_new_session=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_sharded_demo_resumes_on_another_number_of_ranks(tmp_path):
    out = str(tmp_path / "demo")
    first = _torchrun(2, out, 20)
    assert "on 2 rank(s)" in first and "starting fresh" in first
    assert "done: iteration 20" in first
    assert sorted(os.listdir(out)) == [".snapkeep", "snapshot_iter_10", "snapshot_iter_20"]
    second = _torchrun(1, out, 30)
    assert "resumed from snapshot_iter_20 (iteration 20) on 1 rank(s)" in second, second
    assert "done: iteration 30" in second
    accuracy = float(re.search(r"accuracy (\d\.\d+)\n?$", second.strip()).group(1))
    assert accuracy > 0.3  # trained, not a fresh model (chance is 0.1)
