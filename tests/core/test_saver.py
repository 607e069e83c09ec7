"""The saver: back-pressure policies, errors raised once with their cause, bounded waits, and
the order of commit, hooks and slot release. Faults come from a fake runner passed in."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

import fsspec
import pytest
import torch

from snapkeep._core.errors import SnapshotSaveError, SnapshotTimeoutError
from snapkeep._core.save.job import CommitRecord, SaveJob
from snapkeep._core.save.saver import Saver, Ticket
from snapkeep._core.storage import Storage

BOUND_S = 10.0


class Boom(RuntimeError):
    pass


class FakeRunner:
    """Runs jobs by name: ``fail`` raises :class:`Boom`; every job first waits for its gate
    (bounded) when the test made one."""

    in_process = True
    background = True

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.ran: list[str] = []
        self.closed = 0

    def gate(self, path: str) -> threading.Event:
        self.entered[path] = threading.Event()
        self.gates[path] = threading.Event()
        return self.gates[path]

    def run(self, job: SaveJob, staged: Any, arena_name: str | None, storages: Any
            ) -> CommitRecord:
        if job.path in self.gates:
            self.entered[job.path].set()
            if not self.gates[job.path].wait(BOUND_S):
                raise TimeoutError("test gate never opened")
        if job.path.startswith("fail"):
            raise Boom(f"cannot write {job.path}")
        self.ran.append(job.path)
        return CommitRecord(path=job.path, size_bytes=1, checksum="x", write_s=0.0)

    def close(self) -> None:
        self.closed += 1


def _job(path: str) -> SaveJob:
    return SaveJob(storage=Storage(fsspec.filesystem("memory")), path=path, savefun=torch.save)


def _in_thread(saver: Saver, ticket: Ticket | None) -> threading.Thread:
    assert ticket is not None
    thread = threading.Thread(target=saver.run, args=(ticket,), daemon=True)
    thread.start()
    return thread


def _state() -> dict[str, Any]:
    return {"w": torch.ones(8)}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_pending": 0}, "max_pending"),
    ({"max_pending": True}, "max_pending"),
    ({"max_pending": "2"}, "max_pending"),
    ({"on_full": "drop"}, "on_full"),
    ({"timeout_s": 0}, "timeout_s"),
])
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Saver(FakeRunner(), **kwargs)


def test_error_surfaces_once_with_cause_and_later_saves_run() -> None:
    runner = FakeRunner()
    saver = Saver(runner, max_pending=2)
    failed = saver.submit(_job("fail0"), _state())
    assert failed is not None and saver.run(failed) is False
    assert isinstance(failed.handle.committed.exception(), Boom)
    with pytest.raises(SnapshotSaveError, match="fail0") as info:
        saver.submit(_job("s1"), _state())
    assert type(info.value.__cause__) is Boom
    ok = saver.submit(_job("s2"), _state())  # raised once: the next submit works
    assert ok is not None and saver.run(ok) is True
    saver.close()
    saver.close()
    assert runner.ran == ["s2"] and runner.closed == 1


def test_error_surfaces_at_close_once() -> None:
    saver = Saver(FakeRunner())
    ticket = saver.submit(_job("fail0"), _state())
    assert ticket is not None
    saver.run(ticket)
    with pytest.raises(SnapshotSaveError) as info:
        saver.close()
    assert type(info.value.__cause__) is Boom
    saver.close()  # no second raise
    with pytest.raises(RuntimeError, match="finalized"):
        saver.submit(_job("s1"), _state())


@pytest.mark.timeout(30)
def test_blocked_submit_raises_the_failure_of_the_save_it_waited_for() -> None:
    runner = FakeRunner()
    gate = runner.gate("fail0")
    saver = Saver(runner, max_pending=1)
    _in_thread(saver, saver.submit(_job("fail0"), _state()))
    assert runner.entered["fail0"].wait(BOUND_S)
    outcome: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def blocked_submit() -> None:
        try:
            outcome.set_result(saver.submit(_job("s1"), _state()))
        except BaseException as e:
            outcome.set_exception(e)

    threading.Thread(target=blocked_submit, daemon=True).start()
    gate.set()  # the save fails while the submit waits for its slot
    with pytest.raises(SnapshotSaveError) as info:
        outcome.result(timeout=BOUND_S)
    assert type(info.value.__cause__) is Boom
    assert saver.pending == 0  # the slot it reserved was released
    saver.close()


@pytest.mark.timeout(30)
def test_slot_and_close_timeouts_name_the_files_and_seconds() -> None:
    runner = FakeRunner()
    gate = runner.gate("s0")
    saver = Saver(runner, max_pending=1, timeout_s=0.2)
    thread = _in_thread(saver, saver.submit(_job("s0"), _state()))
    assert runner.entered["s0"].wait(BOUND_S)
    with pytest.raises(SnapshotTimeoutError, match=r"'s1' waited 0\.2 s.*\['s0'\]"):
        saver.submit(_job("s1"), _state())
    with pytest.raises(SnapshotTimeoutError, match=r"\['s0'\].*0\.1 s"):
        saver.wait(0.1)
    with pytest.raises(SnapshotTimeoutError, match=r"\['s0'\].*0\.2 s"):
        saver.close()
    saver.close()  # closed already: no-op
    gate.set()
    thread.join(BOUND_S)
    assert runner.ran == ["s0"]


@pytest.mark.timeout(30)
def test_skip_and_replace_policies_log_what_they_do(caplog: pytest.LogCaptureFixture) -> None:
    runner = FakeRunner()
    gate = runner.gate("s0")
    skip = Saver(runner, max_pending=1, on_full="skip")
    thread = _in_thread(skip, skip.submit(_job("s0"), _state()))
    assert runner.entered["s0"].wait(BOUND_S)
    assert skip.submit(_job("s1"), _state()) is None
    assert any(r.levelno == logging.WARNING and "skipping snapshot s1" in r.getMessage()
               for r in caplog.records)
    gate.set()
    thread.join(BOUND_S)
    skip.close()

    replace = Saver(FakeRunner(), max_pending=2, on_full="replace")
    first = replace.submit(_job("r0"), _state())
    second = replace.submit(_job("r1"), _state())
    third = replace.submit(_job("r2"), _state())  # neither started: the oldest is replaced
    assert first is not None and second is not None and third is not None
    assert first.handle.committed.cancelled() and third.slot is first.slot
    assert any("replacing pending snapshot r0" in r.getMessage() for r in caplog.records)
    assert replace.run(first) is False  # a dispatcher skips the replaced ticket
    assert replace.run(second) and replace.run(third)
    replace.close()


def test_hooks_run_before_the_slot_is_released_and_failures_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    saver = Saver(FakeRunner())
    seen: list[tuple[str, int, bool]] = []

    def hook(record: CommitRecord) -> None:
        seen.append((record.path, saver.pending, ticket.handle.committed.done()))

    def bad_hook(record: CommitRecord) -> None:
        raise OSError("retention failed")

    saver.add_post_commit_hook(hook)
    saver.add_post_commit_hook(bad_hook)
    submitted = saver.submit(_job("s0"), _state())
    assert submitted is not None
    ticket = submitted
    assert saver.run(ticket) is True
    # the hook saw the commit done and its slot still held: wait() returns after hooks
    assert seen == [("s0", 1, True)] and saver.pending == 0
    assert any("post-commit hook" in r.getMessage() for r in caplog.records)
    saver.close()
