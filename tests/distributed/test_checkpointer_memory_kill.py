"""``snapkeep.Checkpointer(..., memory=MemoryTier(...))`` (issue 24): a plain loop killed with
SIGKILL after a RAM step newer than its last storage snapshot, rerun with the same command,
resumes from RAM (said once on stderr), reads no storage snapshot and ends bit-identical to an
uninterrupted run; in one process, and under ``torchrun --standalone`` with FSDP2 on 2 gloo
ranks where the killed rank's node RAM is lost too (its shards come from its peer's copy)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

from support import zygote
from support.killing import assert_identical
from support.ranks import PRELOAD, rank_env, run_torchrun_forked

WORKER = Path(__file__).with_name("checkpointer_memory_worker.py")
ITERS, KILL_AT = 10, 6  # storage every 4 steps (step 4), RAM every 2 (step 6)
BOUND_S = 180


def _python(base: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
    """``python WORKER ...``: a process of its own session, forked by the zygote that imported
    torch and snapkeep once (tests/support/zygote.py; the one the ranks' first is forked by)."""
    return zygote.run(zygote.shared(PRELOAD, rank_env(), "rank0"), str(WORKER),
                      [str(base), str(ITERS), str(kill_at)], cwd=os.getcwd(), env=rank_env(),
                      timeout=BOUND_S)


def _torchrun(base: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(WORKER), str(base), str(ITERS),
                           str(kill_at)], env=rank_env(), capture_output=True, text=True,
                          timeout=BOUND_S, start_new_session=True)


def _final(base: Path) -> dict[str, object]:
    import torch

    return torch.load(base / "final.pt", weights_only=True)


def _resumed(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("snapkeep: resuming")]


def test_a_killed_plain_loop_resumes_from_ram_bit_identical(tmp_path: Path) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir(), killed.mkdir()
    done = _python(reference, 0)
    assert done.returncode == 0, done.stderr[-3000:]
    first = _python(killed, KILL_AT)
    assert first.returncode == -9 and not (killed / "final.pt").exists(), first.stderr[-3000:]
    assert sorted(p.name for p in (killed / "ckpt").glob("ckpt_*")) == ["ckpt_4"]
    rerun = _python(killed, 0)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = _resumed(rerun.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        "snapkeep: resuming from RAM step 6 (own copy; storage's newest: 4) in "), lines
    report = json.loads((killed / "report0.json").read_text())
    assert report == {"resumed": KILL_AT, "reads": []}  # no storage snapshot opened
    assert_identical(_final(reference), _final(killed), "plain loop, RAM resume")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.timeout(4 * BOUND_S)
def test_torchrun_fsdp2_one_rank_killed_and_its_ram_lost_resumes_from_peer_copy(
        tmp_path: Path) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir(), killed.mkdir()
    # the uninterrupted run: the same ranks, forked with torchrun's environment (torchrun is
    # what the killed run and its rerun go through)
    run_torchrun_forked(WORKER, [str(reference), str(ITERS), "0"], timeout_s=BOUND_S)
    first = _torchrun(killed, KILL_AT)  # rank 1 SIGKILLs itself; the job dies
    assert first.returncode != 0 and not (killed / "final.pt").exists(), first.stderr[-3000:]
    tiers = list((killed / "shm").glob("snapkeep-*"))
    assert len(tiers) == 1 and (tiers[0] / "rank1").is_dir()
    shutil.rmtree(tiers[0] / "rank1")  # rank 1's node RAM is lost (rank 0's copy of it stays)
    (tiers[0] / "owner-rank1.json").unlink()
    rerun = _torchrun(killed, 0)  # the same command
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    lines = _resumed(rerun.stderr)
    assert lines == [f"snapkeep: resuming from RAM step 6 (own copies; rank 1 from rank 0's "
                     f"peer copy; storage's newest: 4) in {tiers[0]}"], rerun.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((killed / f"report{rank}.json").read_text())
        assert report == {"resumed": KILL_AT, "reads": []}, report  # no storage snapshot read
    assert_identical(_final(reference), _final(killed), "torchrun FSDP2, RAM resume")
