"""``torchrun --standalone``, killed and rerun with the same command and the tier's default job
name, resumes from RAM and ends bit-identical (issue 25, item 1).

torchrun draws a new ``TORCHELASTIC_RUN_ID`` at every ``--standalone`` launch. Before, the tier
was named after it: the rerun never found its RAM (it resumed from storage, step 3, silently)
and each launch left one more tier in the tmpfs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed
from memory_tier_torchrun_worker import UNTIL, build, train

from support.ranks import rank_env

WORKER = Path(__file__).with_name("memory_tier_torchrun_worker.py")

pytestmark = [pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


def _torchrun(base: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=1", str(WORKER), str(base)], env=rank_env(),
                          capture_output=True, text=True, timeout=180, start_new_session=True)


def test_a_killed_torchrun_standalone_job_rerun_resumes_from_ram(tmp_path: Path) -> None:
    killed = _torchrun(tmp_path)
    assert killed.returncode != 0 and (tmp_path / "killed").exists(), killed.stderr[-3000:]
    first = json.loads((tmp_path / "killed").read_text())
    assert len([t for t in first["tiers"] if t.startswith("snapkeep-")]) == 1, first
    rerun = _torchrun(tmp_path)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["run_id"] != first["run_id"]  # a new launch id: the tier is found anyway
    assert (report["start"], report["source"]) == (4, "own")  # RAM's step 4, not storage's 3
    model, optimizer = build()
    for iteration in range(UNTIL):
        train(model, optimizer, iteration)
    assert report["weights"] == [p.detach().flatten().tolist() for p in model.parameters()]
    assert report["tiers_left"] == []  # the finished run removed its tier
