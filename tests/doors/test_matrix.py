"""The door x guarantee matrix: every front door runs the same scenarios on the same engine, on
every storage it takes.

A door is a fixture (:class:`Door`): how a user of it trains ``steps`` (resuming first), saving a
snapshot at every step with a ``val_loss`` metric, under a retention policy. A storage is a
fixture (:class:`Place`): a local directory, fsspec's ``memory://`` or S3 on a real moto server
(one for the session), with a way to list, read, plant and corrupt files there behind the door's
back. A scenario is a test taking a door and a place: each runs per door x storage. A new door
gets its row by adding one :class:`Door` subclass to ``DOORS``; what it cannot do (a storage, a
memory tier, on-error snapshots, a worker script for the subprocess scenarios) it leaves at the
defaults and those cells skip, saying why.

Scenarios: junk and foreign files (skipped on load, never counted or deleted by retention), a
misspelled ``KeepBest`` metric (refused before anything is deleted), the lock, a first run and a
resume said on stderr, fallback past a corrupt newest snapshot (said on stderr), the reading
doors (``load_latest``, ``snapkeep verify``) agreeing with the training door, unreadable metadata
(a sharded snapshot's DCP ``.metadata``, a single file's manifest), on-error snapshots and the
errors of a failing save or restore (naming the snapshot and step), kill -9 at a random step and
a rerun (bit-identical, data position and RNG included), exit without ``close``/``finalize``,
the memory tier (RAM resume, lost node RAM, a corrupt RAM copy: every row, the tier being one
layer on the session), and incremental snapshots (a damaged blob written again: every row
writing them; the others skip saying why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import signal
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from framework_doors import HFDoor, LightningDoor

import snapkeep
from snapkeep._core.storage import TEMP_MARKER, Storage, resolve_storage
from snapkeep.cli import cli
from snapkeep.errors import SnapshotError, StateMismatchError, StoreLockedError
from snapkeep.retention import KeepBest, KeepLatest, RetentionPolicy
from snapkeep.training import ExtensionsManager, extensions
from snapkeep.writing import ThreadWriter
from support import killing
from support import zygote as zygote_module
from support.leak_check import LONG_LIVED_PIDS
from support.storage_backends import BUCKET, cli_flags, s3_options
from support.zygote import Zygote

X = torch.linspace(-1, 1, 24).reshape(6, 4)
WORKER = pathlib.Path(__file__).with_name("matrix_worker.py")
WORKER_STEPS = 8  # the worker's 2 epochs of 4 batches
ON_ERROR = ".on-error"


def val_loss(step: int) -> float:
    return 1.0 / (1 + step)


def _model(features: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, features)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    optimizer.zero_grad()
    model(X[step % 6]).pow(2).sum().backward()
    optimizer.step()


class Failure(RuntimeError):
    """What a training step raises in the on-error scenario."""


# -- storages ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Place:
    """Where one test's snapshots go: ``directory`` as a user passes it to the door (a local
    ``pathlib.Path``, or a ``memory://`` / ``s3://`` URL with ``storage_options``), and the
    fsspec view of it the test lists, reads, plants and corrupts files through."""

    kind: str  # local | memory | s3
    directory: pathlib.Path | str
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def _storage(self) -> tuple[Storage, str]:
        return resolve_storage(str(self.directory), None, self.storage_options or None)

    @property
    def shown(self) -> str:
        """The directory as the doors name it on stderr."""
        storage, path = self._storage
        return storage.url(path)

    def sub(self, name: str) -> Place:
        """Another directory on the same storage (a reference run's)."""
        directory = self.directory / name if isinstance(self.directory, pathlib.Path) \
            else f"{self.directory}/{name}"
        return Place(self.kind, directory, self.storage_options)

    def _path(self, name: str) -> str:
        storage, path = self._storage
        return storage.join(path, name) if name else path

    def _fs(self) -> Any:
        storage, path = self._storage
        storage.fs.invalidate_cache(path)  # s3fs caches listings: the door wrote behind it
        return storage.fs

    def names(self, sub: str = "") -> list[str]:
        """The names in the directory (or its subdirectory ``sub``), sorted."""
        fs = self._fs()
        try:
            entries = fs.ls(self._path(sub), detail=False, refresh=True) \
                if self.kind == "s3" else fs.ls(self._path(sub), detail=False)
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(str(e).rstrip("/")) for e in entries)

    def exists(self, name: str) -> bool:
        return bool(self._fs().exists(self._path(name)))

    def read(self, name: str) -> bytes:
        return bytes(self._fs().cat_file(self._path(name)))

    def write(self, name: str, data: bytes) -> None:
        fs, path = self._fs(), self._path(name)
        if self.kind == "local":
            fs.makedirs(os.path.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)

    def remove(self, name: str) -> None:
        self._fs().rm(self._path(name), recursive=True)

    def corrupt(self, name: str) -> str:
        """Flip one byte in the middle of snapshot ``name`` (its largest file for a directory);
        returns the file's path relative to the directory."""
        fs, path = self._fs(), self._path(name)
        if fs.isdir(path):
            files = fs.find(path, detail=True)
            victim = max(files, key=lambda f: files[f]["size"])
            name = f"{name}/{os.path.basename(victim)}"
        data = bytearray(self.read(name))
        data[len(data) // 2] ^= 0xFF
        self.write(name, bytes(data))
        return name

    def cli(self, *args: str) -> Any:
        """``snapkeep ARGS... DIR`` (with this storage's ``-o`` options), in this process."""
        return CliRunner().invoke(cli, [*args, str(self.directory),
                                        *cli_flags(self.storage_options)])

    def env(self) -> dict[str, str]:
        """A worker's environment: the storage options it passes to the door."""
        return dict(killing.env(),
                    SNAPKEEP_TEST_STORAGE_OPTIONS=json.dumps(self.storage_options))

    def temps(self) -> list[str]:
        """snapkeep temp files left anywhere under the directory."""
        fs = self._fs()
        try:
            found = fs.find(self._path(""))
        except FileNotFoundError:
            return []
        return [f for f in found if TEMP_MARKER in os.path.basename(f)]


STORAGES = ["local", "memory", pytest.param("s3", marks=pytest.mark.s3)]


# -- doors ---------------------------------------------------------------------------------------


class Door:
    """One front door, driven as its users drive it.

    The capabilities below default to what every door has; a door that offers more says so and
    accepts the matching arguments of :meth:`train` (the matrix passes only those).
    """

    name = ""
    sharded = False  # snapshots are DCP directories
    #: Storage kinds :meth:`train` takes (``directory`` a ``memory://``/``s3://`` URL and, for
    #: S3, ``storage_options``); the other kinds' cells skip.
    storages: frozenset[str] = frozenset({"local"})
    #: :meth:`train` takes ``fail_at``: the step raises :class:`Failure`, after the door saved an
    #: on-error snapshot.
    on_error_snapshots = False
    #: :meth:`train` takes ``memory`` (a ``snapkeep.MemoryTier``), ``every`` (storage snapshot
    #: interval) and ``length`` (the run's planned steps: ``stop`` before it is an unfinished run).
    memory_tier = False
    #: :meth:`train` takes ``features``: the model's output features (another shape than the
    #: snapshots': the failing-restore scenario).
    resizable = False

    def snapshot_name(self, step: int) -> str:
        raise NotImplementedError

    def metadata_file(self, name: str) -> tuple[str, bool] | None:
        """The file (relative to the directory) that makes snapshot ``name`` readable when it
        is unreadable, and whether the reading doors then skip the snapshot (True) or load it
        unverified (False); None: the unreadable-metadata scenario skips."""
        return None

    def on_error_name(self, failed_step: int) -> str:
        """The on-error snapshot's name when step ``failed_step`` raised."""
        return self.snapshot_name(failed_step) + ON_ERROR

    def train(self, directory: pathlib.Path | str, stop: int, *,
              keep: RetentionPolicy | None = None, features: int = 2,
              storage_options: dict[str, Any] | None = None, fail_at: int | None = None,
              memory: snapkeep.MemoryTier | None = None, every: int = 1,
              length: int | None = None) -> torch.nn.Module:
        """Resume from ``directory`` if it holds a snapshot, then train up to step ``stop``
        saving a snapshot at every step (every ``every``); returns the model, a
        ``Linear(4, features)``."""
        raise NotImplementedError

    #: :meth:`train_frozen` exists: the door writes incremental snapshots, whose frozen
    #: tensors are blobs (the damaged-blob scenario).
    frozen_blobs = False
    #: Why the door's row writes no incremental snapshots (``frozen_blobs`` False).
    incremental_skip = "writes no incremental snapshots"

    def train_frozen(self, directory: pathlib.Path | str, stop: int, *,
                     storage_options: dict[str, Any] | None = None,
                     after_save: Any = None) -> tuple[torch.nn.Module, torch.nn.Module]:
        """As :meth:`train`, with a frozen 1 MiB ``Linear(512, 512)`` backbone beside the model
        (one blob); ``after_save(step)`` runs in the training process once the step's
        snapshot is committed. Returns the model and the backbone."""
        raise NotImplementedError

    #: Python code opening the door on ``DIR`` and keeping it open (in another process).
    hold_code = ""

    def plant_other_door(self, directory: pathlib.Path | str, step: int,
                         storage_options: dict[str, Any] | None = None) -> str | None:
        """Save, through another door, a snapshot named like this door's at ``step``
        (``snapshot_name(step)``) into ``directory``; None: the other-door scenario skips
        (``other_door_skip`` says why)."""
        return None

    #: Why :meth:`plant_other_door` cannot apply to this door.
    other_door_skip = "no other door writes snapshots of this door's kind and names"

    def worker_command(self, directory: str, steps: int, exit_at: int | None) -> list[str] | None:
        """The command of this door's worker (see matrix_worker.py: a DataLoader, dropout, a
        snapshot every step, ``step N DIGEST`` lines, ``final.pt``), or None: the subprocess
        scenarios skip."""
        return None


class CheckpointerDoor(Door):
    name = "checkpointer"
    incremental = False  # Checkpointer(incremental=True): unchanged tensors written once
    incremental_skip = "incremental=False in this row; the -incremental row writes them"
    storages = frozenset({"local", "memory", "s3"})
    on_error_snapshots = True
    memory_tier = True
    resizable = True

    def snapshot_name(self, step: int) -> str:
        return f"ckpt_{step}"

    def metadata_file(self, name: str) -> tuple[str, bool] | None:
        # DCP's .metadata of a directory (skipped); a single file's manifest (unverified)
        return (f"{name}/.metadata", True) if self.sharded else (f".snapkeep/{name}.json", False)

    def train(self, directory: pathlib.Path | str, stop: int, *,
              keep: RetentionPolicy | None = None, features: int = 2,
              storage_options: dict[str, Any] | None = None, fail_at: int | None = None,
              memory: snapkeep.MemoryTier | None = None, every: int = 1,
              length: int | None = None) -> torch.nn.Module:
        model, optimizer = _model(features)
        with snapkeep.Checkpointer(directory, keep=keep, sharded=self.sharded, every=every,
                                   storage_options=storage_options, memory=memory,
                                   incremental=self.incremental) as ckpt:
            state = {"model": model, "optimizer": optimizer}
            start = ckpt.load(into=state) or 0
            for step in range(start + 1, stop + 1):
                try:
                    _step(model, optimizer, step)
                    if step == fail_at:
                        raise Failure(f"step {step} failed")
                except Failure:
                    ckpt.save(step, state, on_error=True)  # as docs/plain-loop.md shows
                    raise
                ckpt.save(step, state, metrics={"val_loss": val_loss(step)})
        return model

    hold_code = "import snapkeep\nheld = snapkeep.Checkpointer(DIR)\n"

    def plant_other_door(self, directory: pathlib.Path | str, step: int,
                         storage_options: dict[str, Any] | None = None) -> str | None:
        if self.sharded:
            return None
        return plant_with_the_extension(directory, "ckpt_{.iteration}", step, storage_options)

    def worker_command(self, directory: str, steps: int, exit_at: int | None) -> list[str] | None:
        return [sys.executable, str(WORKER), self.name, directory, str(steps),
                *([str(exit_at)] if exit_at is not None else [])]


#: Why the sharded kinds write no incremental snapshots.
SHARDED_NOT_INCREMENTAL = (
    "no incremental sharded snapshots (incremental=True with sharded snapshots raises "
    "ValueError): torch.distributed.checkpoint's planner and storage writer write every "
    "rank's shards as files of the snapshot's own directory, which DCP's load reads there; "
    "referring to blobs saved before would take a StorageWriter/StorageReader pair of "
    "snapkeep's own")


class ShardedCheckpointerDoor(CheckpointerDoor):
    """The Checkpointer's DCP kind (one process: no process group needed)."""

    name = "checkpointer-sharded"
    sharded = True
    incremental_skip = SHARDED_NOT_INCREMENTAL
    other_door_skip = ("its snapshots are directories: another door's single file under its "
                       "names is refused at start by the kind check "
                       "(tests/storage/test_store_contract.py), never listed")
    hold_code = "import snapkeep\nheld = snapkeep.Checkpointer(DIR, sharded=True)\n"


class ExtensionDoor(Door):
    name = "extension"
    incremental = False  # snapshot(incremental=True)
    incremental_skip = CheckpointerDoor.incremental_skip
    mode = extensions.SnapshotMode.DEFAULT
    storages = frozenset({"local", "memory", "s3"})
    on_error_snapshots = True
    memory_tier = True
    resizable = True

    def snapshot_name(self, step: int) -> str:
        return f"snapshot_iter_{step}"

    def metadata_file(self, name: str) -> tuple[str, bool] | None:
        return f".snapkeep/{name}.json", False

    def on_error_name(self, failed_step: int) -> str:
        # ppe's name: the manager's iteration, the last one completed
        return self.snapshot_name(failed_step - 1) + ON_ERROR

    def train(self, directory: pathlib.Path | str, stop: int, *,
              keep: RetentionPolicy | None = None, features: int = 2,
              storage_options: dict[str, Any] | None = None, fail_at: int | None = None,
              memory: snapkeep.MemoryTier | None = None, every: int = 1,
              length: int | None = None) -> torch.nn.Module:
        model, optimizer = _model(features)
        manager = ExtensionsManager(model, optimizer, max_epochs=1,
                                    iters_per_epoch=length or stop,
                                    writer=ThreadWriter(out_dir=str(directory),
                                                        storage_options=storage_options))
        manager.extend(extensions.snapshot(autoload=True, retention=keep,
                                           snapshot_on_error=True, snapshot_mode=self.mode,
                                           incremental=self.incremental),
                       trigger=(every, "iteration"))
        if memory is not None:
            manager.extend(extensions.memory_tier(memory))
        try:
            while not manager.stop_trigger and manager.iteration < stop:
                with manager.run_iteration(step_optimizers=["main"]):
                    step = manager.iteration + 1
                    snapkeep.report({"val_loss": val_loss(step)})
                    model(X[step % 6]).pow(2).sum().backward()
                    if step == fail_at:
                        raise Failure(f"step {step} failed")
            assert optimizer is manager.optimizers["main"]
        finally:
            manager.finalize()
        return model

    def plant_other_door(self, directory: pathlib.Path | str, step: int,
                         storage_options: dict[str, Any] | None = None) -> str | None:
        if self.sharded:
            return None
        return plant_with_the_checkpointer(directory, "snapshot_iter_{step}", step,
                                           storage_options)

    hold_code = (
        "import torch\nfrom snapkeep.training import ExtensionsManager, extensions\n"
        "from snapkeep.writing import ThreadWriter\n"
        "model = torch.nn.Linear(4, 2)\n"
        "manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), "
        "max_epochs=1, iters_per_epoch=10, writer=ThreadWriter(out_dir=DIR))\n"
        "manager.extend(extensions.snapshot(autoload=True), trigger=(1, 'iteration'))\n"
        "manager.start_extensions()\n")

    def worker_command(self, directory: str, steps: int, exit_at: int | None) -> list[str] | None:
        return [sys.executable, str(WORKER), self.name, directory, str(steps),
                *([str(exit_at)] if exit_at is not None else [])]


class ShardedExtensionDoor(ExtensionDoor):
    """ppe's ``snapshot(snapshot_mode=SHARDED)`` (one process: plain DCP files)."""

    name = "extension-sharded"
    sharded = True
    incremental_skip = SHARDED_NOT_INCREMENTAL
    other_door_skip = ShardedCheckpointerDoor.other_door_skip
    mode = extensions.SnapshotMode.SHARDED
    hold_code = ExtensionDoor.hold_code.replace(
        "extensions.snapshot(autoload=True)",
        "extensions.snapshot(autoload=True, snapshot_mode=extensions.SnapshotMode.SHARDED)")

    def metadata_file(self, name: str) -> tuple[str, bool] | None:
        return f"{name}/.metadata", True


def _frozen_backbone() -> torch.nn.Module:
    """A frozen 1 MiB layer: one blob, written once, referred to by every later snapshot."""
    torch.manual_seed(1)
    backbone = torch.nn.Linear(512, 512, bias=False)
    backbone.requires_grad_(False)
    return backbone


class IncrementalCheckpointerDoor(CheckpointerDoor):
    """The Checkpointer with incremental snapshots (a skeleton file + shared blobs)."""

    name = "checkpointer-incremental"
    incremental = True
    frozen_blobs = True

    def train_frozen(self, directory: pathlib.Path | str, stop: int, *,
                     storage_options: dict[str, Any] | None = None,
                     after_save: Any = None) -> tuple[torch.nn.Module, torch.nn.Module]:
        model, optimizer = _model()
        backbone = _frozen_backbone()
        with snapkeep.Checkpointer(directory, storage_options=storage_options,
                                   incremental=True) as ckpt:
            state = {"model": model, "backbone": backbone, "optimizer": optimizer}
            start = ckpt.load(into=state) or 0
            for step in range(start + 1, stop + 1):
                _step(model, optimizer, step)
                ckpt.save(step, state, metrics={"val_loss": val_loss(step)}).wait()
                if after_save is not None:
                    after_save(step)
        return model, backbone


class IncrementalExtensionDoor(ExtensionDoor):
    """ppe's snapshot extension with ``incremental=True``."""

    name = "extension-incremental"
    incremental = True
    frozen_blobs = True

    def train_frozen(self, directory: pathlib.Path | str, stop: int, *,
                     storage_options: dict[str, Any] | None = None,
                     after_save: Any = None) -> tuple[torch.nn.Module, torch.nn.Module]:
        model, optimizer = _model()
        backbone = _frozen_backbone()
        writer = ThreadWriter(out_dir=str(directory), storage_options=storage_options)
        manager = ExtensionsManager({"main": model, "backbone": backbone}, {"main": optimizer},
                                    max_epochs=1, iters_per_epoch=stop, writer=writer)
        manager.extend(extensions.snapshot(autoload=True, incremental=True),
                       trigger=(1, "iteration"))
        try:
            while not manager.stop_trigger:
                with manager.run_iteration(step_optimizers=["main"]):
                    step = manager.iteration + 1
                    snapkeep.report({"val_loss": val_loss(step)})
                    model(X[step % 6]).pow(2).sum().backward()
                writer.wait(timeout_s=120)
                if after_save is not None:
                    after_save(manager.iteration)
        finally:
            manager.finalize()
        return model, backbone


def plant_with_the_extension(directory: pathlib.Path | str, template: str, step: int,
                             storage_options: dict[str, Any] | None = None) -> str:
    """ppe's snapshot extension saves ``template`` at iteration ``step`` into ``directory``
    (the manager runs ``step`` empty iterations); returns the name."""
    model, optimizer = _model()
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=step,
                                writer=ThreadWriter(out_dir=str(directory),
                                                    storage_options=storage_options))
    manager.extend(extensions.snapshot(filename=template, autoload=False),
                   trigger=(step, "iteration"))
    try:
        while not manager.stop_trigger:
            with manager.run_iteration():
                pass
    finally:
        manager.finalize()
    return template.replace("{.iteration}", str(step))


def plant_with_the_checkpointer(directory: pathlib.Path | str, template: str, step: int,
                                storage_options: dict[str, Any] | None = None) -> str:
    """The Checkpointer saves ``template`` (a ``{step}`` template) at ``step`` into
    ``directory``; returns the name."""
    model, optimizer = _model()
    with snapkeep.Checkpointer(directory, template=template,
                               storage_options=storage_options) as ckpt:
        ckpt.save(step, {"model": model, "optimizer": optimizer})
    return template.replace("{step}", str(step))


DOORS = [CheckpointerDoor(), ShardedCheckpointerDoor(), ExtensionDoor(), ShardedExtensionDoor(),
         IncrementalCheckpointerDoor(), IncrementalExtensionDoor(),
         LightningDoor(), HFDoor()]


def capability(door: Any, name: str) -> Any:
    """``door``'s capability ``name``, or :class:`Door`'s default for a door that does not
    subclass it (a duck-typed row: ``name``, ``sharded``, ``snapshot_name``, ``train``,
    ``hold_code`` are all a row needs)."""
    return getattr(door, name, getattr(Door, name))


@pytest.fixture(params=DOORS, ids=lambda d: d.name)
def door(request: pytest.FixtureRequest) -> Door:
    return request.param


@pytest.fixture(params=STORAGES)
def place(request: pytest.FixtureRequest, door: Door, tmp_path: pathlib.Path) -> Iterator[Place]:
    """A fresh directory on one storage kind for ``door`` (skipped where the door cannot use
    the kind)."""
    kind = request.param
    storages = capability(door, "storages")
    if kind not in storages:
        pytest.skip(f"the {door.name} door takes {sorted(storages)} storage only")
    run = f"matrix-{uuid.uuid4().hex[:10]}"
    if kind == "local":
        yield Place(kind, tmp_path / run)
    elif kind == "memory":
        place = Place(kind, f"memory://snapkeep-matrix/{run}")
        yield place
        storage, path = place._storage
        if storage.fs.exists(path):
            storage.fs.rm(path, recursive=True)
    else:
        server = request.getfixturevalue("moto_server")
        yield Place(kind, f"s3://{BUCKET}/{run}", s3_options(server.endpoint))


def train(door: Door, place: Place, stop: int, **kwargs: Any) -> torch.nn.Module:
    """``door.train`` on ``place``, passing ``storage_options`` only where there are some."""
    if place.storage_options:
        kwargs["storage_options"] = place.storage_options
    return door.train(place.directory, stop, **kwargs)


def _snapshots(place: Place, door: Door) -> list[str]:
    """The door's snapshots (junk named like them included, on-error ones not), by step."""
    prefix = door.snapshot_name(0)[:-1]
    return sorted((n for n in place.names() if n.startswith(prefix)
                   and n[len(prefix):].isdigit()), key=lambda n: int(n[len(prefix):]))


def _plant_junk(place: Place, door: Door) -> list[str]:
    """Junk named like snapshots: random bytes and an empty file (for sharded doors: a
    directory with a marker of random bytes beside a shard, and one with an empty marker)."""
    junk = [door.snapshot_name(999), door.snapshot_name(800)]
    if door.sharded:
        place.write(f"{junk[0]}/.snapkeep-commit.json", os.urandom(512))
        place.write(f"{junk[0]}/__0_0.distcp", os.urandom(4096))
        place.write(f"{junk[1]}/.snapkeep-commit.json", b"")
        return junk
    place.write(junk[0], os.urandom(4096))
    place.write(junk[1], b"")
    return junk


def _local_only(place: Place, why: str) -> None:
    if place.kind != "local":
        pytest.skip(f"{place.kind}: {why}")


NO_LOCK = "object stores and memory:// are not locked (the lock is a local flock; docs: " \
    "Checkpointer's directory argument), and memory:// is not shared with another process"
ONE_PROCESS = "memory:// lives in one process: a rerun in a new process starts with nothing"


# -- scenarios -----------------------------------------------------------------------------------


def test_junk_files_are_skipped_never_counted_nor_deleted(door: Door, place: Place,
                                                          capfd: Any) -> None:
    """Junk named like snapshots beside real ones, keep=3: the rerun resumes from the newest
    real one, retention keeps three real snapshots and leaves the junk alone; with the newest
    corrupted there is still one to fall back to. (Before: the Checkpointer counted the junk
    as its own: after two saves only one real snapshot was left.)"""
    train(door, place, 3, keep=KeepLatest(3))
    junk = _plant_junk(place, door)
    capfd.readouterr()
    train(door, place, 5, keep=KeepLatest(3))
    err = capfd.readouterr().err
    assert f"snapkeep: resuming from {door.snapshot_name(3)} (step 3) in {place.shown}" in err
    assert f"snapkeep: skipped {door.snapshot_name(999)} (step 999)" in err
    real = [door.snapshot_name(s) for s in (3, 4, 5)]
    assert _snapshots(place, door) == real + junk[::-1]  # by step: 3, 4, 5, 800, 999
    place.corrupt(door.snapshot_name(5))
    model = train(door, place, 5, keep=KeepLatest(3))  # falls back to 4, retrains step 5
    err = capfd.readouterr().err
    assert f"snapkeep: resuming from {door.snapshot_name(4)} (step 4) in {place.shown}" in err
    assert f"snapkeep: skipped {door.snapshot_name(5)} (step 5)" in err
    reference = train(door, place.sub("straight"), 5)
    assert torch.equal(model.weight, reference.weight)
    assert place.exists(junk[0]) and place.exists(junk[1])


def test_a_misspelled_keep_best_metric_is_refused_before_anything_is_deleted(
        door: Door, place: Place) -> None:
    """``KeepBest(1, 'val_los')`` while the snapshots record ``val_loss``: ValueError naming the
    metric before retention would delete anything. (Before, the Checkpointer logged a
    traceback after each commit and kept every snapshot.)"""
    train(door, place, 2)
    before = _snapshots(place, door)
    with pytest.raises(ValueError, match="val_los"):
        train(door, place, 6, keep=KeepBest(1, "val_los"))
    after = _snapshots(place, door)
    assert set(before) <= set(after)  # nothing of the earlier run deleted


def test_a_second_trainer_and_a_prune_are_refused_while_one_runs(
        door: Door, place: Place, zygote: Zygote, tmp_path: pathlib.Path) -> None:
    """A live trainer (another process) holds the directory: a second trainer gets
    StoreLockedError and ``snapkeep prune --yes`` refuses naming it, deleting nothing (before:
    prune deleted snapshots under the live trainer). Once it is gone (SIGKILL: the lock dies
    with it), both go ahead."""
    _local_only(place, NO_LOCK)
    assert isinstance(place.directory, pathlib.Path)
    train(door, place, 3)
    script = tmp_path / "holder.py"
    script.write_text(f"DIR = {str(place.directory)!r}\n{door.hold_code}"
                      "print('READY', flush=True)\nimport signal\nsignal.pause()\n")
    pid, lines = zygote.run(str(script), [], cwd=str(tmp_path), env=killing.env(),
                            fifo=str(tmp_path / "holder.fifo"), stderr=str(tmp_path / "err"))
    try:
        assert next(lines).strip() == "READY", (tmp_path / "err").read_text()
        with pytest.raises(StoreLockedError, match=f"pid {pid}"):
            train(door, place, 4)
        if not door.sharded:  # (snapkeep prune deletes single files only)
            result = place.cli("prune", "--keep-latest", "1", "--yes")
            assert result.exit_code == 1 and f"pid {pid}" in result.output, result.output
        assert _snapshots(place, door) == [door.snapshot_name(s) for s in (1, 2, 3)]
    finally:
        os.kill(pid, signal.SIGKILL)
        lines.close()
        assert zygote.wait(pid) == -signal.SIGKILL
    if door.sharded:
        return
    result = place.cli("prune", "--keep-latest", "1", "--yes")
    assert result.exit_code == 0, result.output
    assert _snapshots(place, door) == [door.snapshot_name(3)]
    train(door, place, 4)
    assert _snapshots(place, door) == [door.snapshot_name(3), door.snapshot_name(4)]


def _template(door: Door) -> str:
    """The door's snapshot names as a CLI template (``ckpt_{.iteration}``)."""
    return door.snapshot_name(0)[:-1] + "{.iteration}"


def test_another_template_and_another_spelling_are_refused_while_one_runs(
        door: Door, place: Place, zygote: Zygote, tmp_path: pathlib.Path) -> None:
    """One trainer owns the directory, whatever names its files: beside a live trainer of this
    door (another process), a Checkpointer of another template, on the directory spelled
    ``DIR/.``, is refused naming it, and so are ``snapkeep prune DIR/. -t`` with another
    spelling of the door's template (``{0.iteration}``) and ``snapkeep prune`` on a relative
    path without ``-t``; nothing of the live trainer's is deleted. (971f8e4: the lock was
    keyed by the template's text: the Checkpointer opened beside it and its sweep and
    retention reached the directory; the prunes of a Lightning or sub-directory store deleted
    the live trainer's snapshots.)"""
    _local_only(place, NO_LOCK)
    assert isinstance(place.directory, pathlib.Path)
    train(door, place, 3)
    before = _snapshots(place, door)
    script = tmp_path / "holder.py"
    script.write_text(f"DIR = {str(place.directory)!r}\n{door.hold_code}"
                      "print('READY', flush=True)\nimport signal\nsignal.pause()\n")
    pid, lines = zygote.run(str(script), [], cwd=str(tmp_path), env=killing.env(),
                            fifo=str(tmp_path / "holder.fifo"), stderr=str(tmp_path / "err"))
    try:
        assert next(lines).strip() == "READY", (tmp_path / "err").read_text()
        with pytest.raises(StoreLockedError, match=f"pid {pid}"):
            snapkeep.Checkpointer(f"{place.directory}/.", template="other_{step}", keep=1)
        spelled = _template(door).replace("{.iteration}", "{0.iteration}")
        result = CliRunner().invoke(cli, ["prune", f"{place.directory}/.", "-t", spelled,
                                          "--keep-latest", "1", "--yes"])
        assert result.exit_code == 1 and f"pid {pid}" in result.output, result.output
        result = CliRunner().invoke(cli, ["prune", os.path.relpath(place.directory),
                                          "--keep-latest", "1", "--yes"])
        assert result.exit_code == 1 and f"pid {pid}" in result.output, result.output
        assert _snapshots(place, door) == before
        assert not any(n.startswith("other_") for n in place.names())
    finally:
        os.kill(pid, signal.SIGKILL)
        lines.close()
        assert zygote.wait(pid) == -signal.SIGKILL


def test_a_resume_skips_another_doors_snapshot_naming_it(door: Door, place: Place,
                                                        capfd: Any) -> None:
    """Two doors on one directory, one after the other: another door's snapshot named like this
    door's, at a higher step (step 50), is skipped by this door's first run (which starts
    fresh) and by its resume (from its own newest), named on stderr each time; retention
    (keep=2) never counts or deletes it; the result is the uninterrupted run's, bit for bit.
    (971f8e4: a Lightning resume took a Checkpointer's ``ckpt_100`` and failed with
    ``KeyError: 'pytorch-lightning_version'``; the other doors loaded it into the wrong
    layout.)"""
    plant = getattr(door, "plant_other_door", None)
    storage_options = place.storage_options or None
    other = plant(place.directory, 50, storage_options) if plant is not None else None
    if other is None:
        pytest.skip(f"the {door.name} door: {capability(door, 'other_door_skip')}")
    assert door.snapshot_name(50) == other
    capfd.readouterr()
    train(door, place, 3, keep=KeepLatest(2))
    err = capfd.readouterr().err
    assert f"in {place.shown}, starting fresh" in err, err
    assert f"snapkeep: skipped {other} (step 50): a snapshot of the " in err, err
    model = train(door, place, 4, keep=KeepLatest(2))
    err = capfd.readouterr().err
    assert f"snapkeep: resuming from {door.snapshot_name(3)} (step 3) in {place.shown}" in err
    assert f"snapkeep: skipped {other} (step 50): a snapshot of the " in err, err
    assert _snapshots(place, door) == [door.snapshot_name(s) for s in (3, 4, 50)]
    reference = train(door, place.sub("straight"), 4)
    assert torch.equal(model.weight, reference.weight)


def test_the_cli_lists_and_verifies_the_directory_without_a_template(
        door: Door, place: Place) -> None:
    """``snapkeep ls`` and ``snapkeep verify`` without ``-t`` on the door's directory: exit 0,
    every snapshot with its step, and the newest as autoload's choice. (971f8e4: exit 2 on a
    Lightning ``dirpath`` with default names; that case: tests/test_cli_door_directories.py.)"""
    train(door, place, 3)
    result = place.cli("ls", "--json")
    assert result.exit_code == 0, result.output
    assert [(s["name"], s["step"]) for s in json.loads(result.output)["snapshots"]] == [
        (door.snapshot_name(s), s) for s in (1, 2, 3)]
    result = place.cli("verify")
    assert result.exit_code == 0, result.output
    assert f"autoload would resume from {door.snapshot_name(3)}" in result.output, result.output


def test_a_first_run_and_a_resume_are_said_on_stderr(door: Door, place: Place,
                                                     capfd: Any) -> None:
    train(door, place, 2)
    err = capfd.readouterr().err
    assert f"in {place.shown}, starting fresh" in err and "snapkeep: no snapshot of" in err
    train(door, place, 3)
    assert capfd.readouterr().err.splitlines()[0] == (
        f"snapkeep: resuming from {door.snapshot_name(2)} (step 2) in {place.shown}")
    result = place.cli("verify")  # no -t needed (before: exit 1, "no snapshots matching"
    assert result.exit_code == 0, result.output  # for a Checkpointer)


def test_the_reading_doors_agree_with_the_training_door(door: Door, place: Place) -> None:
    """``load_latest`` and ``snapkeep verify`` (without ``-t``: the template is found from the
    manifests) see the same newest valid snapshot as the training door, junk beside it."""
    train(door, place, 3)
    _plant_junk(place, door)
    template = door.snapshot_name(0)[:-1] + "{.iteration}"
    with pytest.warns(RuntimeWarning, match="skipping (sharded )?snapshot"):
        state = snapkeep.load_latest(place.directory, template=template,
                                     storage_options=place.storage_options or None)
    assert state is not None and state.get("step", 3) == 3
    result = place.cli("verify")
    assert door.snapshot_name(3) in result.output, result.output
    assert door.snapshot_name(999) in result.output  # the junk is named as not valid


def test_unreadable_metadata_every_reading_door_falls_back_the_same_way(
        door: Door, place: Place, capfd: Any) -> None:
    """The newest snapshot's metadata is unreadable (every byte flipped, the size kept): a
    sharded snapshot's DCP ``.metadata``, a single file's manifest (not JSON then). Every
    reading door -- the training door, ``load_latest`` and ``snapkeep verify`` -- makes the
    same choice: a sharded snapshot is skipped (the one before is resumed, said on stderr); a
    single file without a readable manifest is unverified, loaded completely, as a snapshot
    without manifest (ppe's) is.
    (Before: ``load_latest`` skipped the sharded one while ``Checkpointer(sharded=True).load``
    raised RankFailedError.)"""
    metadata_file = getattr(door, "metadata_file", None)
    declared = metadata_file(door.snapshot_name(3)) if metadata_file is not None else None
    if declared is None:
        pytest.skip(f"the {door.name} door names no metadata file of its snapshots")
    train(door, place, 3)
    name = door.snapshot_name(3)
    template = door.snapshot_name(0)[:-1] + "{.iteration}"
    path, skipped = declared
    size = len(place.read(path))  # the same size: a recorded size still matches
    place.write(path, bytes(b ^ 0xA5 for b in place.read(path)) if size else b"\xff")
    chosen, warned = (2, "skipping") if skipped else (3, "manifest")
    with pytest.warns(RuntimeWarning, match=warned):
        state = snapkeep.load_latest(place.directory, template=template,
                                     storage_options=place.storage_options or None)
    assert state is not None
    if "step" in state:
        assert state["step"] == chosen
    result = place.cli("verify")
    assert f"autoload would resume from {door.snapshot_name(chosen)}" in result.output, \
        result.output
    capfd.readouterr()
    with contextlib.nullcontext() if skipped else pytest.warns(RuntimeWarning, match="manifest"):
        model = train(door, place, 4)
    err = capfd.readouterr().err
    assert f"snapkeep: resuming from {door.snapshot_name(chosen)} (step {chosen}) in " \
        f"{place.shown}" in err, err
    if skipped:
        assert f"snapkeep: skipped {name} (step 3)" in err and os.path.basename(path) in err, err
    reference = train(door, place.sub("straight"), 4)
    assert torch.equal(model.weight, reference.weight)


def test_an_on_error_snapshot_is_named_as_such_never_resumed_nor_deleted(
        door: Door, place: Place, capfd: Any) -> None:
    """A step raises: the door keeps the state under the on-error name (``<name>.on-error``),
    the loop's own error surfaces, and that snapshot is never resumed from nor deleted by
    retention (keep=1); ``snapkeep verify`` still needs no ``-t`` beside it (before: "holds
    snapshots of 2 templates" for a Checkpointer's directory, exit 2)."""
    if not capability(door, "on_error_snapshots"):
        pytest.skip(f"the {door.name} door takes no on-error snapshot")
    train(door, place, 3, keep=KeepLatest(1))
    with pytest.raises(Failure, match="step 5 failed"):
        train(door, place, 6, keep=KeepLatest(1), fail_at=5)
    on_error = door.on_error_name(5)
    assert [n for n in place.names() if n.endswith(ON_ERROR)] == [on_error]
    assert _snapshots(place, door) == [door.snapshot_name(4)]
    capfd.readouterr()
    model = train(door, place, 6, keep=KeepLatest(1))
    assert f"snapkeep: resuming from {door.snapshot_name(4)} (step 4)" in capfd.readouterr().err
    assert _snapshots(place, door) == [door.snapshot_name(6)] and place.exists(on_error)
    reference = train(door, place.sub("straight"), 6)
    assert torch.equal(model.weight, reference.weight)
    result = place.cli("verify")
    assert result.exit_code == 0 and door.snapshot_name(6) in result.output, result.output


def test_a_failing_save_names_the_snapshot_and_step_and_keeps_foreign_files(
        door: Door, place: Place) -> None:
    """A user's directory (a file in it) sits at the name the step-3 snapshot commits to: the
    save fails, its error names the snapshot and the step, the directory and its file are left
    as they were, the earlier snapshots are intact, and the rerun (the directory moved away)
    resumes from the newest of them. (Before, a sharded door wrote its shards into the user's
    directory, committed it, and retention later deleted it with the user's file.)"""
    if not door.sharded:
        _local_only(place, "a name held by a directory blocks a single file's commit only on a "
                    "local file system (object stores have no directories)")
    train(door, place, 2, keep=KeepLatest(2))
    squatter = door.snapshot_name(3)
    place.write(f"{squatter}/notes.txt", b"the user's")
    with pytest.raises(SnapshotError) as raised:
        train(door, place, 5, keep=KeepLatest(2))
    assert re.search(rf"{re.escape(squatter)}'? \(step 3\)", str(raised.value)), raised.value
    assert place.read(f"{squatter}/notes.txt") == b"the user's"
    assert place.names(squatter) == ["notes.txt"]
    assert _snapshots(place, door)[:2] == [door.snapshot_name(1), door.snapshot_name(2)]
    place.remove(squatter)
    train(door, place, 5, keep=KeepLatest(2))
    assert _snapshots(place, door) == [door.snapshot_name(4), door.snapshot_name(5)]


def test_a_failing_restore_names_the_snapshot_and_step_and_loads_nothing(
        door: Door, place: Place) -> None:
    """The model changed shape since the snapshots: the resume refuses with
    StateMismatchError naming the snapshot and its step, loading nothing and deleting
    nothing. (Before, the sharded Checkpointer raised SnapshotCorruptError, "corrupt: Size
    mismatch", naming no step.)"""
    if not capability(door, "resizable"):
        pytest.skip(f"the {door.name} door's train takes no other model shape")
    train(door, place, 3)
    with pytest.raises(StateMismatchError, match=rf"{door.snapshot_name(3)} \(step 3\)"):
        train(door, place, 5, features=3)
    assert _snapshots(place, door) == [door.snapshot_name(s) for s in (1, 2, 3)]


def test_a_damaged_blob_is_written_again_and_every_snapshot_loads(
        door: Door, place: Place, capfd: Any) -> None:
    """Incremental snapshots over a frozen backbone: steps 1, 2 saved; the backbone's blob gets
    other bytes of the same size; ``snapkeep verify`` names the blob and the two snapshots that
    refer to it (exit 1); the same process saves 3 and 4, which check the blob (not only its
    size) and write it again from the live bytes; then every snapshot verifies and a restart
    resumes from step 4, ending as the uninterrupted run. (Before: steps 3 and 4 referred to
    the bad blob and the restart raised NoValidSnapshotError.)"""
    if not capability(door, "frozen_blobs"):
        pytest.skip(f"the {door.name} door: {capability(door, 'incremental_skip')}")
    options = {"storage_options": place.storage_options} if place.storage_options else {}
    blobs_dir = ".snapkeep/blobs"
    damaged: dict[str, bytes] = {}

    def damage(step: int) -> None:
        if step != 2:
            return
        (area,) = place.names(blobs_dir)
        (digest,) = place.names(f"{blobs_dir}/{area}")  # the backbone's (the rest is inline)
        path = f"{blobs_dir}/{area}/{digest}"
        good = place.read(path)
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF
        place.write(path, bytes(bad))
        damaged[path] = good
        result = place.cli("verify")
        assert result.exit_code == 1, result.output
        assert re.search(rf"BAD BLOB +\S*{digest}: .*referred to by 2 snapshots: "
                         rf"{door.snapshot_name(1)}, {door.snapshot_name(2)} ", result.output), \
            result.output

    door.train_frozen(place.directory, 4, after_save=damage, **options)
    ((path, good),) = damaged.items()
    assert place.read(path) == good  # written again by step 3's save
    result = place.cli("verify")
    assert result.exit_code == 0 and "BAD BLOB" not in result.output, result.output
    capfd.readouterr()
    model, backbone = door.train_frozen(place.directory, 6, **options)
    assert f"snapkeep: resuming from {door.snapshot_name(4)} (step 4)" in capfd.readouterr().err
    reference, reference_backbone = door.train_frozen(place.sub("straight").directory, 6,
                                                      **options)
    assert torch.equal(model.weight, reference.weight)
    assert torch.equal(backbone.weight, reference_backbone.weight)


# -- kill -9 and exit without close: the door's worker in a subprocess ---------------------------


#: What the zygote imports once (each worker it forks starts with them imported).
PRELOAD = ["torch", "snapkeep", "snapkeep.training", "snapkeep.sharded_checkpoint",
           "torchdata.stateful_dataloader", "s3fs"]


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """The session's worker zygote (tests/support/zygote.py): a worker run costs its own steps,
    not an interpreter start and torch's import (~3 s each on 2 busy cores)."""
    forks = Zygote(PRELOAD, killing.env())
    LONG_LIVED_PIDS.add(forks.process.pid)  # outlives the test that starts it
    try:
        yield forks
    finally:
        forks.stop()


def _run(zygote: Zygote, command: list[str], place: Place, cwd: pathlib.Path, *,
         kill_at: int | None = None) -> tuple[int, list[tuple[int, str]], str]:
    """Run a worker (``command``: ``[sys.executable, script, *argv]``) in ``cwd``, forked by
    the zygote; with ``kill_at``, SIGKILL it as soon as it reports that step. Returns its exit
    status, its ``(step, digest)`` lines and its stderr."""
    assert command[0] == sys.executable, command
    if pathlib.Path(command[1]).name == "continuation_worker.py":  # the Lightning and HF rows
        zygote = zygote_module.frameworks(killing.env())  # their imports done once too
    cwd.mkdir(parents=True, exist_ok=True)
    run = uuid.uuid4().hex[:8]
    fifo, stderr = cwd / f"stdout-{run}.fifo", cwd / f"stderr-{run}.txt"
    pid, lines = zygote.run(command[1], command[2:], cwd=str(cwd), env=place.env(),
                            fifo=str(fifo), stderr=str(stderr))
    steps: list[tuple[int, str]] = []
    code: int | None = None
    try:
        for line in lines:
            if line.startswith("step "):
                _, step, digest = line.split()
                steps.append((int(step), digest))
                if kill_at is not None and int(step) >= kill_at:
                    os.kill(pid, signal.SIGKILL)
                    break
        lines.close()
        code = zygote.wait(pid)
    finally:
        if code is None:  # the test failed while the worker ran
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            zygote.wait(pid)
        fifo.unlink()
    err = stderr.read_text()
    stderr.unlink()
    return code, steps, err


_REFERENCES: dict[str, tuple[list[tuple[int, str]], dict[str, Any]]] = {}


def _reference(door: Door, zygote: Zygote, tmp_path_factory: pytest.TempPathFactory,
               ) -> tuple[list[tuple[int, str]], dict[str, Any]]:
    """The uninterrupted worker run of ``door`` (on local storage; once per session): its step
    lines and final state."""
    if door.name not in _REFERENCES:
        cwd = tmp_path_factory.mktemp(f"reference-{door.name}")
        command = capability(door, "worker_command")(str(cwd / "ckpt"), WORKER_STEPS, None)
        assert command is not None
        code, steps, err = _run(zygote, command, Place("local", cwd / "ckpt"), cwd)
        assert code == 0, err[-3000:]
        assert [s for s, _ in steps] == list(range(1, WORKER_STEPS + 1))
        _REFERENCES[door.name] = (steps, killing.final_state(cwd))
    return _REFERENCES[door.name]


def _resumed_step(err: str, door: Door) -> int:
    """The step the ``snapkeep: resuming from ...`` line names (0 for a fresh start)."""
    lines = [line for line in err.splitlines() if line.startswith("snapkeep: resuming from")
             or line.startswith("snapkeep: no snapshot of")]
    assert len(lines) == 1, err[-3000:]
    if "no snapshot of" in lines[0]:
        return 0
    return int(lines[0].split("(step ")[1].split(")")[0])


#: The doors whose subprocess scenario also runs on S3: one of each kind (a single file by one
#: PUT; DCP's files, then the marker); the extensions commit through the same engine.
S3_WORKERS = {"checkpointer", "checkpointer-sharded"}


def test_exit_without_close_then_kill_9_then_rerun_ends_bit_identical(
        door: Door, place: Place, tmp_path: pathlib.Path, zygote: Zygote,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Three runs of the same command, one after another:

    1. it ends the process at a random step without ``close``/``finalize`` (a script that
       forgets it): it exits 0, its newest snapshot is that step's, committed (``snapkeep
       verify``), and nothing is torn or left as a temp file;
    2. the rerun resumes from that step (said on stderr) and is SIGKILLed right after it
       reported a later random step (a snapshot may be in flight);
    3. the rerun resumes from a committed snapshot at most that step and runs to the end.

    Every step after a resume feeds the same batch and draws the same dropout mask as the
    uninterrupted run (compared step by step: data position and RNG), and the end state
    (parameters, optimizer, torch RNG) is bit-identical to it.
    """
    if place.kind == "memory":
        pytest.skip(ONE_PROCESS)
    if place.kind == "s3" and door.name not in S3_WORKERS:
        pytest.skip(f"time: on S3 the subprocess scenario runs for {sorted(S3_WORKERS)}, whose "
                    "commits (one PUT; DCP files then the marker) are this door's too")
    seed = random.randrange(2 ** 32)
    chosen = random.Random(seed)
    exit_at = chosen.randrange(1, 4)
    kill_at = chosen.randrange(exit_at + 2, WORKER_STEPS - 1)
    where = f"seed {seed}: exit at {exit_at}, kill at {kill_at}"
    worker_command = getattr(door, "worker_command", None)
    if worker_command is None or worker_command(str(place.directory), WORKER_STEPS, None) is None:
        pytest.skip(f"the {door.name} door has no worker script")
    command = worker_command(str(place.directory), WORKER_STEPS, exit_at)
    rerun = worker_command(str(place.directory), WORKER_STEPS, None)
    expected, final = _reference(door, zygote, tmp_path_factory)
    cwd = tmp_path / "run"

    code, steps, err = _run(zygote, command, place, cwd)
    assert code == 0 and steps == expected[:exit_at], f"{where}\n{err[-3000:]}"
    assert _snapshots(place, door)[-1] == door.snapshot_name(exit_at), where
    result = place.cli("verify")
    assert result.exit_code == 0 and "autoload would resume from " \
        f"{door.snapshot_name(exit_at)}" in result.output, result.output
    assert place.temps() == [], where

    code, steps, err = _run(zygote, rerun, place, cwd, kill_at=kill_at)
    assert code == -signal.SIGKILL, f"{where}: not killed\n{err[-3000:]}"
    assert _resumed_step(err, door) == exit_at, where
    assert steps == expected[exit_at:kill_at], where

    code, steps, err = _run(zygote, rerun, place, cwd)
    assert code == 0, f"{where}\n{err[-3000:]}"
    resumed = _resumed_step(err, door)
    assert exit_at <= resumed <= kill_at, f"{where}: resumed at {resumed}"
    assert steps == expected[resumed:], f"{where}: batches or dropout differ after a resume " \
        f"at step {resumed}"
    killing.assert_identical(final, killing.final_state(cwd), where)
    assert place.temps() == [], where


# -- the memory tier -----------------------------------------------------------------------------


@pytest.mark.parametrize("ram", ["kept", "lost", "corrupt"])
def test_the_memory_tier_resumes_from_ram_or_falls_back_to_storage_saying_why(
        door: Door, place: Place, ram: str, tmp_path: pathlib.Path, capfd: Any) -> None:
    """RAM every step, storage every 2 steps; a run stops at step 5 before its end (storage
    holds 4, RAM 5). Its rerun resumes from RAM step 5 when the node's RAM is kept; when the RAM
    is lost (another node) or its copy corrupt, from storage's step 4, saying why on stderr.
    Either way it ends bit-identical to an uninterrupted run."""
    if not capability(door, "memory_tier"):
        pytest.skip(f"the {door.name} door has no memory tier")
    if place.kind != "local" and ram != "kept":
        pytest.skip(f"time: on {place.kind} the RAM resume runs (its step persisted there "
                    "first); what the tier says of lost or corrupt RAM does not depend on the "
                    "storage")
    root = tmp_path / "shm"
    memory = snapkeep.MemoryTier(every=1, replicas=0, root=str(root))
    train(door, place, 5, memory=memory, every=2, length=8)
    copies = sorted(root.glob("snapkeep-*/rank0/ram_iter_*"))
    assert [p.name for p in copies] == ["ram_iter_5"]
    if ram == "lost":
        for tier in root.iterdir():
            shutil.rmtree(tier)
    elif ram == "corrupt":
        data = bytearray(copies[0].read_bytes())
        data[len(data) // 2] ^= 0xFF
        copies[0].write_bytes(bytes(data))
    capfd.readouterr()
    model = train(door, place, 8, memory=memory, every=2, length=8)
    err = capfd.readouterr().err
    resumed = [line for line in err.splitlines() if line.startswith("snapkeep: resuming")]
    if ram == "kept":
        assert len(resumed) == 1 and resumed[0].startswith(
            "snapkeep: resuming from RAM step 5 (own copy; storage's newest: 4) in "), err
    else:
        assert resumed == [f"snapkeep: resuming from {door.snapshot_name(4)} (step 4) in "
                           f"{place.shown}"], err
        said = [line for line in err.splitlines() if line.startswith("snapkeep: memory tier (")]
        assert len(said) == 1 and said[0].endswith("; resuming from storage") and (
            ("no step held in RAM by every rank is at least storage's newest (step 4)"
             if ram == "corrupt" else "nothing held in RAM (the last run finished and removed "
             "it, or the node's RAM was lost)") in said[0]), err
        if ram == "corrupt":  # the copy's checksum named
            assert "rank 0's copy of step 5 from own: " in said[0] \
                and "checksum" in said[0] and "does not match" in said[0], err
    reference = train(door, place.sub("straight"), 8)
    assert torch.equal(model.weight, reference.weight)


# -- the doors' edges: adoption, references, copies, a user's directory (issue 32) -----------------
def _strip_snapkeep_records(place: Place, door: Door, names: list[str]) -> None:
    """Make the snapshots ``names`` look as the tool before snapkeep wrote them: no manifests,
    no lock directory (``.snapkeep/``), no commit markers in directories."""
    place.remove(".snapkeep")
    if door.sharded:
        for name in names:
            place.remove(f"{name}/.snapkeep-commit.json")


def test_adoption_snapshots_written_before_snapkeep_are_resumed_or_named_never_fresh(
        door: Door, place: Place, capfd: Any) -> None:
    """A directory of snapshots written before snapkeep was added (no manifest, no marker, no
    ``.snapkeep/``): the door resumes the newest (unverified, said on stderr) or refuses naming
    them; never a silent fresh start, and they are never overwritten or deleted."""
    if door.sharded and door.name != "hf":
        pytest.skip(f"the {door.name} door removes a snapshot directory without snapkeep's "
                    "commit marker as an interrupted save (it cannot tell one from a DCP "
                    "checkpoint written before snapkeep): not adopted yet")
    if getattr(door, "incremental", False):
        pytest.skip("incremental snapshots are snapkeep's own format (a skeleton naming blobs "
                    "under .snapkeep/): no tool wrote them before snapkeep")
    train(door, place, 3)
    names = _snapshots(place, door)
    _strip_snapkeep_records(place, door, names)
    capfd.readouterr()
    try:
        train(door, place, 5)
    except SnapshotError as e:  # refused, naming them: nothing written over them
        assert door.snapshot_name(3) in str(e), e
        assert "starting fresh" not in capfd.readouterr().err
    else:
        err = capfd.readouterr().err
        assert "starting fresh" not in err, err
        assert f"snapkeep: resuming from {door.snapshot_name(3)} (step 3) in {place.shown}" \
            in err, err
    assert all(place.exists(n) for n in names), place.names()  # never deleted


def test_an_alias_naming_a_file_out_of_its_directory_or_another_step_is_refused(
        door: Door, place: Place, capfd: Any) -> None:
    """A reference record (Lightning's ``last.ckpt`` alias) resolves only to a regular file of
    its own directory whose manifest records the alias's step; else it is refused, said on
    stderr, and the newest snapshot that verifies is loaded instead."""
    load_alias = getattr(door, "load_alias", None)
    if load_alias is None:
        pytest.skip(f"the {door.name} door writes no reference record (its snapshots are "
                    "named by the template only)")
    _local_only(place, "a symbolic link out of the directory is a local file system's")
    train(door, place, 3)
    outside = pathlib.Path(place.directory).parent / "outside.ckpt"
    torch.save({"global_step": 999}, outside)
    os.symlink(outside, pathlib.Path(place.directory) / "link")
    for target, step in (("link", 999), (door.snapshot_name(2), 3)):
        place.write("last.ckpt", json.dumps({"format": "snapkeep.lightning.alias/1",
                                             "target": target, "step": step}).encode())
        capfd.readouterr()
        assert load_alias(place.directory, "last.ckpt")["global_step"] == 3
        assert "last.ckpt: alias refused" in capfd.readouterr().err


def test_a_copied_snapshot_is_never_resumed_as_the_step_its_name_says(
        door: Door, place: Place, capfd: Any) -> None:
    """``cp -r`` of snapshot 3 (with its manifest) to the name of step 40: its records say step
    3, so it is skipped, named with why, on every restart; the newest real one is resumed."""
    train(door, place, 3)
    fs, src, dst = place._fs(), place._path(door.snapshot_name(3)), \
        place._path(door.snapshot_name(40))
    fs.copy(src, dst, recursive=door.sharded)
    if not door.sharded and place.exists(f".snapkeep/{door.snapshot_name(3)}.json"):
        place.write(f".snapkeep/{door.snapshot_name(40)}.json",
                    place.read(f".snapkeep/{door.snapshot_name(3)}.json"))
    for stop in (4, 5):
        capfd.readouterr()
        train(door, place, stop)
        err = capfd.readouterr().err
        assert f"snapkeep: resuming from {door.snapshot_name(stop - 1)} (step {stop - 1})" \
            in err, err
        assert f"snapkeep: skipped {door.snapshot_name(40)} (step 40)" in err, err


def test_a_users_directory_at_a_snapshot_name_is_refused_and_left_untouched(
        door: Door, place: Place) -> None:
    """A user's directory named like the snapshot of a step the run will save
    (``checkpoint-4/my_eval_notes.txt``): the save is refused with an error naming it, its file
    untouched; it is never committed, counted or rotated away."""
    _local_only(place, "object stores have no directories to hold a user's file apart")
    notes = f"{door.snapshot_name(2)}/my_eval_notes.txt"
    place.write(notes, b"eval notes")
    with pytest.raises((SnapshotError, OSError)) as raised:
        train(door, place, 4, keep=KeepLatest(1))
    assert door.snapshot_name(2) in str(raised.value), raised.value
    assert place.names(door.snapshot_name(2)) == ["my_eval_notes.txt"]
    assert place.read(notes) == b"eval notes"
