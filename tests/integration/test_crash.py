"""SIGKILL during saves: a real training process is killed at random points of its saves and
restarted; each restart must load the newest committed snapshot, never a torn one, and find no
temporary file left. The driver and the victim live in ``tools/`` (``crash_trials.py`` runs 100+
trials and prints the counts); here a shorter series runs in the suite."""

from __future__ import annotations

import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")
sys.path.insert(0, os.path.abspath(TOOLS))
from crash_trials import run_trials  # noqa: E402

TRIALS = 10


@pytest.mark.timeout(240)
def test_sigkill_during_saves_resumes_from_the_newest_committed_snapshot(tmp_path):
    report = run_trials(TRIALS, str(tmp_path), seed=1234)
    assert report.failures == []
    assert report.trials == TRIALS
    assert report.killed_during_save >= TRIALS // 2  # the kills really hit saves
    assert report.files_checked >= TRIALS
