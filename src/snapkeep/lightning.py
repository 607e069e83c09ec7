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
- **``ckpt_path="last"`` resolves by step, and the load is the engine's resume.** Lightning
  takes the newest ``last*`` file by mtime and never checks it. snapkeep's
  :class:`ModelCheckpoint` resolves ``"last"`` to the snapshot with the highest step, and
  ``load_checkpoint`` resumes through the engine session
  (:meth:`snapkeep.session.Session.resume`, the Checkpointer's): verified against its checksum
  while it loads, safely unpickled, said on stderr (``snapkeep: resuming from NAME (step N) in
  DIR``); a corrupt or truncated file is skipped, named on stderr with why, and the next older
  one that verifies is loaded instead (:class:`~snapkeep.errors.NoValidSnapshotError` when none
  does; nothing deleted). Lightning checkpoints written before snapkeep was added (no
  manifest) count too, by the step in their name or the ``global_step`` they hold: the newest
  loads unverified, said on stderr; snapkeep never overwrites or removes them (a stock full
  ``last.ckpt`` stays; snapkeep's alias becomes ``last-v1.ckpt``). An alias is followed only
  to a regular file of its directory (no symlink) whose manifest records the alias's step;
  otherwise it is refused, said on stderr, and the newest verified snapshot loads. After a
  fallback, Lightning's ``Restored all states from ...`` names the file really loaded.
- **One trainer per directory.** The directory is opened as the Checkpointer opens its own
  (:meth:`snapkeep.session.Session.open`: created, checked writable, locked in ``.snapkeep/``,
  temp files of a killed writer swept) at ``setup`` (or the first save):
  :class:`~snapkeep.errors.StoreLockedError` names the holder, and ``snapkeep prune`` refuses
  while it runs; ``teardown`` waits for pending commits and releases it.
- **snapkeep's retention and metrics.** ``SnapkeepCheckpointIO(keep=...)`` retains after each
  commit as the Checkpointer's ``keep`` (its lineage: only this door's snapshots, never the
  newest; a misspelled ``KeepBest`` metric refused before anything is written or deleted);
  each manifest records Lightning's ``callback_metrics`` of its step.
- **Exact continuation from any snapshot.** snapkeep's :class:`ModelCheckpoint` keeps the
  global random generators as the training steps see them
  (:class:`snapkeep._core.state.rng_state.RngStream`: recorded at each training step's end, set
  back at the next one's start, Lightning's draws in between made from streams seeded from
  them) and each train loader's generator states, so a run resumed mid-epoch (torchdata's
  ``StatefulDataLoader``, whose position Lightning saves) or at an epoch's end (any loader),
  with any integer ``val_check_interval`` and ``every_n_train_steps``, draws the same
  shuffles and dropout masks as the uninterrupted run. A plain ``DataLoader`` resumed
  mid-epoch is restarted by Lightning from its epoch's start: the resume says so (a warning).
- **Preemption through snapkeep's agreement** (``ModelCheckpoint(preemption=True)``, the
  default): SIGTERM and SIGUSR1 are recorded by the run control every door uses
  (:class:`snapkeep.session.RunControl`, replacing Lightning's handlers while fitting);
  at the next training batch end every rank agrees, the snapshot of that step is committed,
  the run status (``.snapkeep/status.json``, ``snapkeep status``) becomes ``preempted`` and
  every rank exits with 143. The run status is kept otherwise too: ``running``, then
  ``finished`` or ``failed``.

Scope: :class:`SnapkeepCheckpointIO` is called on global rank 0 only, as every
``CheckpointIO``; sharded strategies (FSDP, DeepSpeed, ModelParallel) bypass ``CheckpointIO``
and so this door (use :class:`snapkeep.Checkpointer` with ``sharded=True`` there).

Why a name's step comes from the manifest, not the name: Lightning's names need not contain
the step (``'{epoch}-{val_loss:.2f}'``), so the step recorded in each snapshot's manifest at
commit (``checkpoint['global_step']``, under the same checksum-verified commit) orders them,
never the mtime.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import signal
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from snapkeep.distributed import (
    background_groups,
    is_distributed,
)
from snapkeep.errors import (
    SnapshotCorruptError,
    SnapshotTimeoutError,
    StoreLockedError,
    UnsafeSnapshotError,
)
from snapkeep.layout import (
    RngStream,
    generator_states,
    is_stateful_loader,
    set_generator_states,
)
from snapkeep.retention import RetentionPolicy, keep_policy
from snapkeep.session import (
    RunControl,
    RunLineage,
    Session,
    check_grace_s,
    preemption_signals,
    say,
    warn_user,
)
from snapkeep.store import (
    DECODE_ERRORS,
    MANIFEST_DIR,
    Entry,
    FilenameTemplate,
    ManifestError,
    SnapshotStore,
    check_timeout_s,
    load_file,
    manifest_path,
    read_manifest,
    step_template,
)
from snapkeep.tiers import IncrementalTracker, MemoryTier, TieredSession, check_memory, tiered
from snapkeep.writing import ThreadWriter, Writer

__all__ = ["ALIAS_FORMAT", "RUN_ID", "ModelCheckpoint", "SnapkeepCheckpointIO"]

logger = logging.getLogger(__name__)

#: The ``format`` of an alias record (``last.ckpt`` naming a committed snapshot).
ALIAS_FORMAT = "snapkeep.lightning.alias/1"
#: The run id in the manifest of every snapshot this door commits: retention (``keep=``) counts
#: and deletes only snapshots recording it, never another tool's file or junk named alike.
RUN_ID = "lightning"
#: An alias record is read only when the file is at most this many bytes.
_ALIAS_MAX_BYTES = 4096
#: The store's template when the names carry more than the step (Lightning's default
#: ``'{epoch}-{step}'``, metrics): the snapshots are listed from their manifests (the lock is
#: the directory's, whatever the template).
_TEMPLATE = FilenameTemplate("lightning-{step}.ckpt")
#: Default bound of the preemption agreement between ranks (seconds).
_TIMEOUT_S = 600.0


#: A step in a Lightning checkpoint's name (``epoch=1-step=20.ckpt``, ``step=20.ckpt``).
_NAMED_STEP = re.compile(r"(?:^|[-_])step=([0-9]+)(?:[-_.]|$)")
#: Lightning's "last" checkpoints (``last.ckpt``, ``last-v1.ckpt``), as its ModelCheckpoint
#: finds them for ``ckpt_path="last"``.
_LAST_NAME = re.compile(r"^last(-v?[0-9]+)?(\.|$)")
#: At most this many foreign files whose names hold no step (``last.ckpt``) have their step
#: read from their content (``global_step``; a memory map of a local file, nothing copied).
_PEEK_MAX_FILES = 8
#: Lightning's warning on ``ckpt_path="last"`` with nothing to load (its hint to set
#: ``save_last=True``): snapkeep's "starting fresh" line says it instead.
_NO_LAST_HINT = r'\.\w+\(ckpt_path="last"\) is set, but there is no last checkpoint available'
#: Temp files of snapkeep's writers hold this in their names.
_TEMP_MARKER = ".snapkeep-tmp."


#: Lightning's SLURM handler (SIGUSR1) saves ``hpc_ckpt_N.ckpt`` and requeues the job at once:
#: those saves return only once committed.
_HPC_PREFIX = "hpc_ckpt_"


def _split(path: str) -> tuple[str, str]:
    directory, _, name = path.rpartition("/")
    if not name:
        raise ValueError(f"path must name a checkpoint file, got {path!r}")
    return directory or ".", name


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Alias:
    """An alias record as read (untrusted): the file it names and the step it records, or
    why it is no valid record."""

    target: str = ""
    step: int | None = None
    problem: str = ""


def _read_alias(storage: Any, path: str) -> _Alias | None:
    """The alias record at ``path``, or None when the file is no record (a checkpoint: larger
    than :data:`_ALIAS_MAX_BYTES`, or not starting with ``{``; or nothing there). Bounded:
    at most :data:`_ALIAS_MAX_BYTES` read, regular files only, any nesting depth refused
    with a reason (never ``RecursionError``).

    Raises:
        SnapshotStorageError: the storage could not be reached.
    """
    try:
        if storage.size(path) > _ALIAS_MAX_BYTES:
            return None
        data = storage.read_bytes(path, max_bytes=_ALIAS_MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:  # a FIFO, a directory, grown past the bound
        return _Alias(problem=f"not readable as an alias record ({e})")
    if not data.lstrip().startswith(b"{"):
        return None
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return _Alias(problem=f"not a valid alias record ({type(e).__name__})")
    if not isinstance(record, dict) or record.get("format") != ALIAS_FORMAT:
        return _Alias(problem=f"not a {ALIAS_FORMAT!r} alias record")
    target, step = record.get("target"), record.get("step")
    if not isinstance(target, str) or target in ("", ".", "..") or len(target) > 255 \
            or any(c in target for c in "/\\\0"):
        return _Alias(problem=f"its target {str(target)[:80]!r} is not a file name in its "
                              "directory")
    if not isinstance(step, int) or isinstance(step, bool):
        return _Alias(target=target, problem=f"its step {str(step)[:40]!r} is not an int")
    return _Alias(target=target, step=step)


#: What reading a foreign file's step can raise (it is then unknown).
_PEEK_ERRORS: tuple[type[BaseException], ...] = (UnsafeSnapshotError, RecursionError,
                                                 *DECODE_ERRORS)


def _stored_step(storage: Any, path: str) -> int | None:
    """The ``global_step`` a Lightning checkpoint file holds (loaded safely, memory-mapped for
    a local file), or None when it cannot be read."""
    try:
        state = load_file(storage, path, weights_only=True)
    except _PEEK_ERRORS as e:
        logger.info("no step read from %s: %s", path, e)
        return None
    step = state.get("global_step") if isinstance(state, Mapping) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class _LightningStore(SnapshotStore):
    """A Lightning directory's snapshot store: the names its template parses (junk named
    alike included, so a resume skips it, naming it) and every other file whose manifest
    records a step (Lightning's names need not hold it: ``'{epoch}-{val_loss:.2f}'``)."""

    def entries(self) -> list[Entry]:
        found = {e.path: e for e in super().entries()}
        storage = self.storage
        manifest_dir = storage.join(self.directory, MANIFEST_DIR)
        try:
            manifests = storage.list_names(manifest_dir)
        except FileNotFoundError:
            manifests = []
        files: set[str] | None = None
        for name in manifests:
            if not name.endswith(".json"):
                continue
            snapshot = name[:-len(".json")]
            path = storage.join(self.directory, snapshot)
            if path in found:
                continue
            if files is None:
                files = set(storage.list_names(self.directory))
            if snapshot not in files:
                continue
            try:
                manifest = read_manifest(storage, storage.join(manifest_dir, name))
            except (ManifestError, OSError) as e:
                logger.warning("ignoring the manifest %s: %s", name, e)
                continue
            if manifest is None or manifest.step is None or manifest.name != snapshot:
                continue
            found[path] = Entry(name=snapshot, path=path, key=(float(manifest.step),),
                                step=manifest.step)
        return sorted(found.values(), key=lambda e: (e.key, e.name))


#: directory URL -> the SnapkeepCheckpointIO of this process holding it: the store
#: lock (flock) refuses other processes; within one process two IOs on one directory are refused
#: here (as two open Checkpointers are).
_OPEN: weakref.WeakValueDictionary[str, SnapkeepCheckpointIO] = weakref.WeakValueDictionary()


class _Directory:
    """One checkpoint directory: its store and the engine session on it (opened, with the
    lock, by the first save or :meth:`SnapkeepCheckpointIO.open`)."""

    def __init__(self, store: _LightningStore, session: Session | TieredSession,
                 template: str | None) -> None:
        self.store = store
        self.session = session  # a TieredSession with memory=: the tier is its layer
        self.template = template
        self.incremental: IncrementalTracker | None = None  # with incremental=True
        # the directory itself, however spelled (one trainer per directory, see the lock)
        self.key = os.path.realpath(store.directory) if store.storage.is_local \
            else store.storage.url(store.directory)


def _finite_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The one-number values of Lightning's ``callback_metrics`` (tensors or numbers) that are
    finite, as floats."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if hasattr(value, "numel") and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out


class SnapkeepCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through snapkeep (see the module docstring).

    Pass it as ``Trainer(plugins=[SnapkeepCheckpointIO()])`` or
    ``Fabric(plugins=[SnapkeepCheckpointIO()])``. Lightning calls it on global rank 0 only.

    Each directory it saves into is an engine session (:class:`snapkeep.session.Session`, as the
    Checkpointer's): the first save (or :meth:`open`) creates the directory, takes its lock,
    and removes what a killed writer left; a load verifies, falls back, loads safely and says
    what it resumed from on stderr; ``keep`` retains after each commit.

    Args:
        writer: the snapkeep writer that stages and commits (no ``out_dir`` of its own);
            default a :class:`~snapkeep.writing.ThreadWriter` (a CPU copy into reused buffers,
            written on a background thread, one snapshot in flight: a save waits for the
            previous commit). ``SimpleWriter()`` saves synchronously. :meth:`teardown` only
            waits (the writer serves the next ``fit`` too); :meth:`close` finalizes it.
        keep: snapkeep's retention after each commit, as the Checkpointer's ``keep``: an int N
            keeps the newest N by step; a policy from :mod:`snapkeep.retention` (``KeepBest``
            ranks by the metrics :class:`ModelCheckpoint` records: Lightning's
            ``callback_metrics``); ``None`` (default) deletes nothing (Lightning's own
            ``save_top_k`` still removes through :meth:`remove_checkpoint`). Only snapshots
            this door committed are counted or deleted, never the newest one. A ``KeepBest``
            metric no snapshot records raises ``ValueError`` at the save, before anything is
            written or deleted.
        storage_options: fsspec options (endpoint, credentials) for URL paths (``s3://``)
            when ``writer`` is not given. Object-store saves stream the staged tensors to one
            upload; no second in-memory copy of the whole checkpoint is made.
        weights_only: how ``load_checkpoint`` unpickles when Lightning passes ``None``
            (default True: tensors, containers and primitive values only, plus snapkeep's
            allow-list; pass False only for trusted files holding other objects).
        quiet: no resume notice on stderr (it is still logged at INFO).
        memory: keep the checkpoint in node RAM too (a ``snapkeep.MemoryTier``, as the
            Checkpointer's ``memory``): each save at a step that is a multiple of
            ``memory.every`` goes to RAM as well, from the copy the writer staged (no second
            staging), and :class:`ModelCheckpoint` keeps the steps between saves there (its
            ``on_train_batch_end``, every ``memory.every`` steps). ``ckpt_path="last"`` then
            resumes from RAM when the RAM step is at least the newest checkpoint's (verified
            against its checksum; said on stderr: ``snapkeep: resuming from RAM step N (own
            copy; storage's newest: M) in <tier>``), else from storage, saying why. The tier
            is removed at ``teardown`` once storage holds its newest step; otherwise it is
            kept for the restart. One process only (under DDP every rank holds the same
            state: use :class:`snapkeep.Checkpointer`). See
            :mod:`snapkeep._core.tiers.memory_tier`. Default None.
        incremental: write incremental checkpoints (as the Checkpointer's ``incremental``):
            each tensor storage of at least 1 MiB is stored once as a content-addressed blob
            in ``<dirpath>/.snapkeep/blobs/`` and the checkpoint refers to the blobs whose
            bytes did not change since the last save (a frozen backbone is written once).
            ``load_checkpoint``, ``snapkeep verify`` and ``snapkeep.load_latest`` check every
            blob used; a bare ``torch.load`` of such a file fails, pointing to ``snapkeep
            convert``. Default False.
        staging_budget: most bytes of host memory a checkpoint's staging may hold (an int of
            at least 1 MiB), or None (default: a full copy). A larger checkpoint is copied and
            written in pieces through that much memory; ``save_checkpoint`` returns once all of
            it is copied (Lightning's optimizers are not guarded, so nothing is copied after
            the call). See :class:`~snapkeep.writing.Writer`. With ``writer``: give it there.

    Raises:
        TypeError: ``writer`` is not a snapkeep writer, ``keep`` not an int or policy,
            ``weights_only``/``quiet``/``incremental`` not a bool, or ``memory`` not a
            ``MemoryTier``.
        ValueError: ``writer`` has an ``out_dir`` of its own; ``keep`` < 1.
    """

    def __init__(self, writer: Writer | None = None, *,
                 keep: int | RetentionPolicy | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 weights_only: bool = True, quiet: bool = False,
                 memory: MemoryTier | None = None, incremental: bool = False,
                 staging_budget: int | None = None) -> None:
        if writer is not None and not isinstance(writer, Writer):
            raise TypeError(f"writer must be a snapkeep.writing writer (ThreadWriter(), "
                            f"SimpleWriter(), ProcessWriter(), ...), got {writer!r}")
        if writer is not None and writer.out_dir:
            raise ValueError(f"writer has out_dir {writer.out_dir!r}; Lightning names each "
                             "checkpoint's directory: pass a writer without out_dir")
        for name, value in (("weights_only", weights_only), ("quiet", quiet),
                            ("incremental", incremental)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self._memory = check_memory(memory)
        self._incremental = incremental
        self._policy = keep_policy(keep)
        if staging_budget is not None and writer is not None:
            raise ValueError("staging_budget is given to the default ThreadWriter: with writer= "
                             "pass it to that writer (ThreadWriter(staging_budget=...))")
        if staging_budget is not None and memory is not None:
            raise ValueError(
                "staging_budget and memory= do not go together: the memory tier keeps a full "
                "copy of the checkpoint in node RAM, which no budget below its size can hold "
                "(as the Checkpointer). Pass staging_budget=None or memory=None")
        self._writer = writer if writer is not None else ThreadWriter(
            storage_options=storage_options, staging_budget=staging_budget)
        self._weights_only = weights_only
        self._quiet = quiet
        self._directories: dict[str, _Directory] = {}
        self._guard = threading.RLock()
        self._idle = threading.Condition(self._guard)
        self._last_handle: Any = None
        # actions waiting for a commit, per handle: (priority, action); aliases run first
        self._waiting: dict[int, list[tuple[int, Callable[[], None]]]] = {}
        self._aliases: dict[str, str] = {}  # alias path -> the snapshot path it names
        self._doomed: set[str] = set()  # removals held back while an alias names them
        self._metrics: dict[str, dict[str, float]] = {}  # path -> metrics of its next save
        self._loaded: tuple[str, str] | None = None  # (requested, loaded) of the last load
        self._written: set[str] = set()  # paths this IO saved or aliased (never foreign)
        self._from_ram: dict[str, Any] = {}  # the RAM snapshot last() chose, by its path
        self._closed = False

    # -- directories ---------------------------------------------------------------------------
    def _directory(self, directory: str, *, lock: bool, template: str | None = None
                   ) -> _Directory:
        with self._guard:
            found = self._directories.get(directory)
            if found is None or (template is not None and template != found.template
                                 and not found.session.opened):
                storage, path = self._writer.storage_for(directory)
                store = _LightningStore(storage, path, _TEMPLATE if template is None
                                        else step_template(template))
                lineage = found.session.lineage if found is not None \
                    else RunLineage.named(RUN_ID)
                if self._memory is not None and is_distributed():
                    raise ValueError(
                        "SnapkeepCheckpointIO(memory=...) is for one process: Lightning calls "
                        "the CheckpointIO on rank 0 only, while the memory tier is collective. "
                        "Under DDP use snapkeep.Checkpointer(memory=...), or memory=None")
                session = tiered(
                    Session(store, policy=self._policy, lineage=lineage, quiet=self._quiet,
                            shown_template=template or "*.ckpt", door=RUN_ID),
                    self._memory, template=template or "*.ckpt", quiet=self._quiet,
                    directory=os.path.abspath(path) if storage.is_local else storage.url(path))
                found = _Directory(store, session, template)
                self._directories[directory] = found
            if lock and not found.session.opened:
                claimed = found
                found.session.open(claim=lambda: self._claim(claimed))
            return found

    def _claim(self, found: _Directory) -> None:
        """Refuse a second IO of this process on the directory (the lock refuses other
        processes), and register this one."""
        other = _OPEN.get(found.key)
        if other is not None and other is not self:
            raise StoreLockedError(
                f"{found.key!r} is in use by another SnapkeepCheckpointIO of this process; two "
                "on one directory would delete each other's checkpoints. teardown() or close() "
                "the other one first")
        _OPEN[found.key] = self

    def open(self, directory: str, *, template: str | None = None) -> None:
        """Open ``directory`` as the Checkpointer opens its own (the engine session's start-up):
        create it, take its lock and remove temp files a killed run left there (done by the
        first save into it otherwise; :class:`ModelCheckpoint` calls it in ``setup`` so a
        second trainer is refused before it trains).

        Args:
            directory: the checkpoint directory (a local path or fsspec URL).
            template: the checkpoints' name with its step as ``{step}`` (``'ckpt_{step}'``,
                ``'step={step}.ckpt'``), when the names carry nothing else; then junk named
                alike is skipped by name.
                :class:`ModelCheckpoint` passes it when its ``filename`` allows.

        Raises:
            StoreLockedError: another live trainer holds the directory.
            SnapshotStorageError: it cannot be created or written.
            ValueError: ``template`` holds no ``{step}`` or another field.
        """
        self._directory(os.fspath(directory), lock=True, template=template)

    def entries(self, directory: str) -> list[Entry]:
        """The snapshots in ``directory``, oldest first by step, then name: files with a
        snapkeep manifest recording a step, and files the open template names. Not
        verified; alias records and files of another ``CheckpointIO`` are not listed."""
        return self._directory(os.fspath(directory), lock=False).store.entries()

    def newest(self, directory: str, *, template: str | None = None) -> str | None:
        """The path of the checkpoint with the highest step in ``directory`` (None when there
        is none; ``template`` as :meth:`open`'s): snapkeep's snapshots (step from the manifest)
        and Lightning checkpoints written without snapkeep (:meth:`foreign`: a run from before
        snapkeep was added), a snapkeep snapshot first at an equal step.
        :meth:`load_checkpoint` verifies it (a foreign one loads unverified, said on stderr)
        and falls back from it."""
        self.wait()
        found = self._directory(os.fspath(directory), lock=False, template=template)
        ranked = [((e.key, 1), e.path)  # another door's snapshot: skipped, named
                  for e in found.session.own(found.store.entries())]
        ranked += [(((float(e.step),), 0), e.path) for e in self.foreign(os.fspath(directory))
                   if e.step is not None]
        return max(ranked)[1] if ranked else None

    def last(self, directory: str, *, template: str | None = None) -> str | None:
        """What ``ckpt_path="last"`` resumes (:class:`ModelCheckpoint` asks): with
        ``memory=``, the RAM snapshot of the tier when its step is at least :meth:`newest`'s
        (its copy verified while it is read; the path of that file in the tier, which
        :meth:`load_checkpoint` then returns as read, no storage snapshot read); else
        :meth:`newest`. RAM is tried once per :meth:`open` (collective: the tier's recovery);
        what happened is said on stderr (``snapkeep: resuming from RAM step N (...)`` or why
        storage is used).

        Raises:
            SnapshotStorageError: the storage could not be reached.
            MemoryTierTooSmallError, NotPrivateError: the tier cannot be opened.
        """
        newest = self.newest(directory, template=template)
        found = self._directory(os.fspath(directory), lock=False, template=template)
        session = found.session
        if not isinstance(session, TieredSession) or session.recovered:
            return newest
        steps = [e.step for e in found.session.own(found.store.entries())
                 if e.step is not None]
        steps += [e.step for e in self.foreign(os.fspath(directory)) if e.step is not None]
        size = 0
        if newest is not None:  # what the tier must hold (no byte read)
            try:
                size = int(found.store.storage.size(newest))
            except OSError:
                size = 0
        got: dict[str, Any] = {}

        def keep(tree: Any, step: int, path: str) -> None:
            got[path] = _check_checkpoint(Entry(name=os.path.basename(path), path=path,
                                                key=(float(step),), step=step), tree)

        if session.recover(max(steps, default=None), keep, size_bytes=size) is None:
            return newest
        ((path, tree),) = got.items()
        with self._guard:
            self._from_ram[path] = tree
        return path

    def foreign(self, directory: str) -> list[Entry]:
        """The Lightning checkpoints in ``directory`` that snapkeep did not write (no snapkeep
        manifest, not an alias record, not a temp file): a run trained before snapkeep was
        added, or another ``CheckpointIO``'s files. Their step is the one in their name
        (``epoch=1-step=20.ckpt``), else, for a local file, the ``global_step`` it holds (read
        through a memory map; at most a few files); else None. Oldest first (unknown steps
        first). Not verified: they have no checksum.

        Raises:
            SnapshotStorageError: the storage could not be reached.
        """
        found = self._directory(os.fspath(directory), lock=False)
        store = found.store
        storage = store.storage
        ours = {e.name for e in store.entries()}
        try:
            names = storage.list_names(store.directory)
        except FileNotFoundError:
            return []
        result: list[Entry] = []
        peeked = 0
        for name in sorted(names):
            if name in ours or name.startswith(".") or _TEMP_MARKER in name:
                continue
            named = _NAMED_STEP.search(name)
            if named is None and not _LAST_NAME.match(name) and not name.endswith(".ckpt"):
                continue
            path = storage.join(store.directory, name)
            if not self.is_foreign(path):
                continue
            step = int(named.group(1)) if named is not None else None
            if step is None and storage.is_local and peeked < _PEEK_MAX_FILES:
                peeked += 1
                step = _stored_step(storage, path)
            result.append(Entry(name=name, path=path, step=step,
                                key=(float(step),) if step is not None else ()))
        return sorted(result, key=lambda e: (e.step is not None, e.key, e.name))

    def is_foreign(self, path: Any) -> bool:
        """Whether ``path`` is a regular file snapkeep did not write: no snapkeep manifest
        names it and it is no alias record (a stock Lightning checkpoint). snapkeep never
        overwrites or deletes such a file (a ``last.ckpt`` is versioned, ``last-v1.ckpt``, as
        Lightning versions names that exist)."""
        directory, name = _split(os.fspath(path))
        store = self._directory(directory, lock=False).store
        storage = store.storage
        full = storage.join(store.directory, name)
        with self._guard:
            if full in self._written:  # this process's (its manifest may be in flight)
                return False
        if not storage.is_plain_file(full):
            return False
        try:
            if read_manifest(storage, manifest_path(storage, full)) is not None:
                return False
        except (ManifestError, OSError):
            pass
        return _read_alias(storage, full) is None

    def announce_fresh(self, directory: str) -> None:
        """Say on stderr (rank 0) that ``directory`` holds nothing to resume from (the
        session's notice: ``snapkeep: no snapshot of ... starting fresh``)."""
        session = self._directory(os.fspath(directory), lock=False).session
        session.resume(_nothing_to_apply, candidates=[])

    def keep_in_ram(self, directory: str, step: int, build: Callable[[], Any], *,
                    force: bool = False) -> bool:
        """Keep ``build()`` (the checkpoint dict of ``step``) in the memory tier of
        ``directory`` when ``memory=`` was given and ``step`` is due (a multiple of
        ``memory.every``; any step with ``force``: a preemption whose deadline leaves no time
        for a durable write); :class:`ModelCheckpoint` calls it at each training batch end
        without a save. Returns whether it was kept. Returns once the copy is staged.

        Raises:
            SnapshotSaveError: the previous RAM snapshot failed in the background (once).
            MemoryTierTooSmallError, NotPrivateError: the tier cannot be opened.
        """
        if self._memory is None or (step % self._memory.every and not force):
            return False
        session = self._directory(os.fspath(directory), lock=True).session
        if not isinstance(session, TieredSession):
            return False
        session.keep(step, build)
        return True

    def record_metrics(self, path: Any, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (finite one-number values) in the manifest of the next save to
        ``path`` (:class:`ModelCheckpoint` passes Lightning's ``callback_metrics``); retention
        (``keep=KeepBest(...)``) ranks by them and ``snapkeep ls`` shows them."""
        with self._guard:
            self._metrics[os.fspath(path)] = _finite_metrics(metrics)

    def run_control(self, directory: str, *, rank: int, world_size: int,
                    grace_s: float | None = None) -> RunControl:
        """The run of ``directory``, from its session as every door's
        (:meth:`snapkeep.session.Session.run_control`): its status (``.snapkeep/status.json``,
        written on rank 0, what ``snapkeep status DIR`` reads), the preemption hook (armed
        later, :meth:`snapkeep.session.RunControl.arm`), the deadline (``grace_s``; the saves of
        this directory are timed for its estimate) and the exit codes."""
        session = self._directory(os.fspath(directory), lock=False).session
        return session.run_control(rank=rank, world_size=world_size, grace_s=grace_s)

    # -- CheckpointIO ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` (a CPU copy into reused buffers) and commit it to ``path`` in
        the background with its checksum manifest; returns once staged. After the commit,
        retention (``keep``) runs.

        Args:
            checkpoint: Lightning's checkpoint dict (tensors on any device, plain values).
            path: the file to write (local path or fsspec URL).
            storage_options: not supported per call (give them to the constructor).

        Raises:
            TypeError: ``storage_options`` given (as ``TorchCheckpointIO``).
            SnapshotSaveError: an earlier background save failed (raised once, cause chained).
            StoreLockedError: another process holds the directory.
            ValueError: a ``KeepBest`` metric of ``keep`` is recorded by no snapshot of this
                run, this one included; nothing is written or deleted.
        """
        if storage_options is not None:
            raise TypeError("SnapkeepCheckpointIO.save_checkpoint takes no storage_options; "
                            "pass them as SnapkeepCheckpointIO(storage_options=...)")
        directory, name = _split(os.fspath(path))
        found = self._directory(directory, lock=True)
        step = checkpoint.get("global_step")
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        with self._guard:
            metrics = self._metrics.pop(os.fspath(path), {})
        if self._incremental and found.incremental is None:
            found.incremental = IncrementalTracker.for_store(found.store)
        handle = found.session.save(self._writer, name, directory, checkpoint, step=step,
                                    metrics=metrics, incremental=found.incremental)
        if handle is not None:
            with self._guard:
                self._last_handle = handle
            if name.startswith(_HPC_PREFIX):
                handle.wait()  # Lightning requeues the SLURM job right after this save
        with self._guard:  # a full save replaces an alias of the same name
            full = found.store.storage.join(found.store.directory, name)
            self._aliases.pop(full, None)
            self._written.add(full)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (an alias record is resolved to the snapshot it
        names) through the engine session's resume: checked against its manifest while it
        loads, safely unpickled, and said on stderr (rank 0: ``snapkeep: resuming from NAME
        (step N) in DIR``). A snapshot that fails (corrupt, truncated, missing, not a
        checkpoint) is skipped, named on stderr with why, and the next older one (by step)
        that verifies is loaded instead. A file no snapkeep manifest describes (written by
        another ``CheckpointIO``) loads unverified, with a warning.

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
        with self._guard:
            from_ram = self._from_ram.pop(os.fspath(path), None)
            if from_ram is not None:  # chosen and verified by last(); said on stderr there
                self._loaded = (os.fspath(path), os.fspath(path))
                return dict(from_ram)
        weights_only = self._weights_only if weights_only is None else bool(weights_only)
        location = "cpu" if map_location is None else map_location
        directory, name = _split(os.fspath(path))
        found = self._directory(directory, lock=False)
        store = found.store
        storage = store.storage
        requested = storage.join(store.directory, name)
        target, refused = self._alias_target(store, requested)
        entries = store.entries()
        chosen = next((e for e in entries if e.path == target), None)
        if refused:  # say why, then resume as ckpt_path="last" does: the newest that verifies
            say(f"{name}: alias refused: {refused}; resuming from the newest snapshot instead",
                quiet=self._quiet)
            if not entries:
                raise SnapshotCorruptError(f"{requested}: alias refused: {refused}; and no "
                                           "snapshot to resume instead. Pass ckpt_path= a "
                                           "checkpoint file, or None to start fresh")
            candidates = entries
        elif chosen is None:
            if storage.exists(target):  # not snapkeep's file (no manifest): loaded unverified
                older = [e for e in self.foreign(directory) if e.step is not None]
                this = next((e for e in older if e.path == target), None)
                step = this.step if this is not None else _stored_step(storage, target) \
                    if storage.is_local else None
                candidates = [e for e in entries + older if step is not None
                              and e.step is not None and e.step <= step and e.path != target]
                candidates.sort(key=lambda e: (e.key, e.path in {o.path for o in entries}))
                candidates.append(Entry(name=storage.basename(target), path=target,
                                        key=(float(step),) if step is not None else (),
                                        step=step))
                say(f"{storage.basename(target)} has no snapkeep manifest (written before "
                    "snapkeep was added, or by another CheckpointIO): it loads unverified",
                    quiet=self._quiet)
            elif target == requested or not entries:
                raise FileNotFoundError(f"checkpoint not found: {target}")
            else:  # an alias naming a deleted snapshot: the newest at or below its step
                candidates = entries
        else:
            candidates = [e for e in entries if e.key <= chosen.key and e.path != chosen.path]
            candidates.append(chosen)
        loaded: dict[str, Any] = {}
        session = found.session
        if isinstance(session, TieredSession):  # RAM: last() chooses it for ckpt_path="last"
            session = session.inner
        entry = session.resume(lambda e, state: loaded.update(state=state),
                               check=_check_checkpoint, candidates=candidates,
                               weights_only=weights_only, map_location=location)
        if entry is None:  # unreachable: candidates is not empty
            raise FileNotFoundError(f"checkpoint not found: {target}")
        logger.info("loaded %s (step %s)", entry.path, entry.step)
        with self._guard:
            self._loaded = (storage.url(requested), storage.url(entry.path))
        return dict(loaded["state"])

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

    def wait_ram(self, directory: str) -> None:
        """Block until the RAM snapshot in flight of ``directory`` (``memory=``) is committed,
        not waiting for durable saves (a preemption whose deadline leaves them no time).

        Raises:
            SnapshotSaveError, SnapshotTimeoutError: as :meth:`wait`.
        """
        session = self._directory(os.fspath(directory), lock=True).session
        if isinstance(session, TieredSession):
            session.wait()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every save so far is committed and the removals and aliases waiting
        for them are done, and (``memory=``) the RAM snapshot in flight; raise a background
        save's error, once.

        Raises:
            SnapshotTimeoutError: still pending after ``timeout_s`` seconds (the RAM snapshot:
                after ``2 x MemoryTier timeout_s``).
            SnapshotSaveError: a background save failed.
        """
        self._writer.wait(timeout_s)
        with self._guard:
            tiers = [d.session for d in self._directories.values()
                     if isinstance(d.session, TieredSession)]
        for tier in tiers:
            tier.wait()
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
            with self._guard:  # the next fit opens them again (a new session each)
                directories, self._directories = list(self._directories.values()), {}
                for found in directories:
                    found.session.close()
                    if _OPEN.get(found.key) is self:
                        del _OPEN[found.key]

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
    def loaded(self) -> tuple[str, str] | None:
        """``(requested, loaded)``: the path the last :meth:`load_checkpoint` was given and the
        snapshot it really loaded (another one after a fallback, or the one an alias names),
        as URLs; None before any load."""
        with self._guard:
            return self._loaded

    @property
    def memory(self) -> MemoryTier | None:
        """The memory tier's configuration (``memory=``; None: no tier)."""
        return self._memory

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
            self._written.discard(full)
            try:  # an incremental checkpoint's blobs: freed once no checkpoint refers to them
                manifest = read_manifest(store.storage, manifest_path(store.storage, full))
            except (ManifestError, OSError):
                manifest = None
            if store.delete(Entry(name=name, path=full, key=(), step=None), by="lightning") \
                    and manifest is not None and manifest.blobs:
                store.collect_blobs(set(manifest.blobs))

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
            if self.is_foreign(alias_path):  # a stock full last.ckpt: never overwritten
                logger.warning("not pointing %s at %s: it is a checkpoint snapkeep did not "
                               "write (kept)", alias_path, target_path)
                return
            manifest = read_manifest(storage, manifest_path(storage, target_path))
            record = {"format": ALIAS_FORMAT, "target": storage.basename(target_path),
                      "step": manifest.step if manifest is not None else None}
            storage.write_bytes(alias_path, json.dumps(record).encode())
            self._written.add(alias_path)
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
    def _alias_target(store: SnapshotStore, path: str) -> tuple[str, str]:
        """``(path, '')`` for a checkpoint file; for an alias record, the snapshot it names
        and ``''`` when the reference holds, else ``(path, why it is refused)``: the target
        must be a regular file of the same directory (no symbolic link: it could lead out of
        it) described by a snapkeep manifest recording the step the alias records."""
        storage = store.storage
        alias = _read_alias(storage, path)
        if alias is None:
            return path, ""
        if alias.problem:
            return path, alias.problem
        target = storage.join(storage.dirname(path), alias.target)
        if not storage.is_plain_file(target):
            why = "missing" if not storage.exists(target) else \
                "a symbolic link or not a regular file"
            if why == "missing":
                return target, ""  # deleted since: the newest at or below (load_checkpoint)
            return path, f"its target {alias.target} is {why}"
        try:
            manifest = read_manifest(storage, manifest_path(storage, target))
        except (ManifestError, OSError) as e:
            return path, f"its target {alias.target} has an unreadable manifest ({e})"
        if manifest is None or manifest.step != alias.step:
            recorded = "no snapkeep manifest" if manifest is None \
                else f"a manifest of step {manifest.step}"
            return path, (f"it records step {alias.step}, its target {alias.target} has "
                          f"{recorded}")
        return target, ""

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_writer", None) is not None \
                and self._writer.pending:
            logger.warning("SnapkeepCheckpointIO garbage-collected with saves pending")


def _check_checkpoint(entry: Entry, state: Any) -> Any:
    """``state`` when it is a checkpoint dict, else ``SnapshotCorruptError`` (skipped)."""
    if not isinstance(state, Mapping):
        raise SnapshotCorruptError(f"{entry.path} is not a Lightning checkpoint (a "
                                   f"{type(state).__name__}, not a dict)")
    return state


def _nothing_to_apply(entry: Entry, state: Any) -> None:
    raise AssertionError(f"nothing to apply on a first run, got {entry!r}")


def _train_loaders(trainer: Any) -> list[Any]:
    """The fit's train loaders (Lightning's combined loader, flattened), [] before it has
    them."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


def _rebuild_iterator(trainer: Any) -> None:
    """Build the fit's train iterator again (Lightning's ``_data_fetcher``), from the loaders'
    and the global generators' states now."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is not None:
        iter(fetcher)


def _epoch_length(trainer: Any) -> int | None:
    length = trainer.num_training_batches
    return int(length) if isinstance(length, int) or (
        isinstance(length, float) and math.isfinite(length)) else None


def _snapkeep_io(trainer: Any) -> SnapkeepCheckpointIO | None:
    io = getattr(trainer.strategy, "checkpoint_io", None)
    return io if isinstance(io, SnapkeepCheckpointIO) else None


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` made safe with :class:`SnapkeepCheckpointIO` (see the
    module docstring): ``save_last`` (``True`` or ``"link"``) writes an alias record after the
    commit instead of a second full copy, ``ckpt_path="last"`` resolves to the snapshot with the
    highest step, removals wait for the commit (in the IO), the directory is opened (locked) at
    ``setup``, the random streams and the train loaders' generators are kept in the callback
    state (exact continuation from any snapshot; see the module docstring), each snapshot's
    manifest records Lightning's ``callback_metrics`` (for ``keep=KeepBest(...)``), the run
    status is kept in
    ``.snapkeep/status.json``, and a preemption signal ends the run with a committed snapshot.

    Args:
        *args: Lightning's ``ModelCheckpoint`` arguments.
        preemption: catch SIGTERM and SIGUSR1 (``True``, default) or the given signals (a
            sequence of ``signal.Signals``) while fitting, as the Checkpointer's
            ``preemption``: the handler only records the signal (it replaces Lightning's own
            SIGTERM handling and its SLURM requeue); at the end of the next training batch the
            ranks agree (one all-reduce of one int on snapkeep's own gloo group), a snapshot of
            that step is saved and committed, the run status becomes ``preempted`` and every
            rank exits with ``SystemExit(143)``
            (:data:`~snapkeep.distributed.EXIT_CODE_PREEMPTED`). With a deadline
            (``grace_s``) that this run's measured durable write does not fit, no snapshot of
            that step is started: the run status records ``committed_to: none`` and every
            rank exits with ``SystemExit(79)``
            (:data:`~snapkeep.distributed.EXIT_CODE_PREEMPTED_NOT_DURABLE`); the newest
            committed snapshot is the resume point. ``False``: Lightning's handling (a
            snapshot of the step at its ``SIGTERMException``, exit status 0).
        timeout_s: bound of that agreement between ranks, seconds (default 600).
        grace_s: seconds between the first preemption signal and SIGKILL (the launcher's
            grace period); None: from ``$SNAPKEEP_GRACE_S``, else SLURM's
            ``$SLURM_JOB_END_TIME``, else no deadline (the step is always saved). See
            docs/cluster.md.
        **kwargs: Lightning's ``ModelCheckpoint`` keyword arguments.

    With another ``CheckpointIO`` it behaves as Lightning's, plus the random generators.

    Raises:
        TypeError: ``preemption`` is not a bool or a sequence of signals.
        ValueError: a signal cannot be caught (SIGKILL, SIGSTOP) or is unknown; ``grace_s``
            is not a number of seconds > 0.
    """

    def __init__(self, *args: Any, preemption: bool | Sequence[signal.Signals | int] = True,
                 timeout_s: float = _TIMEOUT_S, grace_s: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._signals = preemption_signals(preemption)  # checked before training
        self._grace_s = check_grace_s(grace_s)
        check_timeout_s(timeout_s)
        self._timeout_s = float(timeout_s)
        self._run: RunControl | None = None  # the run status and the preemption hook
        self._stream = RngStream()  # the global generators as the training steps see them
        self._position: dict[str, Any] = {}  # the train loaders' at the last step's end
        self._resumed_position: dict[str, Any] | None = None  # loaded, applied at train start
        self._next_epoch: tuple[list[Any], list[Any]] | None = None  # resumed at an epoch end

    # -- start-up and resume ----------------------------------------------------------------------
    def step_template(self) -> str | None:
        """The checkpoints' names with their step as ``{step}`` (``'ckpt_{step}'``,
        ``'step={step}.ckpt'``), when ``filename`` formats nothing but the step; else None
        (``'{epoch}-{step}'``, metrics: the snapshots are listed from their manifests)."""
        filename = self.filename or "{epoch}-{step}"
        if sorted(set(re.findall(r"\{([^{}:!]+)", filename))) != ["step"]:
            return None
        sentinel = 987_654_321_987
        name = os.path.basename(self.format_checkpoint_name({"step": torch.tensor(sentinel)}))
        if name.count(str(sentinel)) != 1 or "{" in name or "}" in name:
            return None
        return name.replace(str(sentinel), "{step}")

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        io = _snapkeep_io(trainer)
        if io is None or stage != "fit" or not self.dirpath:
            return
        directory = os.fspath(self.dirpath)
        if trainer.is_global_zero:
            io.open(directory, template=self.step_template())
        self._run = io.run_control(directory, rank=trainer.global_rank,
                                   world_size=trainer.world_size, grace_s=self._grace_s)
        self._run.at(trainer.global_step)  # running

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        io = _snapkeep_io(trainer)
        if io is None or not self.dirpath:
            return super()._find_last_checkpoints(trainer)
        newest = io.last(os.fspath(self.dirpath), template=self.step_template())
        if newest is None:  # Lightning's own rule for files whose step cannot be known
            stock = {p for p in super()._find_last_checkpoints(trainer) if io.is_foreign(p)}
            if stock:
                return stock
            io.announce_fresh(os.fspath(self.dirpath))
            # snapkeep's line said it; Lightning's hint to set save_last=True is beside the point
            warnings.filterwarnings("ignore", message=_NO_LAST_HINT)
            return set()
        return {newest}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:
        """As Lightning's; then, when snapkeep loaded another file than the one Lightning asked
        for (a fallback past a corrupt snapshot, the snapshot an alias names), the trainer's
        ``ckpt_path`` is set to the file really loaded, so Lightning's ``Restored all states
        from the checkpoint at ...`` line names it."""
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        io = _snapkeep_io(trainer)
        loaded = io.loaded if io is not None else None
        connector = getattr(trainer, "_checkpoint_connector", None)
        if loaded is None or connector is None or not hasattr(connector, "_ckpt_path"):
            return
        asked = connector._ckpt_path
        requested, really = (url.rpartition("/")[2] for url in loaded)
        if asked is None or requested == really:
            return
        head, _, tail = os.fspath(asked).rpartition("/")
        if tail == requested:  # the same directory, Lightning's spelling
            connector._ckpt_path = f"{head}/{really}" if head else really

    def state_dict(self) -> dict[str, Any]:
        """Lightning's, plus the continuation state recorded at the end of the last training
        step (also when the save runs later, at an epoch's or a validation's end):
        ``snapkeep_rng``, the global generators' states (:class:`~snapkeep._core.state.rng_state.
        RngStream`), and ``snapkeep_position``: how many batches of the epoch the loop had
        received, the epoch's length in batches, and the states of each train loader's
        ``torch.Generator`` objects."""
        state = super().state_dict()
        state["snapkeep_rng"] = self._stream.state_dict()
        if self._position:
            state["snapkeep_position"] = dict(self._position)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("snapkeep_rng")
        position = state_dict.get("snapkeep_position")
        super().load_state_dict({k: v for k, v in state_dict.items()
                                 if k not in ("snapkeep_rng", "snapkeep_position")})
        if rng is not None:
            self._stream.load_state_dict(rng)  # the next step starts from it
        self._resumed_position = dict(position) if isinstance(position, Mapping) else None

    # -- exact continuation ----------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Install the preemption handlers (after Lightning's own, which they replace while
        fitting); on a resume, put the train loaders where the uninterrupted run had them."""
        super().on_train_start(trainer, pl_module)
        self._resume_loaders(trainer)
        self._arm(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._stream.epoch_start()  # the epoch's iterator is built next (its draws)
        pending, self._next_epoch = self._next_epoch, None
        if pending is not None:  # resumed at an epoch's end
            self._set_generators(*pending)
            loop = trainer.fit_loop
            if not (trainer.current_epoch > 0 and not loop.is_resuming
                    and not loop.epoch_loop.restarting):  # Lightning builds none: build it
                _rebuild_iterator(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._next_epoch = None
        self._stream.step_start()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def _record_position(self, trainer: Any, batch_idx: int) -> None:
        loaders = _train_loaders(trainer)
        self._position = {
            "batches": int(batch_idx) + 1, "length": _epoch_length(trainer),
            "generators": [generator_states(dl) if isinstance(dl, torch.utils.data.DataLoader)
                           else [] for dl in loaders],
            "kinds": ["stateful" if is_stateful_loader(dl) else type(dl).__name__
                      for dl in loaders]}

    @staticmethod
    def _set_generators(loaders: list[Any], saved: list[Any]) -> None:
        for index, (loader, states) in enumerate(zip(loaders, saved, strict=True)):
            if isinstance(loader, torch.utils.data.DataLoader):
                set_generator_states(loader, list(states), f"train {index}")

    def _resume_loaders(self, trainer: Any) -> None:
        """At ``on_train_start`` of a resumed fit (Lightning has built the train iterator in
        ``setup_data``, after the snapshot was loaded): set each train loader's generators to
        their states at the snapshot; at an epoch's end, build the next epoch's iterator again
        from them (Lightning's was built from other states, or is the finished epoch's).
        A plain ``DataLoader`` resumed mid-epoch cannot be exact: said once."""
        position, self._resumed_position = self._resumed_position, None
        if not position:
            return
        loaders = _train_loaders(trainer)
        saved = list(position.get("generators", []))
        batches, length = int(position.get("batches", 0)), position.get("length")
        at_epoch_end = isinstance(length, int) and batches >= length
        if len(saved) != len(loaders):
            warn_user(f"snapkeep: the snapshot recorded {len(saved)} train loaders, this fit has "
                      f"{len(loaders)}; their order and random streams are not restored, so "
                      "the resumed run is not bit-identical to the uninterrupted one",
                      RuntimeWarning)
            return
        self._set_generators(loaders, saved)
        if at_epoch_end:
            # the next epoch's iterator must be built from these states, as the uninterrupted
            # run built it (Lightning's was built from other states, or continues the
            # finished epoch): now, when Lightning may go on to the next batch without an
            # epoch start; and again at on_train_epoch_start if it calls that first (it may
            # build the iterator itself there)
            loop = trainer.fit_loop
            if loop.restarted_mid_epoch or loop.restarted_on_epoch_end:
                self._stream.epoch_start()
                _rebuild_iterator(trainer)
            self._next_epoch = (loaders, saved)
            return
        plain = [type(dl).__name__ for dl in loaders if not is_stateful_loader(dl)]
        if plain:
            warn_user(
                f"snapkeep: resuming {batches} batches into an epoch of {length} with a "
                f"{plain[0]} that cannot resume mid-epoch: Lightning starts its epoch over, so "
                "the batches (and what follows) differ from the uninterrupted run's. For an "
                "exact resume from any step use torchdata's StatefulDataLoader (pip install "
                "torchdata), whose position Lightning saves; or resume from snapshots taken at "
                "epoch ends", RuntimeWarning)

    # -- saving ----------------------------------------------------------------------------------
    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        io = _snapkeep_io(trainer)
        if io is not None and trainer.is_global_zero:
            io.record_metrics(filepath, trainer.callback_metrics)
        super()._save_checkpoint(trainer, filepath)

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        io = _snapkeep_io(trainer)
        if io is None or not self.save_last:
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        filepath = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        version = self.STARTING_VERSION
        while io.is_foreign(filepath):  # a stock full last.ckpt is kept: last-v1.ckpt
            filepath = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST,
                                                   ver=version)
            version += 1
        previous, self.last_model_path = self.last_model_path, filepath
        saved = self._last_checkpoint_saved
        if saved and saved != filepath and self.save_top_k != 0 \
                and self._last_global_step_saved == trainer.global_step:
            if trainer.is_global_zero:
                io.link(saved, filepath)  # after the snapshot of this step is committed
            trainer.strategy.barrier()
        else:
            self._save_checkpoint(trainer, filepath)  # no snapshot of this step: one full write
        if previous and previous != filepath and not io.is_foreign(previous) \
                and self._should_remove_checkpoint(trainer, previous, filepath):
            self._remove_checkpoint(trainer, previous)

    def _keep_in_ram(self, trainer: Any) -> None:
        """A step the memory tier keeps (``SnapkeepCheckpointIO(memory=...)``) and that was
        not saved (a save keeps it already): its checkpoint dict, as a save would hold it, to
        RAM."""
        io = _snapkeep_io(trainer)
        step = trainer.global_step
        if io is None or not self.dirpath or not trainer.is_global_zero \
                or self._last_global_step_saved == step:
            return
        connector = trainer._checkpoint_connector
        io.keep_in_ram(os.fspath(self.dirpath), step,
                       lambda: connector.dump_checkpoint(weights_only=False))

    # -- preemption and the run status -----------------------------------------------------------
    def _arm(self, trainer: Any) -> None:
        run = self._run
        if not self._signals or _snapkeep_io(trainer) is None or run is None \
                or run.watch is not None:
            return
        groups = background_groups(self._timeout_s) if is_distributed() else None
        run.arm(self._signals, control=groups.control if groups else None,
                timeout_s=self._timeout_s)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stream.step_end()  # before this step's snapshot: what the next step starts from
        self._record_position(trainer, batch_idx)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._keep_in_ram(trainer)
        run = self._run
        if run is None or run.watch is None:
            return
        agreed = run.agree()  # every rank, every batch: one int
        if agreed:
            self._preempt(trainer, agreed)

    def _preempt(self, trainer: Any, agreed: int) -> None:
        """Every rank agreed on a preemption at this step: where the deadline lets it
        (:meth:`snapkeep.session.RunControl.plan`), snapshot it (unless this step's snapshot was
        just saved) and wait until it is committed; record ``preempted`` and exit with 143 (79:
        the durable write did not fit the deadline and was not started), as every door."""
        run = self._run
        io = _snapkeep_io(trainer)
        if run is None or io is None:
            raise RuntimeError("no preemption watch")
        step = trainer.global_step
        # the memory tier (memory=, one process) can take the step when storage cannot in time
        ram = io.memory is not None and bool(self.dirpath)
        plan = run.plan(tier=ram)  # the deadline, agreed by every rank
        run.requested(step, plan)
        name = ""
        memory = io.memory
        if plan.where == "ram" and memory is not None and self.dirpath \
                and trainer.is_global_zero:  # never a durable write
            connector = trainer._checkpoint_connector
            directory = os.fspath(self.dirpath)
            if step % memory.every:  # a due step is in RAM already (kept, or by its save)
                io.keep_in_ram(directory, step,
                               lambda: connector.dump_checkpoint(weights_only=False),
                               force=True)
            io.wait_ram(directory)
        if plan.where == "storage":
            candidates = self._monitor_candidates(trainer)
            if self._last_global_step_saved != step:
                self._save_checkpoint(trainer, self.format_checkpoint_name(candidates))
                if self.save_last:
                    self._save_last_checkpoint(trainer, candidates)
            name = os.path.basename(self._last_checkpoint_saved or "")
            if trainer.is_global_zero:
                io.wait()
        trainer.strategy.barrier("snapkeep-preemption")  # committed before any rank leaves
        run.at(step)
        run.preempted(step, name, agreed, plan)
        run.disarm()
        run.exit_preempted(step, plan)

    def _uninstall(self) -> None:
        if self._run is not None:
            self._run.disarm()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)
        self._uninstall()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._uninstall()
        run = self._run
        if stage == "fit" and run is not None and not run.preempting:
            run.at(trainer.global_step)
            io = _snapkeep_io(trainer)
            if io is not None and trainer.is_global_zero:
                try:
                    io.wait()
                except Exception as e:  # recorded, then raised by the IO's own teardown
                    run.failed(e)
            run.finished()
        self._run = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """As Lightning's; the run status becomes ``failed`` (not on a preemption). Without
        snapkeep's preemption (``preemption=False``), on SIGTERM (Lightning's
        ``SIGTERMException``, raised at the next batch after the signal) a snapshot of the
        current step is saved even without ``save_on_exception=True``; ``teardown`` (run by
        Lightning before the exception leaves ``fit``) commits it: a ``SystemExit`` without a
        code (exit status 0); the run status becomes ``preempted`` once it is committed.
        (Lightning calls callbacks' ``teardown`` only when ``fit`` ends without an exception.)"""
        run = self._run
        if run is not None and run.preempting:
            return
        self._uninstall()
        if run is not None and not isinstance(exception, SIGTERMException):
            run.at(trainer.global_step)
            run.failed(exception)
        if isinstance(exception, SIGTERMException) and _snapkeep_io(trainer) is not None \
                and not self.save_on_exception \
                and self._last_global_step_saved != trainer.global_step:
            self.save_on_exception = True
            try:
                super().on_exception(trainer, pl_module, exception)
            finally:
                self.save_on_exception = False
        else:
            super().on_exception(trainer, pl_module, exception)
        io = _snapkeep_io(trainer)
        if isinstance(exception, SIGTERMException) and io is not None \
                and run is not None:  # 'preempted' once its snapshot is committed
            if trainer.is_global_zero:
                io.wait()
            saved = os.path.basename(self._last_checkpoint_saved or "")
            run.at(trainer.global_step)
            run.preempted(trainer.global_step, saved, 0,
                          reason="signal SIGTERM (Lightning's SIGTERMException)")
