"""Every user-facing error and warning class, as a user meets it: its text says what happened,
names the argument or file, and says what to do. Warnings are raised once, attributed to the
user's line (this file), and not repeated as a log line.

One row per class: ``make(tmp_path)`` provokes it; ``fragments`` must all appear in the message
(what happened, the name, what to do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import functools
import logging
import os
import pathlib
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import snapkeep
import snapkeep.errors
from snapkeep import writing
from snapkeep.training import ExtensionsManager, extensions

THIS_FILE = pathlib.Path(__file__).resolve()


def _write(out: Path, steps: list[int], iteration: dict[int, int] | None = None) -> None:
    writer = writing.SimpleWriter(out_dir=str(out))
    for step in steps:
        state: dict[str, Any] = {"w": torch.full((3,), float(step))}
        if iteration is not None:
            state["_start_iteration"] = iteration[step]
        writer(f"snapshot_iter_{step}", str(out), state, step=step)
    writer.finalize()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _manager(out: Path, width: int = 3, *, autoload: bool = True,
             writer: Any = None) -> ExtensionsManager:
    model = torch.nn.Linear(2, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=2,
                                out_dir=str(out), writer=writer)
    manager.extend(extensions.snapshot(autoload=autoload), trigger=(1, "iteration"))
    return manager


def _train(manager: ExtensionsManager) -> None:
    while not manager.stop_trigger:
        with manager.run_iteration():
            pass
    manager.finalize()


# -- provokers (each raises or warns as a user would meet it) ------------------------------------


def no_valid_snapshot(tmp_path: Path) -> None:
    _write(tmp_path, [1, 2])
    for step in (1, 2):
        _flip(tmp_path / f"snapshot_iter_{step}")
    with contextlib.suppress(Warning), pytest.warns(RuntimeWarning):
        snapkeep.load_latest(tmp_path)


def corrupt(tmp_path: Path) -> None:
    from snapkeep.store import SnapshotStore as Catalog
    from snapkeep.store import resolve_storage

    _write(tmp_path, [1])
    _flip(tmp_path / "snapshot_iter_1")
    storage, path = resolve_storage(str(tmp_path))
    store = Catalog(storage, path, "snapshot_iter_{step}")
    store.verify(store.entries()[0])


def unsafe(tmp_path: Path) -> None:
    torch.save({"when": datetime.date(2024, 1, 2)}, tmp_path / "snapshot_iter_1")
    snapkeep.load_latest(tmp_path)


def mismatch(tmp_path: Path) -> None:
    _train(_manager(tmp_path, 3))
    _manager(tmp_path, 4).start_extensions()


def save_failed(tmp_path: Path) -> None:
    def broken_save(obj: Any, f: Any) -> None:
        raise ValueError("the disk said no")

    writer = writing.ThreadWriter(out_dir=str(tmp_path))
    writer("snapshot_iter_1", str(tmp_path), {"w": torch.zeros(1)}, savefun=broken_save)
    writer.finalize()


def unusable_out_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file where a directory should be")
    _manager(tmp_path / "file" / "run").start_extensions()


def timeout(tmp_path: Path) -> None:
    release = threading.Event()

    def held_save(obj: Any, f: Any) -> None:
        release.wait(30)
        torch.save(obj, f)

    writer = writing.ThreadWriter(out_dir=str(tmp_path), max_pending=1, timeout_s=0.2)
    try:
        writer("snapshot_iter_1", str(tmp_path), {"w": torch.zeros(1)}, savefun=held_save)
        writer("snapshot_iter_2", str(tmp_path), {"w": torch.zeros(1)}, savefun=held_save)
    finally:
        release.set()
        # the error under test is the call's: on a loaded machine the released first commit
        # can take longer than the writer's 0.2 s, and finalize's own timeout must not mask it
        with contextlib.suppress(snapkeep.SnapshotTimeoutError):
            writer.finalize()


def killed_save(obj: Any, f: Any, *, trainer_pid: int) -> None:
    """A picklable savefun that SIGKILLs the process running it (the writer's worker), and fails
    as a full disk does in the trainer (which writes a dead worker's snapshot itself)."""
    if os.getpid() != trainer_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, "No space left on device")


def worker_died(tmp_path: Path) -> None:
    savefun = functools.partial(killed_save, trainer_pid=os.getpid())
    writer = writing.ProcessWriter(savefun, out_dir=str(tmp_path))
    try:
        handle = writer("snapshot_iter_1", str(tmp_path), {"w": torch.zeros(4)})
        error = handle.committed.exception(timeout=60)
        raise error if error is not None else AssertionError("the save survived")
    finally:
        with contextlib.suppress(snapkeep.SnapshotError):
            writer.finalize()


def bad_max_epochs(tmp_path: Path) -> None:
    ExtensionsManager(torch.nn.Linear(1, 1), {}, max_epochs="3", iters_per_epoch=1)  # type: ignore[arg-type]


def skipped_corrupt(tmp_path: Path) -> None:
    _write(tmp_path, [1, 2])
    _flip(tmp_path / "snapshot_iter_2")
    snapkeep.load_latest(tmp_path)


def no_manifest(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(1)}, tmp_path / "snapshot_iter_1")
    snapkeep.load_latest(tmp_path)


def already_holds(tmp_path: Path) -> None:
    _train(_manager(tmp_path))
    _manager(tmp_path, autoload=False).start_extensions()


def renamed(tmp_path: Path) -> None:
    _train(_manager(tmp_path))
    os.replace(tmp_path / "snapshot_iter_1", tmp_path / "snapshot_iter_9")
    os.replace(tmp_path / ".snapkeep" / "snapshot_iter_1.json",
               tmp_path / ".snapkeep" / "snapshot_iter_9.json")
    _manager(tmp_path).start_extensions()  # skips snapshot_iter_9, resumes snapshot_iter_2


def copied_without_manifest(tmp_path: Path) -> None:
    import shutil

    _train(_manager(tmp_path))
    shutil.copy(tmp_path / "snapshot_iter_1", tmp_path / "snapshot_iter_9")
    _manager(tmp_path).start_extensions()  # skips snapshot_iter_9, resumes snapshot_iter_2


def store_locked(tmp_path: Path) -> None:
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from snapkeep._core.store.lock import StoreLock; "
         f"lock = StoreLock.acquire({str(tmp_path)!r}, 'run', what='snapshot_iter'); "
         "print('held', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        from snapkeep._core.store.lock import StoreLock

        StoreLock.acquire(str(tmp_path), "run", what="snapshot_iter")
    finally:
        holder.communicate("\n", timeout=60)


def bad_manifest(tmp_path: Path) -> None:
    from snapkeep.store import open_store, read_manifest

    (tmp_path / "manifest.json").write_text('{"format": "snapkeep.manifest/1", "size_bytes": "3"}')
    store = open_store(str(tmp_path), "snapshot_iter_{step}")
    read_manifest(store.storage, str(tmp_path / "manifest.json"))


def memory_tier_too_small(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    with torch.device("meta"):  # a state larger than the free space, allocating nothing
        model = torch.nn.Linear(1, 1)
        model.weight = torch.nn.Parameter(torch.empty(st.f_bavail * st.f_frsize // 4 + 1, 1))
    manager = ExtensionsManager(model, {}, 1, iters_per_epoch=1, out_dir=str(tmp_path / "out"))
    manager.extend(extensions.memory_tier(extensions.MemoryTier(every=1,
                                                                root=str(tmp_path / "shm"))))
    manager.start_extensions()


def bare_load_of_incremental(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256)
    with snapkeep.Checkpointer(tmp_path, incremental=True) as ckpt:
        ckpt.save(1, {"model": model})
    torch.load(tmp_path / "ckpt_1", weights_only=False)  # a plain torch.load, arbitrary pickle


def staging_race(tmp_path: Path) -> None:
    from snapkeep._core.save.overlap import DeferredCopy
    from snapkeep._core.save.staging import StageStats

    weight = torch.zeros(2)
    deferred = DeferredCopy(
        copies=[], members=[("models/main/fc.weight", weight, weight._version)],
        stats=StageStats(tensor_bytes=0, allocated_bytes=0, num_storages=0), before_copy=None)
    weight.add_(1)
    race = deferred.moved()
    assert race is not None
    raise race


def rank_failed(tmp_path: Path) -> None:
    from snapkeep.distributed import exchange_outcomes

    exchange_outcomes(None, OSError(28, "No space left on device"),
                      what="sharded save of snapshot_iter_3")


def no_common(tmp_path: Path) -> None:
    from snapkeep.distributed import agree_on_resume

    agree_on_resume(None, [((1.0,), "snapshot_iter_1")], lambda name: "checksum differs",
                    what="resuming 'snapshot_iter_{.iteration}'")


@dataclasses.dataclass(frozen=True)
class Row:
    kind: type[BaseException] | type[Warning]
    make: Callable[[Path], None]
    fragments: tuple[str, ...]


ERRORS = {
    "NoValidSnapshotError": Row(snapkeep.NoValidSnapshotError, no_valid_snapshot, (
        "none valid", "snapshot_iter_2", "Move them away to start fresh")),
    "SnapshotCorruptError": Row(snapkeep.SnapshotCorruptError, corrupt, (
        "does not match the recorded", "snapshot_iter_1", "restore a good copy")),
    "UnsafeSnapshotError": Row(snapkeep.UnsafeSnapshotError, unsafe, (
        "only arbitrary unpickling can load", "snapshot_iter_1", "pass weights_only=False")),
    "StateMismatchError": Row(snapkeep.StateMismatchError, mismatch, (
        "does not match the target", "snapshot_iter_2", "shape of weight",
        "point out_dir elsewhere or fix the model definition")),
    "SnapshotSaveError": Row(snapkeep.SnapshotSaveError, save_failed, (
        "failed: ValueError: the disk said no", "snapshot_iter_1",
        "on_save_error='log'")),
    "SnapshotStorageError": Row(snapkeep.SnapshotStorageError, unusable_out_dir, (
        "cannot be used for snapshots", "file/run", "Choose a writable directory")),
    "SnapshotTimeoutError": Row(snapkeep.SnapshotTimeoutError, timeout, (
        "waited 0.2 s for a slot", "snapshot_iter_2", "raise timeout_s or max_pending")),
    "WorkerDiedError": Row(snapkeep.WorkerDiedError, worker_died, (
        "worker process", "died", "snapshot_iter_1", "trainer's own write",
        "failed too", "No space left on device", "was not committed",
        "A new worker starts with the next snapshot")),
    "IncrementalSnapshotError": Row(snapkeep.errors.IncrementalSnapshotError,
                                    bare_load_of_incremental, (
        "incremental snapkeep snapshot", "plain torch.load cannot put them back",
        "snapkeep convert SNAPSHOT OUT.pt")),
    "StoreLockedError": Row(snapkeep.StoreLockedError, store_locked, (
        "in use by another trainer", "pid", "Stop the other trainer",
        "give this run another output directory", "whatever its filename template")),
    "ManifestError": Row(snapkeep.errors.ManifestError, bad_manifest, (
        "manifest.json", "required field 'name' is missing")),
    "StagingRaceError": Row(snapkeep.StagingRaceError, staging_race, (
        "models/main/fc.weight", "modified in place after the snapshot call",
        "overlap=False")),
    "MemoryTierTooSmallError": Row(snapkeep.errors.MemoryTierTooSmallError,
                                   memory_tier_too_small, (
        "memory tier:", "free but this rank needs", "enlarge the tmpfs", "--shm-size")),
    "RankFailedError": Row(snapkeep.errors.RankFailedError, rank_failed, (
        "sharded save of snapshot_iter_3 failed on rank(s) [0]", "No space left",
        "fix the error of the rank(s) named")),
    "NoCommonSnapshotError": Row(snapkeep.errors.NoCommonSnapshotError, no_common, (
        "none readable and verified on every rank", "snapshot_iter_1", "checksum differs",
        "Restore the missing or corrupt parts")),
    "TypeError (max_epochs)": Row(TypeError, bad_max_epochs, (
        "max_epochs must be a number of epochs", "'3' (str)")),
}

WARNINGS = {
    "skipping a corrupt snapshot": Row(RuntimeWarning, skipped_corrupt, (
        "skipping snapshot snapshot_iter_2 (step 2)", "does not match",
        "restore a good copy")),
    "snapshot without manifest": Row(RuntimeWarning, no_manifest, (
        "snapshot_iter_1 (step 1) has no checksum manifest", "loaded completely")),
    "existing snapshots, autoload=False": Row(UserWarning, already_holds, (
        "already holds 2 snapshot(s)", "autoload=False",
        "use another output directory or autoload=True to ")),
}

RESUME_NOTICES = {  # autoload's skips: lines of its resume notice on stderr, not warnings
    "file and manifest renamed to another step": Row(RuntimeWarning, renamed, (
        "snapkeep: skipped snapshot_iter_9 (step 9): ",
        "its manifest records the snapshot 'snapshot_iter_1' (step 1), not 'snapshot_iter_9'",
        "Rename it back, or move both away")),
    "file copied to another step's name": Row(RuntimeWarning, copied_without_manifest, (
        "snapkeep: skipped snapshot_iter_9 (step 9): ",
        "named for step 9 but holds iteration 1", "it is not resumed from",
        "Rename the file to match")),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(ERRORS))
def test_error_text(name: str, tmp_path: Path) -> None:
    row = ERRORS[name]
    with pytest.raises(row.kind) as info:  # type: ignore[arg-type]
        row.make(tmp_path)
    message = str(info.value)
    for fragment in row.fragments:
        assert fragment in message, (fragment, message)


def test_every_public_error_class_has_a_row() -> None:
    # CollectiveTimeoutError needs >= 2 ranks, one of them gone: its text is checked by
    # tests/distributed/test_agreement.py (a rank that dies)
    assert set(snapkeep.errors.__all__) - {"SnapshotError", "CollectiveTimeoutError"} \
        <= set(ERRORS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(WARNINGS))
def test_warning_text_once_at_the_call_site(name: str, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    row = WARNINGS[name]
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row.make(tmp_path)
    mine = [w for w in caught if issubclass(w.category, row.kind)
            and row.fragments[0] in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    message = str(mine[0].message)
    for fragment in row.fragments:
        assert fragment in message, (fragment, message)
    assert pathlib.Path(mine[0].filename).resolve() == THIS_FILE, mine[0].filename
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and row.fragments[0] in r.getMessage()], "the warning was logged as well"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(RESUME_NOTICES))
def test_resume_notice_text_once(name: str, tmp_path: Path,
                                 capfd: pytest.CaptureFixture[str]) -> None:
    row = RESUME_NOTICES[name]
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row.make(tmp_path)
    assert not [w for w in caught if "snapshot_iter_9" in str(w.message)]
    lines = [line for line in capfd.readouterr().err.splitlines()
             if line.startswith(row.fragments[0])]
    assert len(lines) == 1, lines
    for fragment in row.fragments:
        assert fragment in lines[0], (fragment, lines[0])
