"""The PyTorch Lightning door: :class:`SnapkeepCheckpointIO` and :class:`ModelCheckpoint`.

Two lines change in a Lightning script::

    from snapkeep.lightning import ModelCheckpoint, SnapkeepCheckpointIO

    trainer = Trainer(plugins=[SnapkeepCheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True)])
    trainer.fit(model, ckpt_path="last")

What they change (each from Lightning's own code, 2.4-2.6):

- **The save returns once staged.** ``save_checkpoint`` copies the checkpoint dict into reused
  CPU buffers (never a GPU clone, unlike ``AsyncCheckpointIO``) and a snapkeep writer
  (default :class:`~snapkeep.writing.ThreadWriter`) commits it in the background: temp file,
  ``fsync``, ``os.replace`` (object stores: one upload), with its checksum manifest
  ``.snapkeep/<name>.json``. Lightning's file names and directories are kept.
- **Removal waits for the commit.** ``remove_checkpoint`` (top-k eviction, the previous
  ``last``) runs only once every save made before it is committed; if that save fails, the old
  file is kept (a warning says so). So the stock ``ModelCheckpoint`` is already safe with it.
- **``last`` is a reference.** With snapkeep's :class:`ModelCheckpoint`, ``save_last=True``
  (and ``"link"``) writes ``last.ckpt`` as a small alias record naming the snapshot of that
  step (under 200 bytes), written after that snapshot is committed, instead of a second full
  copy. An alias works on every storage (object stores have no links) and can never name an
  uncommitted file. ``load_checkpoint`` resolves it; ``torch.load`` does not (load the file
  it names). When no snapshot of the step exists (a top-k that did not keep it), ``last.ckpt``
  is written in full, once, as Lightning does.
- **``ckpt_path="last"`` resolves by step, and the load verifies.** Lightning takes the newest
  ``last*`` file by mtime and never checks it. snapkeep's :class:`ModelCheckpoint` resolves
  ``"last"`` to the snapshot with the highest step recorded in its manifest, and
  ``load_checkpoint`` checks it against its checksum: a corrupt or truncated file is skipped
  with a ``RuntimeWarning`` naming it and the snapshot loaded instead, the next older one that
  verifies (:class:`~snapkeep.errors.NoValidSnapshotError` when none does; nothing deleted).
- **One trainer per directory.** The first save into a directory takes its lock
  (``.snapkeep/``, ``flock``; :class:`~snapkeep.errors.StoreLockedError` names the holder);
  ``teardown`` waits for pending commits and releases it.
- **Exact continuation at epoch boundaries.** snapkeep's :class:`ModelCheckpoint` keeps the
  global random generators (Python, NumPy, torch) in its callback state, so a run resumed
  from an end-of-epoch snapshot draws the same shuffles and dropout masks. Lightning itself
  restarts a plain ``DataLoader`` mid-epoch from the start of its order, so a mid-epoch
  snapshot resumes with a different data order: save at epoch ends for bit-identical runs.

- **Preemption.** On SIGTERM Lightning raises ``SIGTERMException`` at the next batch; snapkeep's
  :class:`ModelCheckpoint` then saves a snapshot of that step (as ``save_on_exception=True``
  would) and ``teardown`` commits it before the exception leaves ``fit`` (a ``SystemExit``
  without a code: exit status 0, Lightning's). Lightning's SLURM handler (SIGUSR1 with
  auto-requeue) saves ``hpc_ckpt_N.ckpt`` and requeues at once: such saves return only once
  committed. Both snapshots are mid-epoch: they resume, but not bit-identically (see above).

Scope: :class:`SnapkeepCheckpointIO` is called on global rank 0 only, as every
``CheckpointIO``; sharded strategies (FSDP, DeepSpeed, ModelParallel) bypass ``CheckpointIO``
and so this door (use :class:`snapkeep.Checkpointer` with ``sharded=True`` there).

Why a name's step comes from the manifest, not the name: Lightning's names need not contain
the step (``'{epoch}-{val_loss:.2f}'``), so the step recorded in each snapshot's manifest at
commit (``checkpoint['global_step']``, under the same checksum-verified commit) orders them,
never the mtime.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from snapkeep.errors import SnapshotCorruptError, SnapshotTimeoutError, StoreLockedError
from snapkeep.store import (
    MANIFEST_DIR,
    Entry,
    FilenameTemplate,
    ManifestError,
    Retain,
    SnapshotStore,
    StoreLock,
    load_file,
    manifest_path,
    read_manifest,
    warn_user,
)
from snapkeep.training import RngState
from snapkeep.writing import ThreadWriter, Writer

__all__ = ["ALIAS_FORMAT", "ModelCheckpoint", "SnapkeepCheckpointIO"]

logger = logging.getLogger(__name__)

#: The ``format`` of an alias record (``last.ckpt`` naming a committed snapshot).
ALIAS_FORMAT = "snapkeep.lightning.alias/1"
#: An alias record is read only when the file is at most this many bytes.
_ALIAS_MAX_BYTES = 4096
#: The store's template: it keys the directory lock and the sweep of temp files. Lightning's
#: names come from no template, so the snapshots are listed from their manifests.
_TEMPLATE = FilenameTemplate("lightning-{.iteration}.ckpt")


#: Lightning's SLURM handler (SIGUSR1) saves ``hpc_ckpt_N.ckpt`` and requeues the job at once:
#: those saves return only once committed.
_HPC_PREFIX = "hpc_ckpt_"


def _split(path: str) -> tuple[str, str]:
    directory, _, name = path.rpartition("/")
    if not name:
        raise ValueError(f"path must name a checkpoint file, got {path!r}")
    return directory or ".", name


#: directory URL -> the SnapkeepCheckpointIO of this process holding it: the store
#: lock (flock) refuses other processes; within one process two IOs on one directory are refused
#: here (as two open Checkpointers are).
_OPEN: weakref.WeakValueDictionary[str, SnapkeepCheckpointIO] = weakref.WeakValueDictionary()


class _Directory:
    """One checkpoint directory: its store and, once saved into, its lock."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.lock: StoreLock | None = None
        self.locked = False


class SnapkeepCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through snapkeep (see the module docstring).

    Pass it as ``Trainer(plugins=[SnapkeepCheckpointIO()])`` or
    ``Fabric(plugins=[SnapkeepCheckpointIO()])``. Lightning calls it on global rank 0 only.

    Args:
        writer: the snapkeep writer that stages and commits (no ``out_dir`` of its own);
            default a :class:`~snapkeep.writing.ThreadWriter` (a CPU copy into reused buffers,
            written on a background thread, one snapshot in flight: a save waits for the
            previous commit). ``SimpleWriter()`` saves synchronously. :meth:`teardown` only
            waits (the writer serves the next ``fit`` too); :meth:`close` finalizes it.
        storage_options: fsspec options (endpoint, credentials) for URL paths (``s3://``)
            when ``writer`` is not given. Object-store saves stream the staged tensors to one
            upload; no second in-memory copy of the whole checkpoint is made.
        weights_only: how ``load_checkpoint`` unpickles when Lightning passes ``None``
            (default True: tensors, containers and primitive values only, plus snapkeep's
            allow-list; pass False only for trusted files holding other objects).

    Raises:
        TypeError: ``writer`` is not a snapkeep writer, or ``weights_only`` not a bool.
        ValueError: ``writer`` has an ``out_dir`` of its own.
    """

    def __init__(self, writer: Writer | None = None, *,
                 storage_options: Mapping[str, Any] | None = None,
                 weights_only: bool = True) -> None:
        if writer is not None and not isinstance(writer, Writer):
            raise TypeError(f"writer must be a snapkeep.writing writer (ThreadWriter(), "
                            f"SimpleWriter(), ProcessWriter(), ...), got {writer!r}")
        if writer is not None and writer.out_dir:
            raise ValueError(f"writer has out_dir {writer.out_dir!r}; Lightning names each "
                             "checkpoint's directory: pass a writer without out_dir")
        if not isinstance(weights_only, bool):
            raise TypeError(f"weights_only must be True or False, got {weights_only!r}")
        self._writer = writer if writer is not None else ThreadWriter(
            storage_options=storage_options)
        self._weights_only = weights_only
        self._directories: dict[str, _Directory] = {}
        self._guard = threading.RLock()
        self._idle = threading.Condition(self._guard)
        self._last_handle: Any = None
        # actions waiting for a commit, per handle: (priority, action); aliases run first
        self._waiting: dict[int, list[tuple[int, Callable[[], None]]]] = {}
        self._aliases: dict[str, str] = {}  # alias path -> the snapshot path it names
        self._doomed: set[str] = set()  # removals held back while an alias names them
        self._closed = False

    # -- directories ---------------------------------------------------------------------------
    def _directory(self, directory: str, *, lock: bool) -> _Directory:
        with self._guard:
            found = self._directories.get(directory)
            if found is None:
                storage, path = self._writer.storage_for(directory)
                found = _Directory(SnapshotStore(storage, path, _TEMPLATE))
                self._directories[directory] = found
            if lock and not found.locked:
                storage, path = found.store.storage, found.store.directory
                storage.makedirs(path)
                key = storage.url(path)
                other = _OPEN.get(key)
                if other is not None and other is not self:
                    raise StoreLockedError(
                        f"{storage.url(path)!r} is in use by another SnapkeepCheckpointIO of "
                        "this process; two on one directory would delete each other's "
                        "checkpoints. teardown() or close() the other one first")
                found.lock = found.store.lock()
                _OPEN[key] = self  # None on object stores (nothing locked)
                found.locked = True
                found.store.sweep()  # temp files of a killed writer
            return found

    def open(self, directory: str) -> None:
        """Create ``directory``, take its lock and remove temp files a killed run left there
        (done by the first save into it otherwise; :class:`ModelCheckpoint` calls it in
        ``setup`` so a second trainer is refused before it trains).

        Raises:
            StoreLockedError: another live process holds the directory.
            SnapshotStorageError: it cannot be created.
        """
        self._directory(os.fspath(directory), lock=True)

    def entries(self, directory: str) -> list[Entry]:
        """The snapkeep snapshots in ``directory`` (files with a manifest recording a step),
        oldest first by that step, then name. Not verified; alias records and files without a
        manifest (written by another ``CheckpointIO``) are not listed."""
        store = self._directory(os.fspath(directory), lock=False).store
        storage = store.storage
        files = set(storage.list_names(store.directory))
        manifest_dir = storage.join(store.directory, MANIFEST_DIR)
        found = []
        for name in storage.list_names(manifest_dir):
            snapshot = name[:-len(".json")]
            if not name.endswith(".json") or snapshot not in files:
                continue
            try:
                manifest = read_manifest(storage, storage.join(manifest_dir, name))
            except (ManifestError, OSError) as e:
                logger.warning("ignoring the manifest %s: %s", name, e)
                continue
            if manifest is None or manifest.step is None or manifest.name != snapshot:
                continue
            found.append(Entry(name=snapshot, path=storage.join(store.directory, snapshot),
                               key=(float(manifest.step),), step=manifest.step))
        found.sort(key=lambda e: (e.key, e.name))
        return found

    def newest(self, directory: str) -> str | None:
        """The path of the snapshot with the highest step in ``directory`` (None when there is
        none); :meth:`load_checkpoint` verifies it and falls back from it."""
        self.wait()
        found = self.entries(directory)
        return found[-1].path if found else None

    # -- CheckpointIO ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` (a CPU copy into reused buffers) and commit it to ``path`` in
        the background with its checksum manifest; returns once staged.

        Args:
            checkpoint: Lightning's checkpoint dict (tensors on any device, plain values).
            path: the file to write (local path or fsspec URL).
            storage_options: not supported per call (give them to the constructor).

        Raises:
            TypeError: ``storage_options`` given (as ``TorchCheckpointIO``).
            SnapshotSaveError: an earlier background save failed (raised once, cause chained).
            StoreLockedError: another process holds the directory.
        """
        if storage_options is not None:
            raise TypeError("SnapkeepCheckpointIO.save_checkpoint takes no storage_options; "
                            "pass them as SnapkeepCheckpointIO(storage_options=...)")
        directory, name = _split(os.fspath(path))
        found = self._directory(directory, lock=True)
        step = checkpoint.get("global_step")
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        retain = Retain(store=found.store)  # records the commit; Lightning's top-k retains
        writer: Any = self._writer  # snapkeep's writers take these extras (as the Checkpointer)
        handle = writer(name, directory, checkpoint, step=step, retain=retain)
        if handle is not None:
            with self._guard:
                self._last_handle = handle
            if name.startswith(_HPC_PREFIX):
                handle.wait()  # Lightning requeues the SLURM job right after this save
        with self._guard:  # a full save replaces an alias of the same name
            self._aliases.pop(found.store.storage.join(found.store.directory, name), None)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (an alias record is resolved to the snapshot it
        names) after checking it against its manifest. A snapshot that fails (corrupt,
        truncated, missing) is skipped with a ``RuntimeWarning`` naming it and the snapshot
        loaded instead: the next older one (by step) that verifies. A file without a manifest
        (written by another ``CheckpointIO``) is loaded as is, unverified (logged).

        Args:
            path: the checkpoint (or alias) to load.
            map_location: as ``torch.load``'s (default ``'cpu'``; Lightning moves the state to
                the module's device).
            weights_only: ``None`` uses the constructor's (default True).

        Returns:
            The checkpoint dict.

        Raises:
            FileNotFoundError: nothing at ``path`` and no snapshot to fall back to.
            NoValidSnapshotError: no snapshot at or before it verifies (each reason listed).
            UnsafeSnapshotError: the file needs ``weights_only=False``; nothing executed.
        """
        self.wait()
        weights_only = self._weights_only if weights_only is None else bool(weights_only)
        location = "cpu" if map_location is None else map_location
        directory, name = _split(os.fspath(path))
        store = self._directory(directory, lock=False).store
        storage = store.storage
        requested = storage.join(store.directory, name)
        target = self._resolve_alias(store, requested)
        entries = self.entries(directory)
        chosen = next((e for e in entries if e.path == target), None)
        if chosen is None:
            if storage.exists(target):
                logger.info("%s has no snapkeep manifest: loaded unverified", target)
                return dict(load_file(storage, target, map_location=location,
                                      weights_only=weights_only))
            if target == requested or not entries:
                raise FileNotFoundError(f"checkpoint not found: {target}")
            # an alias naming a deleted snapshot: fall back from the newest at or below its step
            candidates = entries
        else:
            candidates = [e for e in entries if e.key <= chosen.key and e.path != chosen.path]
            candidates.append(chosen)
        skipped: list[str] = []

        def loader(entry: Entry, data: bytes | None) -> Any:
            state = load_file(storage, entry.path, map_location=location,
                              weights_only=weights_only, data=data)
            if not isinstance(state, Mapping):
                raise SnapshotCorruptError(f"{entry.path} is not a Lightning checkpoint (a "
                                           f"{type(state).__name__}, not a dict)")
            return state

        found = store.load_newest(loader, candidates=candidates,
                                  on_skip=lambda e, why: skipped.append(f"{e.path}: {why}"))
        if found is None:  # unreachable: candidates is not empty
            raise FileNotFoundError(f"checkpoint not found: {target}")
        entry, state = found
        if entry.path != target:
            warn_user(f"checkpoint {target} failed verification ({'; '.join(skipped) or 'missing'}"
                      f"); loaded {entry.path} (step {entry.step}) instead, the newest older "
                      "snapshot that verifies", RuntimeWarning)
        logger.info("loaded %s (step %s), verified", entry.path, entry.step)
        return dict(state)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` with its manifest, once every save made before
        this call is committed (at once when none is pending); if one of them fails, the file
        is kept (a warning says so). A snapshot an alias still names is deleted when the alias
        moves on. A failed delete is logged, not raised."""
        target = os.fspath(path)
        self._after_commit(lambda: self._remove_now(target), priority=1,
                           what=f"removing {target}")

    def link(self, target: Any, alias: Any) -> None:
        """Make ``alias`` (``last.ckpt``) name the snapshot ``target`` (same directory), once
        every save made before this call is committed: a small record written atomically
        (see the module docstring)."""
        target_path, alias_path = os.fspath(target), os.fspath(alias)
        self._after_commit(lambda: self._write_alias(target_path, alias_path), priority=0,
                           what=f"pointing {alias_path} at {target_path}")

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every save so far is committed and the removals and aliases waiting
        for them are done; raise a background save's error, once.

        Raises:
            SnapshotTimeoutError: still pending after ``timeout_s`` seconds.
            SnapshotSaveError: a background save failed.
        """
        self._writer.wait(timeout_s)
        with self._idle:  # the committed future's callbacks run after its waiters wake
            if not self._idle.wait_for(lambda: not self._waiting, timeout_s):
                raise SnapshotTimeoutError(f"removals and aliases still waiting after "
                                           f"{timeout_s} s")

    def teardown(self) -> None:
        """Wait for pending commits (and the removals and aliases after them), then release the
        directory locks (Lightning calls it at the end of ``fit``/``validate``/...).

        Raises:
            SnapshotSaveError: a background save failed and was not reported yet.
        """
        try:
            self.wait()
        finally:
            with self._guard:
                for found in self._directories.values():
                    if found.lock is not None:
                        found.lock.release()
                    if found.locked:
                        key = found.store.storage.url(found.store.directory)
                        if _OPEN.get(key) is self:
                            del _OPEN[key]
                    found.lock, found.locked = None, False

    def close(self) -> None:
        """:meth:`teardown`, then finalize the writer; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.teardown()
        finally:
            self._writer.finalize()

    @property
    def writer(self) -> Writer:
        """The snapkeep writer (read-only)."""
        return self._writer

    # -- after the commit ----------------------------------------------------------------------
    def _after_commit(self, action: Callable[[], None], *, priority: int, what: str) -> None:
        with self._guard:
            handle = self._last_handle
            if handle is None or handle.committed.done():
                failed = handle is not None and (handle.committed.cancelled()
                                                 or handle.committed.exception() is not None)
                if not failed:
                    action()
                    return
                logger.warning("not %s: the save before it failed", what)
                return
            key = id(handle)
            if key not in self._waiting:
                self._waiting[key] = []
                handle.committed.add_done_callback(lambda f, k=key: self._run_waiting(f, k))
            self._waiting[key].append((priority, action))

    def _run_waiting(self, future: Any, key: int) -> None:
        """In the writer's thread once a save is committed (or failed): aliases, then removals;
        after a failure neither (the previous files stay)."""
        with self._guard:
            actions = sorted(self._waiting.pop(key, []), key=lambda a: a[0])
            if future.cancelled() or future.exception() is not None:
                self._idle.notify_all()
                if actions:
                    warn_user(f"a checkpoint save failed ({future.exception()!r}); the "
                              "checkpoints it was to replace are kept", RuntimeWarning)
                return
            try:
                for _, action in actions:
                    try:
                        action()
                    except Exception:  # a failed delete or alias never stops training
                        logger.exception("after the commit of %s", future.result().path)
            finally:
                self._idle.notify_all()

    def _remove_now(self, path: str) -> None:
        with self._guard:
            directory, name = _split(path)
            store = self._directory(directory, lock=False).store
            full = store.storage.join(store.directory, name)
            if full in self._aliases.values():
                self._doomed.add(full)  # removed when its alias moves on
                return
            self._aliases.pop(full, None)
            store.delete(Entry(name=name, path=full, key=(), step=None), by="lightning")

    def _write_alias(self, target: str, alias: str) -> None:
        with self._guard:
            directory, name = _split(alias)
            store = self._directory(directory, lock=False).store
            storage = store.storage
            alias_path = storage.join(store.directory, name)
            target_path = storage.join(store.directory, _split(target)[1])
            if _split(target)[0] != directory:
                raise ValueError(f"an alias names a snapshot of its own directory: {alias} "
                                 f"cannot name {target}")
            manifest = read_manifest(storage, manifest_path(storage, target_path))
            record = {"format": ALIAS_FORMAT, "target": storage.basename(target_path),
                      "step": manifest.step if manifest is not None else None}
            storage.write_bytes(alias_path, json.dumps(record).encode())
            try:  # a full last.ckpt it replaced had a manifest of its own
                storage.remove(manifest_path(storage, alias_path))
            except FileNotFoundError:
                pass
            previous = self._aliases.get(alias_path)
            self._aliases[alias_path] = target_path
            if previous is not None and previous != target_path and previous in self._doomed:
                self._doomed.discard(previous)
                store.delete(Entry(name=storage.basename(previous), path=previous, key=(),
                                   step=None), by="lightning")

    @staticmethod
    def _resolve_alias(store: SnapshotStore, path: str) -> str:
        """``path``, or the snapshot its alias record names."""
        storage = store.storage
        try:
            if storage.size(path) > _ALIAS_MAX_BYTES:
                return path
            data = storage.read_bytes(path, max_bytes=_ALIAS_MAX_BYTES)
        except FileNotFoundError:
            return path
        if not data.startswith(b"{"):
            return path
        try:
            record = json.loads(data)
        except ValueError:
            return path
        if not isinstance(record, dict) or record.get("format") != ALIAS_FORMAT \
                or not isinstance(record.get("target"), str) or "/" in record["target"]:
            return path
        return storage.join(storage.dirname(path), record["target"])

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_writer", None) is not None \
                and self._writer.pending:
            logger.warning("SnapkeepCheckpointIO garbage-collected with saves pending")


def _snapkeep_io(trainer: Any) -> SnapkeepCheckpointIO | None:
    io = getattr(trainer.strategy, "checkpoint_io", None)
    return io if isinstance(io, SnapkeepCheckpointIO) else None


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments) made safe with
    :class:`SnapkeepCheckpointIO` (see the module docstring): ``save_last`` (``True`` or
    ``"link"``) writes an alias record after the commit instead of a second full copy,
    ``ckpt_path="last"`` resolves to the snapshot with the highest step, removals wait for the
    commit (in the IO), the directory is locked at ``setup``, and the global random generators
    are kept in the callback state (exact continuation from end-of-epoch snapshots).

    With another ``CheckpointIO`` it behaves as Lightning's, plus the random generators.
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        io = _snapkeep_io(trainer)
        if io is not None and trainer.is_global_zero and stage == "fit" and self.dirpath:
            io.open(os.fspath(self.dirpath))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["snapkeep_rng"] = RngState().state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("snapkeep_rng")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "snapkeep_rng"})
        if rng is not None:
            RngState().load_state_dict(rng)

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        io = _snapkeep_io(trainer)
        if io is None or not self.save_last:
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        filepath = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        previous, self.last_model_path = self.last_model_path, filepath
        saved = self._last_checkpoint_saved
        if saved and saved != filepath and self.save_top_k != 0 \
                and self._last_global_step_saved == trainer.global_step:
            if trainer.is_global_zero:
                io.link(saved, filepath)  # after the snapshot of this step is committed
            trainer.strategy.barrier()
        else:
            self._save_checkpoint(trainer, filepath)  # no snapshot of this step: one full write
        if previous and previous != filepath and self._should_remove_checkpoint(
                trainer, previous, filepath):
            self._remove_checkpoint(trainer, previous)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """As Lightning's; on SIGTERM (Lightning's ``SIGTERMException``, raised at the next
        batch after the signal) a snapshot of the current step is saved even without
        ``save_on_exception=True``; ``teardown`` (run by Lightning before the exception leaves
        ``fit``) commits it. The exception is a ``SystemExit`` without a code (exit status 0)."""
        if isinstance(exception, SIGTERMException) and _snapkeep_io(trainer) is not None \
                and not self.save_on_exception \
                and self._last_global_step_saved != trainer.global_step:
            self.save_on_exception = True
            try:
                super().on_exception(trainer, pl_module, exception)
            finally:
                self.save_on_exception = False
            return
        super().on_exception(trainer, pl_module, exception)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        io = _snapkeep_io(trainer)
        if io is None or not self.dirpath:
            return super()._find_last_checkpoints(trainer)
        newest = io.newest(os.fspath(self.dirpath))
        return {newest} if newest is not None else set()
