"""Preemption with a deadline through every door (issue 31 item 3, issue 33 item 1): the ppe
``ExtensionsManager`` loop with ``extensions.preemption``, Lightning's ``Trainer`` and the Hugging
Face ``Trainer``, each on a really slow durable write (``door_deadline_worker.py``), get a real
SIGTERM after step 6 and a real grace timer that SIGKILLs the process group when it runs out.

- a grace shorter than this run's measured durable write: no durable write is started (these
  doors have no memory tier here: nothing new is committed), the status records
  ``committed_to: none`` and the exit code is 79; the rerun resumes from step 4 bit-identical;
- a grace that fits: the step is committed to storage before the kill, exit 143; the rerun
  resumes from it bit-identical;
- with the ppe or Lightning door's memory tier, the short grace commits the step to RAM only
  (exit 79) and the rerun resumes it from RAM bit-identical.

Each door's uninterrupted run is made once per session; every run is forked by a zygote that
imported torch, Lightning and transformers once (tests/support/zygote.py).

(The Checkpointer's own trials, with its memory tier: test_preemption_deadline.py.)"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import snapkeep
from support import deadline_trials, zygote

WORKER = pathlib.Path(__file__).with_name("door_deadline_worker.py")
STEPS = 10
PAUSE_AT = 6  # the signal arrives after step 6; the preemption is agreed at step 7
# each durable write of the preempted run takes about 4 s more: the measured estimate is then
# at least 4 x 1.25 + 1 = 6 s, more than any time left of the 4 s grace (whatever the load:
# a slower machine only makes the write, and so the estimate, longer)
SLOW_S = "4"
SHORT_GRACE_S = 4.0  # the exit fits, the measured durable write (>= 4 s x 1.25 + 1) does not
LONG_GRACE_S = 60.0
NAMES = {"ppe": "ckpt_{}", "lightning": "ckpt_{}", "hf": "checkpoint-{}"}


def _zygote() -> zygote.Zygote:
    """Every run of the worker is forked by the session's zygote, which imported torch,
    Lightning and transformers once (tests/support/zygote.py): a real process of its own, with
    the same signals, exit codes and grace timer, without the ~10 s import of each run."""
    return zygote.frameworks(deadline_trials.env({}))


def _run(door: str, root: pathlib.Path, extra: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return zygote.run(_zygote(), str(WORKER), [door, str(root / "out"), str(STEPS)],
                      cwd=os.getcwd(), env=deadline_trials.env(extra or {}),
                      timeout=deadline_trials.BOUND_S)


_REFERENCES: dict[str, dict[str, object]] = {}


def _reference(door: str, factory: pytest.TempPathFactory) -> dict[str, object]:
    """The door's uninterrupted run's final model (once per session)."""
    if door not in _REFERENCES:
        root = factory.mktemp(f"reference-{door}")
        done = _run(door, root)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        _REFERENCES[door] = deadline_trials.final_model(root)
    return _REFERENCES[door]


def _trial(door: str, root: pathlib.Path, grace_s: float, *, code: int, where: str,
           kept: list[str], resumed: str, extra: dict[str, str] | None = None,
           at: int = PAUSE_AT + 1) -> None:
    """Signal the door's training after step 6 with a ``grace_s`` timer; check the exit code,
    where the status says step 7 went, the snapshots left (``kept``, no temp file), and that
    the rerun says ``resumed`` (its resume line) and ends as ``reference.pt``."""
    root.mkdir()
    outcome = deadline_trials.signal_with_grace(
        [sys.executable, str(WORKER), door, str(root / "out"), str(STEPS)],
        deadline_trials.env({"PAUSE_AT": str(PAUSE_AT), "SLOW_S": SLOW_S,
                             "SNAPKEEP_GRACE_S": str(grace_s), **(extra or {})}),
        f"paused {PAUSE_AT} ", grace_s, zygote=_zygote())
    assert (outcome.returncode, outcome.killed) == (code, False), outcome.output[-3000:]
    status = snapkeep.session.run_status(str(root / "out"))
    assert status is not None and (status.state, status.step) == ("preempted", at), status
    assert status.preemption["committed_to"] == where, status
    assert status.preemption["deadline_from"] == "$SNAPKEEP_GRACE_S"
    assert status.preemption["durable_estimate_s"] > float(SLOW_S), status  # measured
    assert status.snapshots == ((kept[-1],) if where == "storage" else ()), status
    assert "SIGTERM" in status.reason
    out = root / "out"
    assert _snapshots(out) == kept and _temps(out) == [], sorted(out.rglob("*"))
    rerun = _run(door, root, extra)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    assert resumed in rerun.stderr, rerun.stderr[-3000:]


def _snapshots(out: pathlib.Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith("."))


def _temps(out: pathlib.Path) -> list[str]:
    return [str(p) for p in out.rglob("*") if "tmp" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("door", ["ppe", "lightning", "hf"])
def test_a_short_grace_starts_no_durable_write_and_a_fitting_one_commits_before_the_kill(
        door: str, tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    name = NAMES[door].format
    reference = _reference(door, tmp_path_factory)
    _trial(door, tmp_path / "short", SHORT_GRACE_S, code=79, where="none", kept=[name(4)],
           resumed=f"resuming from {name(4)}")
    assert deadline_trials.identical(deadline_trials.final_model(tmp_path / "short"),
                                     reference)
    _trial(door, tmp_path / "fits", LONG_GRACE_S, code=143, where="storage",
           kept=[name(4), name(7)], resumed=f"resuming from {name(7)}")
    assert deadline_trials.identical(deadline_trials.final_model(tmp_path / "fits"), reference)


@pytest.mark.slow
@pytest.mark.parametrize("door", ["ppe", "lightning", "hf"])
def test_a_short_grace_commits_the_step_to_the_doors_memory_tier_only(
        door: str, tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same decision with a door that has a memory tier (ppe: ``extensions.memory_tier``;
    Lightning: ``SnapkeepCheckpointIO(memory=...)``; HF: ``SnapkeepTrainer(memory=...)``; step
    7 (HF: 6) is not one the tier keeps on its own, every 4): it goes to RAM only, no durable
    write is started (exit 79), and the rerun resumes it from RAM bit-identical."""
    reference = _reference(door, tmp_path_factory)
    tier = tmp_path / "shm"
    tier.mkdir(mode=0o700)
    # the owned save puts its callback after the user's (Pause): it agrees at step 6's end
    at = PAUSE_AT if door == "hf" else PAUSE_AT + 1
    _trial(door, tmp_path / "short", SHORT_GRACE_S, code=79, where="ram",
           kept=[NAMES[door].format(4)], resumed=f"resuming from RAM step {at}",
           extra={"TIER_ROOT": str(tier)}, at=at)
    assert deadline_trials.identical(deadline_trials.final_model(tmp_path / "short"),
                                     reference)
