"""Process-level behaviour, checked with real interpreters:

- an unfinalized writer never keeps the process from exiting, and its pending snapshot is
  committed by the exit drain (invariant 6: nothing hangs; nothing staged is silently lost);
- process writers work from a script without an ``if __name__ == '__main__':`` guard (``spawn``
  would otherwise re-run the script in the worker).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

EXIT_BOUND_S = 60  # generous for a loaded CI machine; a healthy run takes a few seconds

UNFINALIZED = textwrap.dedent("""
    import logging
    import sys
    import torch
    from snapkeep import writing

    logging.basicConfig(level=logging.WARNING)  # the exit drain logs what it waits for
    out = sys.argv[1]
    state = {"w": torch.arange(4096.0), "step": 3}
    queue_writer = writing.ThreadQueueWriter()
    process_writer = writing.ProcessWriter()
    queue_writer("thread_queue_snap", out, state)
    process_writer("process_snap", out, state)  # its worker is still starting: pending
    with torch.no_grad():
        state["w"].zero_()  # staged already: the files keep the values of the calls
    print("returned without finalize", flush=True)
""")

NO_MAIN_GUARD = textwrap.dedent("""
    import sys
    import torch
    from snapkeep import writing

    print("script body ran", flush=True)
    out = sys.argv[1]
    state = {"w": torch.arange(4096.0), "step": 3}
    process_writer = writing.ProcessWriter()
    queue_writer = writing.ProcessQueueWriter()
    process_writer("process_snap", out, state)
    queue_writer("process_queue_snap", out, state)
    process_writer.finalize()
    queue_writer.finalize()
    print("finalized", flush=True)
""")


def _run(args: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(  # raises TimeoutExpired (test fails) past the bound
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=EXIT_BOUND_S,
    )


def _assert_snapshot(path: str) -> None:
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(4096.0)) and loaded["step"] == 3


@pytest.mark.timeout(EXIT_BOUND_S + 30)
def test_unfinalized_writers_do_not_block_exit_and_drain(tmp_path: Any) -> None:
    out = tmp_path / "out"
    result = _run(["-c", UNFINALIZED, str(out)], cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["returned without finalize"]
    assert "pending snapshot" in result.stderr  # the exit drain said what it waited for
    assert sorted(os.listdir(out)) == [".snapkeep", "process_snap", "thread_queue_snap"]
    for name in ("process_snap", "thread_queue_snap"):
        _assert_snapshot(str(out / name))


@pytest.mark.timeout(EXIT_BOUND_S + 30)
def test_process_writers_work_from_a_script_without_main_guard(tmp_path: Any) -> None:
    script = tmp_path / "train_no_guard.py"
    script.write_text(NO_MAIN_GUARD)
    out = tmp_path / "out"
    result = _run([str(script), str(out)], cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    # the workers did not re-run the script: its body ran exactly once
    assert result.stdout.splitlines() == ["script body ran", "finalized"]
    assert sorted(os.listdir(out)) == [".snapkeep", "process_queue_snap", "process_snap"]
    for name in ("process_snap", "process_queue_snap"):
        _assert_snapshot(str(out / name))
