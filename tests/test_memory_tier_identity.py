"""The memory tier belongs to the training, not to the launch, and is private (issue 25, items
1 and 2), in one process:

- a launcher's per-launch id (``TORCHELASTIC_RUN_ID``, drawn anew by ``torchrun --standalone``)
  never names the tier: a rerun finds its RAM, a crash loop leaves one tier, not one per launch;
- two trainings sharing a run id, or an explicit ``job=``, never resume each other's RAM (one
  log line, and the stale RAM is replaced);
- a tier of the same training left under another name is removed by the run that replaces it;
- directories ``0700``, files ``0600``; a planted symlink named as the tier is never written or
  removed through; hostile owner records (FIFO, malformed JSON of any shape, oversized) never
  block or crash the tier's start or ``snapkeep ls --memory``.

The second-uid checks are in ``test_memory_tier_second_user.py``; ``torchrun --standalone``
end to end in ``tests/distributed/test_memory_tier_torchrun.py``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from snapkeep import writing
from snapkeep._core.tiers.memory_store import job_id, tier_dir
from snapkeep.cli import cli
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

TEMPLATE = "snapshot_iter_{.iteration}"


def _run(out: Path, root: Path, until: int, *, job: str | None = None,
         finish: bool = False) -> tuple[ExtensionsManager, Any]:
    """A run with the tier every 2 iterations and storage every 3, trained to ``until``; it then
    "dies" (no finalize, its last RAM snapshot committed) unless ``finish``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=8, out_dir=str(out),
                                writer=writing.SimpleWriter(out_dir=str(out)))
    manager.extend(ext.snapshot(filename=TEMPLATE, autoload=True), trigger=(3, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=2, replicas=0, root=str(root), job=job))
    manager.extend(tier)
    manager.start_extensions()
    while manager.iteration < until:
        g = torch.Generator().manual_seed(manager.iteration)
        with manager.run_iteration():
            optimizer.zero_grad()
            model(torch.randn(8, 4, generator=g)).pow(2).sum().backward()
            optimizer.step()
    tier.wait()
    if finish:
        manager.finalize()
    return manager, tier


def _tiers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("snapkeep-"))


def test_a_new_launch_id_each_run_still_finds_the_tier_and_leaves_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash loop under torchrun --standalone: every launch draws a new run id. Before, each
    launch named a new tier: the rerun resumed from storage and the tmpfs grew by one tier per
    launch."""
    out, root = tmp_path / "out", tmp_path / "shm"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    _run(out, root, 5)
    for launch, until, ram_step in (("launch-2", 7, 4), ("launch-3", 7, 6)):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", launch)
        _, tier = _run(out, root, until)
        assert tier.restored is not None and tier.restored.source == "own"
        assert tier.restored.step == ram_step
        assert _tiers(root) == [f"snapkeep-{job_id(str(out), TEMPLATE)}"]


def test_a_tier_of_the_same_training_under_an_old_name_is_replaced(tmp_path: Path) -> None:
    """``job=`` set from a per-launch id by hand: the rerun cannot find the old tier, and
    removes it (its owner is dead: no tmpfs growth) rather than leaving it forever."""
    out, root = tmp_path / "out", tmp_path / "shm"
    for launch in ("a", "b", "c"):
        _run(out, root, 5, job=f"launch-{launch}")  # recent: not removed for its age
        # the owner is this very process (no other pid): recorded dead for the check below
        record = root / f"snapkeep-launch-{launch}" / "owner-rank0.json"
        body = json.loads(record.read_text())
        record.write_text(json.dumps(dict(body, pid=2**22 + 12345)))
    assert _tiers(root) == ["snapkeep-launch-c"]


def test_two_trainings_with_one_run_id_never_share_ram(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same ``--rdzv-id`` (so the same TORCHELASTIC_RUN_ID), two out_dirs: before, the second
    resumed the first one's RAM state (iteration 4) at its very first start."""
    root = tmp_path / "shm"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "shared-id")
    _run(tmp_path / "a", root, 5)
    manager, tier = _run(tmp_path / "b", root, 0)
    assert tier.restored is None and manager.iteration == 0


def test_ram_of_another_training_under_the_same_job_is_ignored_with_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An explicit ``job=`` shared by two out_dirs: the RAM records its training, and the
    other one ignores it (one warning naming both), replaces it, and starts fresh."""
    root = tmp_path / "shm"
    _run(tmp_path / "a", root, 5, job="shared")
    with caplog.at_level(logging.WARNING, logger="snapkeep"):
        manager, tier = _run(tmp_path / "b", root, 2, job="shared")
    assert tier.restored is None and manager.iteration == 2
    lines = [r.getMessage() for r in caplog.records if "ignored and replaced" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "a") in lines[0] and str(tmp_path / "b") in lines[0]
    _, again = _run(tmp_path / "b", root, 3, job="shared")  # b's own RAM now: resumed
    assert again.restored is not None and again.restored.step == 2


def _modes(top: Path) -> dict[str, str]:
    return {str(p.relative_to(top)): oct(stat.S_IMODE(p.lstat().st_mode))
            for p in [top, *top.rglob("*")]}


def test_directories_are_0700_and_files_0600(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    os.umask(old := os.umask(0o022))
    try:
        _run(out, root, 5)
    finally:
        os.umask(old)
    top = Path(tier_dir(str(root), job_id(str(out), TEMPLATE)))
    modes = _modes(top)
    assert {m for p, m in modes.items() if (top / p).is_dir()} == {"0o700"}, modes
    assert {m for p, m in modes.items() if not (top / p).is_dir()} == {"0o600"}, modes
    assert any("ram_iter_4" in p for p in modes) and any("owner-rank0" in p for p in modes)


def test_a_planted_symlink_named_as_the_tier_is_never_written_or_removed_through(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out, root, victim = tmp_path / "out", tmp_path / "shm", tmp_path / "victim"
    root.mkdir()
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    link = Path(tier_dir(str(root), job_id(str(out), TEMPLATE)))
    link.symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="snapkeep"):
        manager, tier = _run(out, root, 5, finish=True)
    assert manager.iteration == 5 and tier.restored is None
    assert sorted(os.listdir(victim)) == ["keep.txt"] and link.is_symlink()
    assert any("takes no RAM snapshots" in r.getMessage() and "symlink" in r.getMessage()
               for r in caplog.records)


HOSTILE_RECORDS: dict[str, bytes | None] = {
    "fifo": None,
    "list": b"[1, 2]",
    "string": b'"owner"',
    "pid-a-string": json.dumps({"pid": "12", "host": "h", "time": 1.0, "rank": 0}).encode(),
    "time-a-dict": json.dumps({"pid": 12, "host": "h", "time": {}, "rank": 0}).encode(),
    "rank-a-list": json.dumps({"pid": 12, "host": "h", "time": 1.0, "rank": [0]}).encode(),
    "host-a-number": json.dumps({"pid": 12, "host": 7, "time": 1.0, "rank": 0}).encode(),
    "world-a-bool": json.dumps({"pid": 12, "host": "h", "time": 1, "rank": 0,
                                "world": True}).encode(),
    "nan-time": b'{"pid": 12, "host": "h", "time": NaN, "rank": 0}',
    "deep": b"[" * 100_000,
    "not-utf8": b"\xff\xfe{}",
    "oversized": b"{" + b" " * 100_000 + b"}",
}


@pytest.mark.timeout(60)  # a FIFO record hung the tier's start before: bounded here
def test_hostile_owner_records_never_block_or_crash_the_start_or_ls(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    for name, data in HOSTILE_RECORDS.items():
        other = Path(tier_dir(str(root), f"other-{name}"))
        other.mkdir(parents=True, mode=0o700)  # recent: kept (not stale), records read
        record = other / "owner-rank0.json"
        if data is None:
            os.mkfifo(record, 0o600)
        else:
            record.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="snapkeep"):
        manager, _ = _run(out, root, 3)
    assert manager.iteration == 3
    skipped = {r.getMessage().split("snapkeep-other-")[1].split("/")[0]
               for r in caplog.records if "owner record" in r.getMessage()}
    assert skipped == set(HOSTILE_RECORDS)
    result = CliRunner().invoke(cli, ["ls", "--memory", str(root), "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)["tiers"]
    assert {t["dir"].rsplit("/", 1)[1] for t in listed} >= {
        f"snapkeep-other-{n}" for n in HOSTILE_RECORDS}
    assert all(t["owners"] == [] for t in listed if "other-" in t["dir"])


def test_a_root_others_can_rename_in_is_refused_at_start(tmp_path: Path) -> None:
    """Without the sticky bit, another user could rename our tier away and put theirs in its
    place between our checks: such a root is refused, naming why."""
    from snapkeep.tiers import NotPrivateError

    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(NotPrivateError, match="sticky bit"):
        _run(tmp_path / "out", root, 1)
    os.chmod(root, 0o1777)
    manager, _ = _run(tmp_path / "out2", root, 1)
    assert manager.iteration == 1
