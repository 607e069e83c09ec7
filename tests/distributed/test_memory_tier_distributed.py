"""The memory tier's failure matrix with real gloo ranks: one training run is SIGKILLed after
iteration 5 (RAM at step 4 with peer copies, storage at step 3); copies of what it left are
damaged in one way each, and the ranks restart on each copy. With DISTRIBUTED snapshots (a
replicated model) and with SHARDED ones (FSDP2: each rank's RAM snapshot holds its local shards).

- process lost (tiers intact): every rank resumes step 4 from its own RAM;
- node lost (one rank's tmpfs wiped): that rank takes its copy from a peer's RAM; no storage
  snapshot file is opened;
- node lost and the peer copy corrupt: detected, the next source is used (another peer with 4
  ranks, storage with 2);
- two neighbours lost (4 ranks, 2 replicas): RAM still covers every rank; with 2 ranks (every
  node lost): storage;
- storage lost: RAM resumes and persists step 4 to storage first;
- another world size (SHARDED, 2 ranks -> 1): storage, resharded;
- a rank missing at the agreement: the others raise CollectiveTimeoutError (no hang);
- rank 0's RAM snapshots made from the writer's staged copy (``distributed-lent``, no second
  staging) and replicated: node 0 lost, rank 0 resumes from rank 1's copy of them.

Each resumed run trains to iteration 8 and must be bit-identical to an uninterrupted run; every
finished run removes its tiers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch.distributed
from memory_tier_worker import reference

from support.ranks import finish, run, start

WORKER = Path(__file__).with_name("memory_tier_worker.py")

pytestmark = [pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


def _killed_run(base: Path, world: int, replicas: int, kind: str = "distributed") -> None:
    procs = start(WORKER, world, [str(base / "init"), str(base), "train", str(replicas), kind])
    outputs = finish(procs, 180)
    for proc, output in zip(procs, outputs):
        assert proc.returncode == -signal.SIGKILL, output
    (base / "init").unlink(missing_ok=True)


def _corrupt_copy(base: Path, holder: int, source: int) -> None:
    path = next((base / f"node{holder}" / "snapkeep-test" / f"rank{holder}" /
                 f"peer{source}").glob("ram_iter_*"))
    data = bytearray(path.read_bytes())
    data[60] ^= 0xFF
    path.write_bytes(bytes(data))


def _resume(killed: Path, tmp: Path, name: str, world: int, replicas: int,
            damage: Any, kind: str = "distributed") -> list[dict[str, Any]]:
    base = tmp / name
    shutil.copytree(killed, base)
    _moved_with_storage(base)
    damage(base)
    run(WORKER, world, [str(base / "init"), str(base), "resume", str(replicas), kind],
        timeout_s=180)
    return [json.loads((base / f"report_rank{r}.json").read_text()) for r in range(world)]


def _moved_with_storage(base: Path) -> None:
    """The copy of the killed run is the same training moved: its owner records name the
    copy's storage (a RAM snapshot is resumed only by the training its record names)."""
    for record in base.glob("node*/snapkeep-*/owner-rank*.json"):
        body = json.loads(record.read_text())
        record.write_text(json.dumps(dict(body, out_dir=str(base / "storage"))))


def _wipe(*nodes: int) -> Any:
    def damage(base: Path) -> None:
        for n in nodes:
            shutil.rmtree(base / f"node{n}")
    return damage


def _check(reports: list[dict[str, Any]], *, start: int, sources: list[str | None],
           storage_read: bool, kind: str = "distributed") -> None:
    expected = reference(kind)
    assert [r["start"] for r in reports] == [start] * len(reports)
    assert [r["source"] for r in reports] == sources
    for r in reports:
        assert r["weights"] == expected  # bit-identical to the uninterrupted run
        assert r["tier_left"] == []  # a finished run removes its tier
        if not storage_read:
            assert r["storage_reads"] == []
    if storage_read:
        assert any(r["storage_reads"] for r in reports)


@pytest.fixture(scope="module")
def killed2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("killed2")
    _killed_run(base, 2, 1)
    return base


@pytest.fixture(scope="module")
def killed2_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("killed2_sharded")
    _killed_run(base, 2, 1, "sharded")
    return base


_TWO_RANKS = [
    ("process_lost", lambda b: None, 4, ["own", "own"], False),
    ("node_lost", _wipe(1), 4, ["own", "peer0"], False),
    ("node_lost_peer_copy_corrupt", lambda b: (_wipe(1)(b), _corrupt_copy(b, 0, 1)), 3,
     [None, None], True),
    ("storage_lost", lambda b: shutil.rmtree(b / "storage"), 4, ["own", "own"], False),
    ("every_node_lost", _wipe(0, 1), 3, [None, None], True),
]


@pytest.mark.parametrize(("name", "damage", "start", "sources", "storage_read"), _TWO_RANKS)
def test_two_ranks(killed2: Path, tmp_path: Path, name: str, damage: Any, start: int,
                   sources: list[str | None], storage_read: bool) -> None:
    reports = _resume(killed2, tmp_path, name, 2, 1, damage)
    _check(reports, start=start, sources=sources, storage_read=storage_read)
    if start == 4:  # the RAM step was written to storage before training went on
        assert "snapshot_iter_4" in reports[0]["persisted"]


@pytest.mark.parametrize(("name", "damage", "start", "sources", "storage_read"), [
    pytest.param(*case, marks=[] if case[0] in ("node_lost", "node_lost_peer_copy_corrupt")
                 else [pytest.mark.slow]) for case in _TWO_RANKS])
def test_two_ranks_sharded(killed2_sharded: Path, tmp_path: Path, name: str, damage: Any,
                           start: int, sources: list[str | None], storage_read: bool) -> None:
    """SHARDED snapshots under FSDP2: each rank restores its own local shards from RAM (own or a
    peer's copy) in place; storage is the fallback; a RAM step newer than storage is committed
    to storage as a sharded snapshot before training goes on."""
    reports = _resume(killed2_sharded, tmp_path, name, 2, 1, damage, "sharded")
    _check(reports, start=start, sources=sources, storage_read=storage_read, kind="sharded")
    if start == 4:
        assert "snapshot_iter_4" in reports[0]["persisted"]
        assert os.path.exists(tmp_path / name / "storage" / "snapshot_iter_4" /
                              ".snapkeep-commit.json")  # a committed sharded snapshot


def test_ram_snapshots_from_the_writers_staged_copy_resume_from_a_peer(tmp_path: Path) -> None:
    """DISTRIBUTED with a ThreadWriter and storage on the tier's steps: the saver rank's tier
    stages nothing itself (it serialises the writer's copy, the per-rank RNG states left out),
    the other rank stages its own; node 0 lost, rank 0 resumes step 4 from rank 1's copy of
    it, reading no storage, and trains on bit-identically."""
    killed = tmp_path / "killed"
    killed.mkdir()
    _killed_run(killed, 2, 1, "distributed-lent")
    staged_own = [json.loads((killed / f"train_rank{r}.json").read_text())["tier_staged_own"]
                  for r in range(2)]
    assert staged_own == [False, True]
    reports = _resume(killed, tmp_path, "node0_lost", 2, 1, _wipe(0), "distributed-lent")
    _check(reports, start=4, sources=["peer1", "own"], storage_read=False,
           kind="distributed-lent")


def test_sharded_on_another_world_size_resumes_from_storage_resharded(
        killed2_sharded: Path, tmp_path: Path) -> None:
    """RAM holds each rank's shards for 2 ranks; a restart on 1 rank uses storage, which DCP
    reshards (the tier is not consulted: its world size differs)."""
    [report] = _resume(killed2_sharded, tmp_path, "one_rank", 1, 0, lambda b: None, "sharded")
    assert report["start"] == 3 and report["source"] is None
    assert report["storage_reads"]  # the sharded snapshot's files
    assert report["weights"] == reference("sharded")


@pytest.fixture(scope="module")
def killed4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("killed4")
    _killed_run(base, 4, 2)
    return base


@pytest.mark.slow
@pytest.mark.parametrize(("name", "damage", "sources"), [
    ("node_lost", _wipe(1), ["own", "peer2", "own", "own"]),
    ("node_lost_peer_copy_corrupt", lambda b: (_wipe(1)(b), _corrupt_copy(b, 2, 1)),
     ["own", "peer3", "own", "own"]),
    ("two_neighbours_lost", _wipe(1, 2), ["own", "peer3", "peer3", "own"]),
])
def test_four_ranks_resume_from_peers_ram_without_reading_storage(
        killed4: Path, tmp_path: Path, name: str, damage: Any, sources: list[str]) -> None:
    reports = _resume(killed4, tmp_path, name, 4, 2, damage)
    _check(reports, start=4, sources=sources, storage_read=False)


def test_a_rank_missing_at_the_agreement_is_an_error_not_a_hang(killed2: Path,
                                                                 tmp_path: Path) -> None:
    base = tmp_path / "missing"
    shutil.copytree(killed2, base)
    procs = start(WORKER, 2, [str(base / "init"), str(base), "missing", "1"])
    outputs = finish(procs, 120)
    assert (base / "report_rank0.json").exists(), (
        f"rank 0 wrote no report (exit {procs[0].returncode}):\n{outputs[0]}\n"
        f"rank 1 (exit {procs[1].returncode}):\n{outputs[1]}")
    report = json.loads((base / "report_rank0.json").read_text())
    assert report["outcome"] == "CollectiveTimeoutError"
    assert report["elapsed_s"] < 60 + 10  # the tier's timeout_s bounds it


def test_a_rank_whose_tier_name_is_planted_still_copies_and_resumes_from_its_peer(
        tmp_path: Path) -> None:
    """Node 0's tier name is a planted symlink: rank 0 takes no RAM snapshot of its own (never
    writing through it) but still sends its copy to rank 1 and receives rank 1's, so neither
    rank waits on the other. Killed and rerun: rank 0 resumes step 4 from rank 1's copy,
    bit-identical; the symlink and its empty target are left as they were."""
    base, victim = tmp_path / "planted", tmp_path / "victim"
    (base / "node0").mkdir(parents=True)
    victim.mkdir()
    (base / "node0" / "snapkeep-test").symlink_to(victim)
    _killed_run(base, 2, 1)
    run(WORKER, 2, [str(base / "init"), str(base), "resume", "1"], timeout_s=180)
    reports = [json.loads((base / f"report_rank{r}.json").read_text()) for r in range(2)]
    assert [(r["start"], r["source"]) for r in reports] == [(4, "peer1"), (4, "own")]
    assert all(r["weights"] == reference() and r["storage_reads"] == [] for r in reports)
    assert [r["tier_left"] for r in reports] == [["snapkeep-test"], []]
    assert (base / "node0" / "snapkeep-test").is_symlink() and os.listdir(victim) == []
