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
