"""Shared-memory staging arenas: a SIGKILL of the whole process group (trainer, worker, resource
tracker) leaves the arena in /dev/shm; the next run's writer start unlinks it. Normal runs never
make the resource tracker warn about leaked segments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import snapkeep
from snapkeep._core.save.shm import ARENA_PREFIX, reclaim_dead_arenas
from support.subprocess_util import default_sigint

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")

TRAINER = """
    import sys, time, torch, snapkeep
    w = snapkeep.writing.ProcessWriter()
    w("snap", sys.argv[1], {"x": torch.ones(1 << 16)})
    w.wait()
    arena = w._saver._slots[0].buffers.allocator.name
    print("ARENA", arena, flush=True)
    if sys.argv[2] == "hang":
        time.sleep(120)
    w.finalize()
"""


def _trainer(tmp_path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(TRAINER), str(tmp_path), mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(300)
def test_arena_of_a_killed_process_group_is_reclaimed_by_the_next_writer(tmp_path):
    proc = _trainer(tmp_path, "hang")
    try:
        line = proc.stdout.readline()
        assert line.startswith("ARENA"), (line, proc.stderr.read() if proc.poll() else "")
        arena = line.split()[1]
        assert arena.startswith(ARENA_PREFIX)
        assert int(arena[len(ARENA_PREFIX):].split("_")[0], 36) == proc.pid  # owner recoverable
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # trainer, worker and resource tracker
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    deadline = time.monotonic() + 60
    while not _group_gone(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    path = os.path.join("/dev/shm", arena)
    # nobody of that group was left to unlink it (another run on this machine may reclaim it
    # first: any writer start does); this run's next writer start must
    writer = snapkeep.writing.ThreadWriter()  # the next run's writer start
    try:
        writer("next", str(tmp_path), {"x": torch.ones(2)})
    finally:
        writer.finalize()
    assert not os.path.exists(path)


def test_live_owners_and_foreign_segments_are_left_alone(tmp_path):
    writer = snapkeep.writing.ProcessWriter()
    try:
        writer("snap", str(tmp_path), {"x": torch.ones(4)})
        writer.wait()
        mine = writer._saver._slots[0].buffers.allocator.name
        # a name of a live process whose start time differs: a reused pid, owner dead
        parts = mine.split("_")
        reused = f"{ARENA_PREFIX}{parts[1]}_{'1' + parts[2]}_abcdef"
        foreign = "psm_snapkeep_test_foreign"
        for name in (reused, foreign):
            with open(os.path.join("/dev/shm", name), "wb") as f:
                f.write(b"x")
        try:
            reclaim_dead_arenas()  # (another run on this machine may do it at the same time)
            assert not os.path.exists(os.path.join("/dev/shm", reused))
            assert os.path.exists(os.path.join("/dev/shm", mine))
            assert os.path.exists(os.path.join("/dev/shm", foreign))
        finally:
            for name in (reused, foreign):
                if os.path.exists(os.path.join("/dev/shm", name)):
                    os.unlink(os.path.join("/dev/shm", name))
    finally:
        writer.finalize()
    assert not os.path.exists(os.path.join("/dev/shm", mine))


@pytest.mark.timeout(300)
def test_a_normal_run_leaves_no_arena_and_no_resource_tracker_warning(tmp_path):
    proc = _trainer(tmp_path, "finish")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    arena = out.split()[1]
    assert not os.path.exists(os.path.join("/dev/shm", arena))
    assert "leaked shared_memory" not in err and "resource_tracker" not in err, err
