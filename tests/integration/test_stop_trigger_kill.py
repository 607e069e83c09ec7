"""Stop triggers make the same decisions at the same iterations after a kill and rerun (issue
25 item 4): an EarlyStoppingTrigger checked per epoch, the loop SIGKILLed right after an
epoch-end snapshot and rerun, stops at the uninterrupted run's iteration (18) with the same
weights and trigger state (before the fix: 21, one check later: the observation of the
snapshot's own iteration never reached the restored trigger)."""

from __future__ import annotations

import pathlib
import runpy

import pytest

from support.killing import assert_identical, final_state, kill_after

SCRIPT = pathlib.Path(__file__).with_name("stop_trigger_loop.py")


@pytest.mark.parametrize("killed_at", [12])  # the epoch-end snapshot of epoch 4
def test_early_stopping_stops_where_the_uninterrupted_run_did(tmp_path, killed_at, monkeypatch):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    for d in (reference, killed):
        d.mkdir()
    script = tmp_path / SCRIPT.name
    script.write_text(SCRIPT.read_text().replace("sys.argv[1]", "'.'"))
    monkeypatch.chdir(reference)  # the uninterrupted run in this process (the same ops)
    runpy.run_path(str(script), run_name="__main__")
    assert final_state(reference)["iteration"] == 18
    groups: list[int] = []
    kill_after(script, killed, killed_at, groups)
    assert not (killed / "final.pt").exists()
    rerun = run_to_end_iterations(script, killed)
    assert rerun[0] == killed_at + 1, rerun  # resumed from the epoch-end snapshot
    assert_identical(final_state(reference), final_state(killed), f"killed at {killed_at}")


def run_to_end_iterations(script: pathlib.Path, cwd: pathlib.Path) -> list[int]:
    from support import killing, zygote

    run = zygote.run(killing.zygote_for_loops(), str(script), [], cwd=str(cwd),
                     env=killing.env(), timeout=killing.BOUND_S)
    assert run.returncode == 0, run.stderr
    return [int(line.split()[1]) for line in run.stdout.splitlines()
            if line.startswith("iteration ")]
