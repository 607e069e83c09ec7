"""Invariant 6: a background failure surfaces exactly once, with its cause, and nothing hangs.

Faults are injected through savefuns (one that raises, one gated so it stalls) and by killing the
process writers' worker with a real SIGKILL while it is inside a save or right after its commit:
the trainer then writes that snapshot itself, and only when that fails too does the save fail.
Every test is bounded.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
from typing import Any

import pytest
import torch

import snapkeep
from snapkeep import writing
from snapkeep.store import open_store
from support.writer_gates import (
    EventGate,
    InjectedError,
    KillAfterCommitFileSystem,
    SocketGate,
    failing_save,
    fast_start_method,
    worker_killing_save,
)

ASYNC_WRITERS = [
    pytest.param(writing.ThreadWriter, id="ThreadWriter"),
    pytest.param(writing.ThreadQueueWriter, id="ThreadQueueWriter"),
    pytest.param(writing.ProcessWriter, id="ProcessWriter"),
    pytest.param(writing.ProcessQueueWriter, id="ProcessQueueWriter"),
]
START_METHOD = fast_start_method()
ALL_WRITERS = [pytest.param(writing.SimpleWriter, id="SimpleWriter"), *ASYNC_WRITERS]


def _make(writer_cls: type[writing.Writer], *args: Any, **kwargs: Any) -> Any:
    if writer_cls in (writing.ProcessWriter, writing.ProcessQueueWriter):
        kwargs["start_method"] = START_METHOD
    return writer_cls(*args, **kwargs)


def _state(i: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(i)), "step": i}


def _listing(out: str) -> tuple[list[str], list[str]]:
    """Exact contents of ``out`` and of its manifest directory (temp files included)."""
    manifests = os.path.join(out, ".snapkeep")
    return sorted(os.listdir(out)), sorted(os.listdir(manifests)) if os.path.isdir(manifests) \
        else []


def _landed(out: str, names: list[str]) -> tuple[list[str], list[str]]:
    return sorted([".snapkeep", *names]), sorted(f"{n}.json" for n in names)


def _done(future: concurrent.futures.Future[Any]) -> None:
    done, _ = concurrent.futures.wait([future], timeout=30)
    assert done, "the background save never finished"


def _assert_file(out: str, name: str, i: int) -> None:
    loaded = torch.load(os.path.join(out, name), weights_only=True)
    assert torch.equal(loaded["w"], torch.full((64,), float(i))) and loaded["step"] == i


@pytest.mark.timeout(60)
@pytest.mark.parametrize("writer_cls", ASYNC_WRITERS)
def test_failed_save_raises_once_at_next_call_and_at_finalize(
    writer_cls: type[writing.Writer], tmp_path: Any,
) -> None:
    out = str(tmp_path)
    writer = _make(writer_cls)
    handle = writer("s0", out, _state(0), savefun=failing_save)
    _done(handle.committed)
    assert isinstance(handle.committed.exception(), InjectedError)

    with pytest.raises(snapkeep.SnapshotSaveError) as info:  # surfaces at the next call ...
        writer("s1", out, _state(1))
    assert type(info.value.__cause__) is InjectedError
    assert "s0" in str(info.value)
    assert isinstance(info.value, snapkeep.SnapshotError) and isinstance(info.value, RuntimeError)

    for i in (2, 3):  # ... once: later snapshots land
        writer(f"s{i}", out, _state(i))
    writer.wait(timeout_s=30)
    assert _listing(out) == _landed(out, ["s2", "s3"])  # no partial or temp file of s0 either
    for i in (2, 3):
        _assert_file(out, f"s{i}", i)

    handle = writer("s4", out, _state(4), savefun=failing_save)
    with pytest.raises(snapkeep.SnapshotSaveError) as info:  # or at finalize(), once
        writer.finalize()
    assert type(info.value.__cause__) is InjectedError and "s4" in str(info.value)
    writer.finalize()  # a second finalize is a no-op and raises nothing
    assert _listing(out) == _landed(out, ["s2", "s3"])


PROCESS_WRITERS = [
    pytest.param(writing.ProcessWriter, id="ProcessWriter"),
    pytest.param(writing.ProcessQueueWriter, id="ProcessQueueWriter"),
]
FALLBACK_LOGGED = "the trainer wrote that snapshot itself"


def _verified(out: str, name: str) -> None:
    """``name`` is the only snapshot in ``out`` and matches its manifest (size and checksum)."""
    store = open_store(out, "s{step}")
    entries = store.entries()
    assert [e.name for e in entries] == [name]
    assert store.verify(entries[0]) is not None  # raises SnapshotCorruptError on a mismatch


def _started_worker(writer: Any, out: str) -> int:
    writer.initialize(out)  # starts the worker (as the manager does)
    pid = writer._saver.runner.pid
    assert pid is not None and pid != os.getpid()
    return int(pid)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("writer_cls", PROCESS_WRITERS)
def test_worker_killed_mid_save_the_trainer_writes_that_snapshot(
    writer_cls: type[writing.Writer], tmp_path: Any, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "3")  # as under torchrun: the warning names the rank
    out = str(tmp_path)
    gate = SocketGate()
    writer = _make(writer_cls, gate.savefun)
    try:
        state = _state(0)
        handle = writer("s0", out, state)
        state["w"].add_(100.0)  # the snapshot keeps the values of the call
        gate.wait_entered()  # the worker is inside savefun, its temp file open
        pid = writer._saver.runner.pid  # type: ignore[attr-defined]
        assert pid is not None and pid != os.getpid()
        os.kill(pid, signal.SIGKILL)
        gate.drop_oldest()
        gate.wait_entered()  # the trainer's own write of the same staged copy
        gate.release()
        _done(handle.committed)
        assert handle.committed.result().path == os.path.join(out, "s0")
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                    and FALLBACK_LOGGED in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].startswith("rank 3: "), warnings
        assert f"pid {pid})" in warnings[0] and "exit code -9" in warnings[0]
        assert "s0" in warnings[0]
        _verified(out, "s0")
        _assert_file(out, "s0", 0)

        for i in (2, 3):  # no error surfaces; a fresh worker serves later snapshots
            writer(f"s{i}", out, _state(i), savefun=torch.save)
        writer.wait(timeout_s=30)
        new_pid = writer._saver.runner.pid  # type: ignore[attr-defined]
        assert new_pid is not None and new_pid not in (pid, os.getpid())
        writer.finalize()
        writer.finalize()
    finally:
        gate.close()
    assert writer._saver.runner.pid is None  # type: ignore[attr-defined]
    assert _listing(out) == _landed(out, ["s0", "s2", "s3"])  # no temp file of the killed save
    for i in (0, 2, 3):
        _assert_file(out, f"s{i}", i)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("writer_cls", PROCESS_WRITERS)
def test_worker_killed_after_its_commit_leaves_one_valid_snapshot(
    writer_cls: type[writing.Writer], tmp_path: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker committed the file and its manifest, then died before replying: the trainer
    writes the same staged copy again (an atomic replace), leaving one snapshot that verifies."""
    out = str(tmp_path / "run")
    armed = tmp_path / "armed"
    armed.touch()
    fs = KillAfterCommitFileSystem(armed=str(armed), trainer_pid=os.getpid())
    writer = _make(writer_cls, fs=fs, out_dir=out)
    pid = _started_worker(writer, out)
    state = _state(1)
    handle = writer("s1", out, state)
    state["w"].add_(100.0)
    _done(handle.committed)
    assert not armed.exists()  # the worker died after publishing the snapshot and its manifest
    assert handle.committed.result().path == os.path.join(out, "s1")
    assert any(FALLBACK_LOGGED in r.getMessage() and f"pid {pid})" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    assert _listing(out) == _landed(out, ["s1"])
    _verified(out, "s1")
    _assert_file(out, "s1", 1)

    writer("s2", out, _state(2))  # a fresh worker; nothing surfaces
    writer.finalize()
    assert _listing(out) == _landed(out, ["s1", "s2"])
    _assert_file(out, "s2", 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("writer_cls", PROCESS_WRITERS)
def test_worker_killed_and_the_trainer_write_fails_names_both_causes(
    writer_cls: type[writing.Writer], tmp_path: Any,
) -> None:
    out = str(tmp_path)
    savefun = functools.partial(worker_killing_save, trainer_pid=os.getpid(),
                                manifest_dir=os.path.join(out, ".snapkeep"))
    writer = _make(writer_cls, savefun)
    pid = _started_worker(writer, out)
    handle = writer("s0", out, _state(0))
    _done(handle.committed)
    error = handle.committed.exception()
    assert isinstance(error, snapkeep.WorkerDiedError)
    message = str(error)
    assert f"pid {pid})" in message and "exit code -9" in message and "s0" in message
    assert "the trainer's own write of that snapshot failed too" in message
    assert "No space left on device" in message and "was not committed" in message
    assert isinstance(error.__cause__, snapkeep.SnapshotStorageError)  # the trainer's own error

    with pytest.raises(snapkeep.SnapshotSaveError) as info:  # surfaces once, at finalize
        writer.finalize()
    assert info.value.__cause__ is error
    writer.finalize()
    # nothing committed, and no temp file of the dead worker, nor of the trainer's write
    assert _listing(out) == ([".snapkeep"], [])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("writer_cls", [
    pytest.param(writing.ThreadWriter, id="ThreadWriter"),
    pytest.param(writing.ThreadQueueWriter, id="ThreadQueueWriter"),
])
def test_stalled_save_times_out_naming_file_and_seconds(
    writer_cls: type[writing.Writer], tmp_path: Any,
) -> None:
    out = str(tmp_path)
    gate = EventGate()
    writer = writer_cls(gate.savefun, max_pending=1, timeout_s=0.3)  # type: ignore[call-arg]
    try:
        first = writer("s0", out, _state(0))
        gate.wait_entered()
        with pytest.raises(snapkeep.SnapshotTimeoutError) as info:  # no free slot within 0.3 s
            writer("s1", out, _state(1))
        assert "s1" in str(info.value) and "0.3 s" in str(info.value)
        assert "s0" in str(info.value)  # and what it waited for
        assert isinstance(info.value, TimeoutError)

        with pytest.raises(snapkeep.SnapshotTimeoutError) as info:
            writer.wait(timeout_s=0.2)
        assert "s0" in str(info.value) and "0.2 s" in str(info.value)

        with pytest.raises(snapkeep.SnapshotTimeoutError) as info:
            writer.finalize()  # bounded by the writer's timeout_s
        assert "s0" in str(info.value) and "0.3 s" in str(info.value)
        writer.finalize()  # no-op
    finally:
        gate.open()
    _done(first.committed)  # the stalled save completes once released
    assert _listing(out) == _landed(out, ["s0"])
    _assert_file(out, "s0", 0)


@pytest.mark.timeout(60)
def test_stalled_process_save_wait_is_bounded(tmp_path: Any) -> None:
    out = str(tmp_path)
    gate = SocketGate()
    writer = _make(writing.ProcessWriter, gate.savefun, timeout_s=0.3)
    try:
        writer("s0", out, _state(0))
        gate.wait_entered()
        with pytest.raises(snapkeep.SnapshotTimeoutError, match=r"s0.*0\.2 s"):
            writer.wait(timeout_s=0.2)
        with pytest.raises(snapkeep.SnapshotTimeoutError, match=r"s1.*0\.3 s"):
            writer("s1", out, _state(1))
        gate.release()
        writer.wait(timeout_s=30)  # finalize's own bound (timeout_s=0.3) is too tight under load
        writer.finalize()
    finally:
        gate.close()
    assert _listing(out) == _landed(out, ["s0"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("writer_cls", ALL_WRITERS)
def test_finalize_without_saves_and_twice_is_a_no_op(
    writer_cls: type[writing.Writer], tmp_path: Any,
) -> None:
    writer = writer_cls()
    writer.finalize()
    writer.finalize()
    runner = writer._saver.runner
    assert getattr(runner, "pid", None) is None  # no worker was started for nothing
    assert os.listdir(tmp_path) == []
    with _make(writer_cls) as w:  # also a context manager
        w("s0", str(tmp_path), _state(0))
    assert _listing(str(tmp_path)) == _landed(str(tmp_path), ["s0"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("writer_cls", PROCESS_WRITERS)
def test_finalize_that_stops_a_stuck_worker_does_not_write_in_the_trainer(
    writer_cls: type[writing.Writer], tmp_path: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """finalize() whose wait runs out stops the worker mid-save: that snapshot is reported as
    not committed, and the trainer does not start writing it after finalize returned."""
    out = str(tmp_path)
    gate = SocketGate()
    writer = _make(writer_cls, gate.savefun, timeout_s=2.0)
    try:
        handle = writer("s0", out, _state(0))
        gate.wait_entered()  # the worker is stuck inside savefun
        with pytest.raises((snapkeep.SnapshotTimeoutError, snapkeep.SnapshotSaveError)):
            writer.finalize()  # waits timeout_s, then stops the worker
        _done(handle.committed)
        error = handle.committed.exception()
        assert isinstance(error, snapkeep.WorkerDiedError), error
        assert "the writer was finalized, so that snapshot was not committed" in str(error)
    finally:
        gate.close()
    assert not [r for r in caplog.records if FALLBACK_LOGGED in r.getMessage()]
    assert _listing(out) == _landed(out, [])  # nothing committed, no temp file left
