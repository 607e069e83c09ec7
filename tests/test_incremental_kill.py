"""Kill -9 at random moments of incremental snapshots (start-up and its sweep, blob writes,
the skeleton and manifest, retention): never a dangling reference, every rerun resumes the
newest snapshot bit-identically. ``benchmarks/checkpointer_kill_trials.py`` runs 200 trials."""

from __future__ import annotations

import pathlib

import pytest

from support.incremental_trials import run_trials


@pytest.mark.timeout(240)
def test_random_kills_never_leave_a_dangling_reference(tmp_path: pathlib.Path) -> None:
    tally = run_trials(4, steps=6, seed=3, root=tmp_path)
    assert tally.failures == []
    assert tally.trials == 4 and tally.resumes_checked >= 2
