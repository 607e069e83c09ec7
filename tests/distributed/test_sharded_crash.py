"""SIGKILL at random moments of a 2-rank SHARDED job (a snapshot every iteration), a few
trials of ``tools/sharded_crash_trials.py`` (which runs 20 and more): a directory without the
commit marker is never listed or loaded, every listed snapshot verifies and holds (loaded with
DCP's own tools) exactly the parameters of an uninterrupted run at its step, and every restart
resumes from the newest committed snapshot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import sharded_crash_trials  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]

TRIALS = 3
ITERS = 40


def test_sigkill_at_random_moments_never_leaves_a_loadable_uncommitted_snapshot():
    results = sharded_crash_trials.trials(TRIALS, seed=1, iters=ITERS, kill_within_s=3.0,
                                          log=lambda line: None)
    assert results["failures"] == [], results
    assert results["trials"] == TRIALS
    # the trials did exercise restarts from committed snapshots, not only fresh starts
    assert results["snapshots_checked"] > 0 and results["resumes_checked"] >= TRIALS - 1, results


def test_a_save_killed_writing_its_in_progress_mark_leaves_no_temp_for_the_next(
        tmp_path: Path) -> None:
    """A kill while rank 0 writes the in-progress mark leaves a directory holding only the
    mark's temp file (seen once in 30 kill tests of the sharded Checkpointer): the sweep cannot
    prove the directory snapkeep's, so it keeps it, but removes the dead writer's temp, which a
    later save of the same step would otherwise commit beside its shards."""
    from snapkeep._core.storage._temps import TEMP_MARKER, base36, temp_basename
    from snapkeep.distributed import ShardedStore
    from snapkeep.store import resolve_storage

    storage, path = resolve_storage(str(tmp_path))
    directory = tmp_path / "snapshot_iter_12"
    directory.mkdir()
    head, tail = temp_basename(".snapkeep-in-progress").rsplit(TEMP_MARKER, 1)
    host, _, token = tail.split(".")  # a temp of a writer (this host) whose pid is gone
    stale = directory / f"{head}{TEMP_MARKER}{host}.{base36(2**22 + 12345)}.{token}"
    stale.write_bytes(b"")
    (directory / "notes.txt").write_bytes(b"mine")
    store = ShardedStore(storage, path, "snapshot_iter_{step}")
    assert store.sweep() == [str(stale)]
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]
