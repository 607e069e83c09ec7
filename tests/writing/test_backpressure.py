"""Invariant 7: at most ``max_pending`` snapshots in flight; when full, ``on_full`` decides
(block, skip or replace) and says so in the log. Memory stays bounded: one reusable buffer set
per in-flight snapshot, nothing allocated once warm.

Saves are held in a gated savefun; each test releases them one by one (bounded waits, no sleeps).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import pytest
import torch

from snapkeep import writing
from support.writer_gates import EventGate, SocketGate, fast_start_method

START_METHOD = fast_start_method()
PROCESS_WRITERS = (writing.ProcessWriter, writing.ProcessQueueWriter)
ASYNC_WRITERS = [
    pytest.param(writing.ThreadWriter, 1, id="ThreadWriter"),
    pytest.param(writing.ThreadQueueWriter, 2, id="ThreadQueueWriter"),
    pytest.param(writing.ProcessWriter, 1, id="ProcessWriter"),
    pytest.param(writing.ProcessQueueWriter, 2, id="ProcessQueueWriter"),
]
QUEUE_WRITERS = [
    pytest.param(writing.ThreadQueueWriter, id="ThreadQueueWriter"),
    pytest.param(writing.ProcessQueueWriter, id="ProcessQueueWriter"),
]


def _gated(writer_cls: type[writing.Writer], **kwargs: Any) -> tuple[Any, Any]:
    if writer_cls in PROCESS_WRITERS:
        gate: Any = SocketGate()
        kwargs["start_method"] = START_METHOD
    else:
        gate = EventGate()
    return writer_cls(gate.savefun, **kwargs), gate


def _state(i: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(i)), "i": i}


def _release_all(gate: Any, count: int) -> None:
    """Let ``count`` saves through, in order; the first has already entered the savefun."""
    for k in range(count):
        if k:
            gate.wait_entered()
        gate.release()


def _snapshots(out: str) -> list[str]:
    return sorted(n for n in os.listdir(out) if not n.startswith("."))


def _check(out: str, name: str, i: int) -> None:
    loaded = torch.load(os.path.join(out, name), weights_only=True)
    assert torch.equal(loaded["w"], torch.full((256,), float(i))) and loaded["i"] == i


def _allocated(writer: writing.Writer) -> int:
    stats = writer._saver.last_stage_stats
    assert stats is not None
    return stats.allocated_bytes


class _LogEvent(logging.Handler):
    """Sets an event when a record containing ``text`` is logged (from any thread)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("writer_cls", "default_pending"), ASYNC_WRITERS)
def test_block_waits_for_a_slot_and_says_so(
    writer_cls: type[writing.Writer], default_pending: int, tmp_path: Any,
) -> None:
    out = str(tmp_path)
    writer, gate = _gated(writer_cls)
    assert writer._saver.max_pending == default_pending  # documented defaults
    writer._saver.warn_after_s = 0.05  # log "still waiting" quickly
    waiting = _LogEvent("still waiting")
    logging.getLogger("snapkeep").addHandler(waiting)
    returned = threading.Event()

    def call_when_full() -> None:
        writer(f"s{default_pending}", out, _state(default_pending))
        returned.set()

    blocked = threading.Thread(target=call_when_full, daemon=True)
    try:
        for i in range(default_pending):
            writer(f"s{i}", out, _state(i))
        gate.wait_entered()
        blocked.start()
        assert waiting.event.wait(10), "a full writer must block and log that it waits"
        assert not returned.is_set() and blocked.is_alive()
        assert writer.pending == default_pending
        _release_all(gate, default_pending + 1)
        assert returned.wait(20), "the blocked call must return once a slot frees"
        blocked.join(10)
        assert len(writer._saver._slots) == default_pending  # one buffer set per slot
        writer.finalize()
    finally:
        logging.getLogger("snapkeep").removeHandler(waiting)
        gate.close()
    assert _snapshots(out) == [f"s{i}" for i in range(default_pending + 1)]
    for i in range(default_pending + 1):
        _check(out, f"s{i}", i)
    assert writer._saver._slots == []  # finalize released the staging buffers


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("writer_cls", "default_pending"), ASYNC_WRITERS)
def test_skip_drops_the_new_snapshot_and_logs(
    writer_cls: type[writing.Writer], default_pending: int, tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = str(tmp_path)
    writer, gate = _gated(writer_cls, on_full="skip")
    try:
        for i in range(default_pending):
            assert writer(f"s{i}", out, _state(i)) is not None
        gate.wait_entered()
        assert writer("skipped", out, _state(99)) is None  # returns at once
        assert writer.last_handle is None
        assert any("skipping snapshot" in r.getMessage() and "skipped" in r.getMessage()
                   and r.levelno == logging.WARNING for r in caplog.records)
        _release_all(gate, default_pending)
        writer.wait(timeout_s=20)
        assert writer("later", out, _state(7)) is not None  # a free slot: saved again
        gate.wait_entered()
        gate.release()
        writer.finalize()
    finally:
        gate.close()
    assert _snapshots(out) == sorted(["later", *(f"s{i}" for i in range(default_pending))])
    _check(out, "later", 7)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("writer_cls", QUEUE_WRITERS)
def test_replace_cancels_the_queued_snapshot_and_logs(
    writer_cls: type[writing.Writer], tmp_path: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    out = str(tmp_path)
    writer, gate = _gated(writer_cls, max_pending=2, on_full="replace")
    try:
        first = writer("s0", out, _state(0))
        gate.wait_entered()  # s0 is being written: it cannot be replaced
        queued = writer("s1", out, _state(1))  # staged, waiting in the queue
        for i in (2, 3):  # each replaces the one still queued
            newest = writer(f"s{i}", out, _state(i))
            assert newest is not None
            assert len(writer._saver._slots) == 2  # never more buffer sets than max_pending
        assert queued.committed.cancelled()
        messages = [r.getMessage() for r in caplog.records if "replacing" in r.getMessage()]
        assert len(messages) == 2 and "s1" in messages[0] and "s2" in messages[0]
        _release_all(gate, 2)
        writer.finalize()
    finally:
        gate.close()
    assert first.committed.result(timeout=1).path.endswith("s0")
    assert newest.committed.result(timeout=1).path.endswith("s3")
    assert _snapshots(out) == ["s0", "s3"]
    _check(out, "s0", 0)
    _check(out, "s3", 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("writer_cls", [
    pytest.param(writing.ThreadWriter, id="ThreadWriter"),
    pytest.param(writing.ThreadQueueWriter, id="ThreadQueueWriter"),
])
@pytest.mark.parametrize("on_full", ["block", "skip", "replace"])
def test_buffer_sets_never_exceed_max_pending_and_stay_warm(
    writer_cls: type[writing.Writer], on_full: str, tmp_path: Any,
) -> None:
    out = str(tmp_path)
    writer = writer_cls(max_pending=2, on_full=on_full)  # type: ignore[call-arg]
    a = torch.zeros(1024)
    state = {"a": a, "b": torch.zeros(16, 16), "n": 0}
    allocated = []
    for i in range(20):  # back to back: the writer is full most of the time
        with torch.no_grad():
            a.fill_(i)
        if writer(f"s{i}", out, state) is not None:
            allocated.append(_allocated(writer))
        assert len(writer._saver._slots) <= 2
    writer.wait(timeout_s=30)
    assert "s19" in _snapshots(out) or on_full == "skip"
    for i in range(20, 24):  # warm: staging reuses the buffer sets, allocates nothing
        writer(f"s{i}", out, state)
        assert _allocated(writer) == 0
        writer.wait(timeout_s=30)
    assert len(writer._saver._slots) <= 2
    writer.finalize()
    assert allocated[0] > 0 and sum(1 for a in allocated if a) <= 2
    _check_small = torch.load(os.path.join(out, "s23"), weights_only=True)
    assert torch.equal(_check_small["a"], torch.full((1024,), 19.0))
