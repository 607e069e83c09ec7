"""The one background lane under every save (snapkeep._core.save.engine.SaveEngine): one unit in
flight (or N), a failure raised once with its type, a bounded close, no thread left, and the
drain at a real interpreter exit (for the engine alone and for the memory tier on it, which a
daemon thread of its own used to lose). Each holds for a thread per unit and for ``lane=True``
(one thread kept between units)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

from snapkeep._core.errors import SnapshotSaveError, SnapshotTimeoutError
from snapkeep._core.save import exit_drain
from snapkeep._core.save.engine import SaveEngine

WAIT_S = 60.0  # generous bound of every wait on a loaded machine; a healthy run takes ms


@pytest.fixture(autouse=True)
def live(monkeypatch: pytest.MonkeyPatch) -> weakref.WeakSet[Any]:
    """The exit drain's registry, of this test only."""
    registry: weakref.WeakSet[Any] = weakref.WeakSet()
    monkeypatch.setattr(exit_drain, "_LIVE", registry)
    return registry


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"snapkeep-{name}"]


LANE = pytest.mark.parametrize("lane", [False, True], ids=["thread-per-unit", "lane"])


@LANE
def test_the_next_unit_starts_after_the_previous_one_ended(
        live: weakref.WeakSet[Any], lane: bool) -> None:
    engine = SaveEngine("lane one", lane=lane)
    assert set(live) == {engine}
    order: list[str] = []
    release = threading.Event()

    def first() -> str:
        assert release.wait(WAIT_S)
        order.append("first")
        return "one"

    handle = engine.submit(first, label="snap_1")
    assert engine.pending_paths() == ["snap_1"] and engine.busy
    second_submitted = threading.Event()

    def submit_second() -> None:
        engine.submit(order.append, "second", label="snap_2")
        second_submitted.set()

    submitter = threading.Thread(target=submit_second)
    submitter.start()
    assert not second_submitted.wait(0.3)  # held back while the first one runs
    release.set()
    submitter.join(WAIT_S)
    assert second_submitted.is_set() and handle.result(WAIT_S) == "one"
    engine.close(WAIT_S)
    assert order == ["first", "second"]
    assert engine.closed and set(live) == set() and _threads("lane-one") == []
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(order.append, "late", label="snap_3")


def test_up_to_max_in_flight_units_run_at_once() -> None:
    engine = SaveEngine("lane two", max_in_flight=2)
    both = threading.Barrier(2, timeout=WAIT_S)  # broken unless both run at once
    handles = [engine.submit(both.wait, label=f"snap_{i}") for i in range(2)]
    engine.close(WAIT_S)
    assert sorted(h.result() for h in handles) == [0, 1]
    with pytest.raises(ValueError, match="max_in_flight must be an int >= 1"):
        SaveEngine("bad", max_in_flight=0)
    with pytest.raises(ValueError, match=r"1 with lane=True\), got 2"):
        SaveEngine("bad", max_in_flight=2, lane=True)


def test_a_lane_runs_every_unit_on_one_thread_kept_until_close() -> None:
    engine = SaveEngine("lane kept", lane=True)
    assert _threads("lane-kept") == []  # started by the first unit
    ran_on = [engine.submit(threading.get_ident, label=f"snap_{i}").result(WAIT_S)
              for i in range(3)]
    engine.join(WAIT_S)
    [thread] = _threads("lane-kept")  # idle between units, not one per unit
    assert ran_on == [thread.ident] * 3 and thread.daemon
    engine.close(WAIT_S)
    assert not thread.is_alive() and _threads("lane-kept") == []


def _fail(error: BaseException) -> None:
    raise error


def _four_submit_at_once(lane: bool) -> tuple[list[int], int]:
    """One round: four threads submit at the same moment; (units run, most running at once)."""
    engine = SaveEngine("lane race", lane=lane)
    start = threading.Barrier(4, timeout=WAIT_S)
    guard = threading.Lock()
    ran: list[int] = []
    running = [0, 0]  # now, most at once

    def unit(i: int) -> None:
        with guard:
            running[0] += 1
            running[1] = max(running)
        ran.append(i)
        with guard:
            running[0] -= 1

    def submit(i: int) -> None:
        start.wait()
        engine.submit(unit, i, label=f"snap_{i}", timeout_s=WAIT_S)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    engine.close(WAIT_S)
    return sorted(ran), running[1]


@LANE
def test_threads_submitting_at_once_each_run_once_never_more_than_the_bound(
        lane: bool) -> None:
    """Four threads submit at the same moment, 30 rounds, with a tiny switch interval to widen
    the race: every unit runs exactly once and at most one at a time (a lane engine lost a unit
    and hung every later wait when two submits passed the check before either took the lane)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(30):
            assert _four_submit_at_once(lane) == ([0, 1, 2, 3], 1)
    finally:
        sys.setswitchinterval(old)


@LANE
def test_a_unit_cancelled_before_it_ran_never_runs_and_the_engine_goes_on(lane: bool) -> None:
    """A unit's future cancelled while it waited for its thread or lane: its work never runs,
    it no longer counts as running, and the next unit runs (a lane thread used to die on the
    cancelled future's InvalidStateError, and every later unit with it)."""
    engine = SaveEngine("lane cancel", lane=lane)
    ran: list[str] = []
    engine.submit(ran.append, "first", label="snap_1").result(WAIT_S)
    engine.join(WAIT_S)
    unit = engine.unit(ran.append, "cancelled", label="snap_2")
    engine._started_unit(unit, thread=False)  # taken, as submit takes it, not yet run
    assert unit.future.cancel()
    unit.run()  # what its thread or the lane does next
    assert unit.future.cancelled() and not engine.busy
    assert engine.submit(ran.append, "next", label="snap_3").result(WAIT_S) is None
    engine.close(WAIT_S)
    assert ran == ["first", "next"] and _threads("lane-cancel") == []


@LANE
def test_a_failure_is_raised_once_with_its_type_and_the_next_unit_runs(lane: bool) -> None:
    engine = SaveEngine("lane err", lane=lane)
    error = OSError(28, "No space left on device (test)")
    handle = engine.submit(_fail, error, label="snap_1")
    engine.join(WAIT_S)  # waits only: the failure stays kept
    assert handle.exception() is error and engine.pending_paths() == ["snap_1"]
    with pytest.raises(OSError) as info:
        engine.submit(print, label="snap_2")  # raised before the next unit is taken
    assert info.value is error
    engine.wait(WAIT_S)  # raised once
    assert engine.submit(int, "7", label="snap_2").result(WAIT_S) == 7
    engine.close(WAIT_S)


def test_a_door_wraps_the_failure_in_its_documented_error() -> None:
    def wrap(label: str, cause: BaseException) -> BaseException:
        return SnapshotSaveError(f"the background save of {label} failed: {cause}")

    engine = SaveEngine("lane wrap", wrap=wrap)
    engine.submit(_fail, ValueError("bad value (test)"), label="snap_1")
    with pytest.raises(SnapshotSaveError, match="snap_1 failed: bad value") as info:
        engine.close(WAIT_S)
    assert isinstance(info.value.__cause__, ValueError) and engine.closed
    assert engine.take_errors() == []


@LANE
def test_close_gives_up_after_its_timeout_and_the_thread_ends_on_its_own(lane: bool) -> None:
    engine = SaveEngine("lane slow", timeout_message=lambda paths, t: f"{paths} after {t:g} s",
                        lane=lane)
    release = threading.Event()
    engine.submit(release.wait, WAIT_S, label="snap_1")
    with pytest.raises(SnapshotTimeoutError, match=r"\['snap_1'\] after 0.2 s"):
        engine.close(0.2)
    assert engine.closed
    [thread] = _threads("lane-slow")
    release.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()


ENGINE_AT_EXIT = textwrap.dedent("""
    import sys, time
    from snapkeep._core.save.engine import SaveEngine

    def write(path):
        time.sleep(0.5)
        if sys.argv[1] == "fail":
            raise OSError(28, "No space left on device (injected)")
        with open(path, "w") as f:
            f.write("done")

    engine = SaveEngine("exit lane", lane=sys.argv[3] == "lane")
    engine.submit(write, sys.argv[2], label=sys.argv[2])
    print("returned without close", flush=True)
""")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(150)
@LANE
def test_an_engine_not_closed_is_drained_at_exit(tmp_path: Path, lane: bool) -> None:
    out = tmp_path / "unit.txt"
    kind = "lane" if lane else "threads"
    done = _run("-c", ENGINE_AT_EXIT, "ok", str(out), kind)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "done"
    failed = _run("-c", ENGINE_AT_EXIT, "fail", str(tmp_path / "lost.txt"), kind)
    assert failed.returncode == 1, failed.stderr
    assert "lost.txt" in failed.stderr and "not committed" in failed.stderr
    assert "No space left on device (injected)" in failed.stderr


TIER_AT_EXIT = textwrap.dedent("""
    import sys, time
    import torch
    from snapkeep._core.tiers.memory_tier import MemoryTier, TierEngine

    class Slow:  # serialised slowly: still being committed to RAM when the script ends
        def __deepcopy__(self, memo):
            return self

        def __reduce__(self):
            time.sleep(1.0)
            return (int, (7,))

    tier = MemoryTier(every=1, replicas=0, root=sys.argv[1], job="exit-test")
    engine = TierEngine(tier, directory=sys.argv[2], template="snap_{step}")
    engine.open(1024)
    engine.save(3, lambda: {"w": torch.ones(4), "slow": Slow()})
    print("returned without close", flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_memory_tiers_ram_snapshot_in_flight_is_committed_at_exit(tmp_path: Path) -> None:
    from snapkeep._core.tiers.memory_store import MemoryStore

    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    done = _run("-c", TIER_AT_EXIT, str(root), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    held = MemoryStore(str(root), "exit-test", 0).newest_verified()
    assert held is not None and held.step == 3  # lost with the daemon thread before
