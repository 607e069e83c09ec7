"""The exit drain's bookkeeping (snapkeep._core.save.exit_drain): what DrainedAtExit gives a class
that holds snapshots in flight (Saver, ShardedSaver), and what drain() does with it. The drain at
a real interpreter exit is tested with subprocesses in tests/writing/test_exit_last_snapshot.py
and tests/distributed/test_sharded_exit.py."""

from __future__ import annotations

import os
import weakref
from typing import Any

import pytest

from snapkeep._core.save import exit_drain
from snapkeep._core.save.exit_drain import DrainedAtExit


class _Holder(DrainedAtExit):
    """A class holding one snapshot in flight that fails (or not) when closed."""

    def __init__(self, path: str, error: Exception | None = None) -> None:
        self.path, self.error, self.close_calls = path, error, 0
        self._drain_at_exit_unless_closed()

    def pending_paths(self) -> list[str]:
        return [] if self.closed else [self.path]

    def close(self, timeout_s: float | None = None) -> None:
        self.close_calls += 1
        self._mark_closed()
        if self.error is not None:
            raise self.error


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> weakref.WeakSet[Any]:
    """The drain's registry, empty and of this test only (the real one holds other tests'
    savers, which a drain here must not close)."""
    registry: weakref.WeakSet[Any] = weakref.WeakSet()
    monkeypatch.setattr(exit_drain, "_LIVE", registry)
    return registry


def test_a_holder_is_registered_until_it_closes(live: weakref.WeakSet[Any]) -> None:
    holder = _Holder("snap_1")
    assert holder.pid == os.getpid() and not holder.closed
    assert set(live) == {holder}
    holder.close()
    assert holder.closed and set(live) == set()


def test_drain_closes_what_is_pending_and_names_what_failed(
        live: weakref.WeakSet[Any]) -> None:
    ok, failing = _Holder("snap_1"), _Holder("snap_2", OSError(28, "No space left"))
    done = _Holder("snap_0")
    done.close()
    assert exit_drain.drain(timeout_s=1.0) == ["snap_2"]
    assert (ok.close_calls, failing.close_calls, done.close_calls) == (1, 1, 1)
    assert ok.closed and failing.closed


def test_drain_leaves_a_forked_childs_inherited_holders_alone(
        live: weakref.WeakSet[Any]) -> None:
    holder = _Holder("snap_1")
    holder._pid = os.getpid() + 1  # as a forked child sees its parent's saver
    assert exit_drain.drain(timeout_s=1.0) == []
    assert holder.close_calls == 0
