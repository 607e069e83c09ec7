"""``torchrun -m snapkeep.demo_sharded``: FSDP2 on 2 gloo ranks with SHARDED snapshots, resumed
on 1 rank (resharded) and finished there; with the memory tier on 4 ranks, a node loss resumed
from the peers' RAM without reading storage, bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed

from snapkeep import load_latest
from support.ranks import finish, rank_env, reports, start

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]

TIMEOUT_S = 180
DEMO_WORKER = Path(__file__).with_name("demo_sharded_worker.py")


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


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _demo(report_dir: Path, kill_at: int, out: Path, *extra: str) -> list[Any]:
    report_dir.mkdir()
    args = [_free_port(), str(report_dir), str(kill_at), "--out", str(out), "--iterations", "30",
            "--snapshot-interval", "10", "--timeout-s", "60", *extra]
    procs = start(DEMO_WORKER, 4, args)
    outputs = finish(procs, TIMEOUT_S)
    if kill_at:
        for proc, output in zip(procs, outputs):
            assert proc.returncode == -signal.SIGKILL, output
        return outputs
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank}: {output}"
    return reports(report_dir, "report", 4)


def test_sharded_demo_with_the_memory_tier_resumes_from_peers_ram_after_a_node_loss(
        tmp_path: Path) -> None:
    """4 ranks, FSDP2, ``--memory-every 4 --replicas 2``: the job is SIGKILLed at iteration 24
    (RAM 24 with peer copies, storage 20); rank 1's tmpfs is wiped (its node lost) and rank 2's
    copy of rank 1 corrupted. The rerun resumes step 24 from RAM -- rank 1 from rank 3's copy,
    rank 2's failing its checksum -- opening no storage file, persists step 24 to storage first,
    and ends bit-identical to an uninterrupted run without the tier."""
    out, root = tmp_path / "out", tmp_path / "shm"
    tier = ["--memory-every", "4", "--replicas", "2", "--memory-root", str(root)]
    _demo(tmp_path / "killed", 24, out, *tier)
    [job] = root.glob("snapkeep-*")
    shutil.rmtree(job / "rank1")  # node 1 lost
    [copy] = (job / "rank2" / "peer1").glob("ram_iter_*")
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF  # rank 2's copy of rank 1 damaged
    copy.write_bytes(bytes(data))

    resumed = _demo(tmp_path / "resumed", 0, out, *tier)
    assert [r["start"] for r in resumed] == [24] * 4
    assert [r["source"] for r in resumed] == ["own", "peer3", "own", "own"]
    assert [r["storage_reads"] for r in resumed] == [[]] * 4  # nothing saved read back
    assert os.path.exists(out / "snapshot_iter_24" / ".snapkeep-commit.json")  # persisted
    assert list(root.iterdir()) == []  # a finished run removes its tiers
    reference = _demo(tmp_path / "reference", 0, tmp_path / "ref")
    assert reference[0]["summary"]["iteration"] == resumed[0]["summary"]["iteration"] == 30
    got, expected = load_latest(out), load_latest(tmp_path / "ref")
    for part in ("models", "optimizers"):
        flat, flat_expected = _tensors(got[part]), _tensors(expected[part])
        assert flat.keys() == flat_expected.keys() and flat
        for key, value in flat_expected.items():
            assert torch.equal(flat[key], value), key  # bit-identical
    assert resumed[0]["summary"]["loss"] == reference[0]["summary"]["loss"]
    # retention continued the killed run after the RAM resume: as many snapshots kept as in
    # the uninterrupted run, none of the killed run's left behind
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("snapshot_iter_"))
    assert len(kept) == len([p for p in (tmp_path / "ref").iterdir()
                             if p.name.startswith("snapshot_iter_")]), kept


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items()
                for k, v in _tensors(value, f"{prefix}.{key}").items()}
    return {}
