"""The Ray Train door: snapkeep snapshots inside a Ray ``TorchTrainer``.

Inside ``train_loop_per_worker`` (every Ray Train worker is a torch.distributed rank, on gloo or
NCCL), a :class:`~snapkeep.Checkpointer` writes sharded snapshots and this module ties them to
Ray's checkpoints::

    def train_func(config):
        ...  # model = ray.train.torch.prepare_model(...), optimizer, StatefulDataLoader
        state = {"model": model, "optim": optimizer, "data": loader}
        with snapkeep.Checkpointer(config["snapshots"], keep=3) as ckpt:
            step = snapkeep.ray.resume(ckpt, state) or 0
            while step < total:
                ...
                step += 1
                if step % 50 == 0 or step == total:
                    snapkeep.ray.report(ckpt, step, state, {"loss": loss.item()})

**Who owns what.** snapkeep's directory holds the bytes: each snapshot is a sharded directory
(every rank writes its own shards, its data position and RNG streams; rank 0 commits it by
writing a marker with every file's checksum last), with snapkeep's lock, atomic commit,
verification and retention (``keep=``). A Ray checkpoint is only a reference to one committed,
verified snapshot: a directory holding one small JSON file (:data:`REFERENCE_NAME`: the
snapkeep directory, the snapshot's name and step, the world size), which Ray copies into its
``storage_path`` and retains (``CheckpointConfig(num_to_keep=...)``). The bytes exist once;
Ray's retention deletes references, never snapshot files, so it cannot delete the newest
verified snapshot (nor any other); snapkeep's retention never deletes its newest valid one.

**Report.** :func:`report` saves ``state`` at ``step`` on every rank, waits until the snapshot
is committed (durable, marker written), verifies it (every rank reads its share of the files
back against the marker's checksums; all ranks hear every outcome, and all must name the same
step), and only then calls ``ray.train.report`` -- a barrier across the workers -- with the
reference on rank 0 and ``checkpoint=None`` elsewhere (Ray registers a checkpoint when any
worker gives one). A failure anywhere raises on every rank before Ray hears of the step.

**Resume.** After a worker dies, Ray (``FailureConfig(max_failures=...)``) starts the whole
group again and ``ray.train.get_checkpoint()`` gives the newest reference Ray registered.
:func:`resume` checks that it names this Checkpointer's directory, then loads snapkeep's newest
snapshot that every rank verifies: the one Ray names, or a newer one committed after it (a
kill can come after a snapshot is committed and before Ray registered its report: Ray's
controller collects reports every few seconds). It never resumes behind the step Ray names
(that raises). Without a Ray checkpoint it resumes snapkeep's newest snapshot of the
directory, if any: use one directory per Ray run.

**Preemption.** Ray runs ``train_loop_per_worker`` in a thread of the worker process, where no
signal handler can be installed: leave the Checkpointer's ``preemption`` off; Ray restarts the
group after a worker dies, within ``FailureConfig`` (see ``docs/cluster.md``).

Requires ``ray[train]`` (``pip install snapkeep[ray]``); ``import snapkeep`` does not import it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping, MutableMapping
from typing import Any

import ray.train

from snapkeep._version import __version__
from snapkeep.checkpointer import Checkpointer
from snapkeep.errors import NoValidSnapshotError
from snapkeep.store import RecordError, parse_json, resolve_storage

__all__ = ["FORMAT", "REFERENCE_NAME", "SnapshotReference", "reference_of", "report", "resume",
           "resume_from"]

#: The file of a Ray checkpoint that refers to a snapkeep snapshot.
REFERENCE_NAME = "snapkeep_snapshot.json"
#: Its ``format`` entry.
FORMAT = "snapkeep.ray/1"
#: Largest reference file read, in bytes (it is a few hundred).
MAX_REFERENCE_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotReference:
    """What a Ray checkpoint written by :func:`report` says.

    Attributes:
        directory: the Checkpointer's directory: an absolute local path, or the URL as given.
        name: the snapshot's name in it (a sharded snapshot directory, ``ckpt_<step>``).
        step: the training step it holds.
        world_size: the number of Ray Train workers (ranks) that wrote it.
        version: the snapkeep version that wrote the reference.
    """

    directory: str
    name: str
    step: int
    world_size: int
    version: str

    @property
    def path(self) -> str:
        """The snapshot's full path (``directory/name``)."""
        return f"{self.directory.rstrip('/')}/{self.name}"

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, sort_keys=True)


def report(checkpointer: Checkpointer, step: int, state: Mapping[str, Any],
           metrics: Mapping[str, Any] | None = None) -> SnapshotReference:
    """Snapshot ``state`` at ``step`` through ``checkpointer`` and report it to Ray once it is
    committed and verified. Every Ray Train worker calls it, with the same ``step``.

    In order: ``checkpointer.save(step, state, force=True)`` (each rank stages its shards),
    ``checkpointer.wait()`` (committed: every rank's files durable, then rank 0's marker),
    ``checkpointer.verify(step)`` (each rank reads its share of the files back against the
    marker's checksums; every rank raises if any rank's share fails or the ranks name different
    steps), then ``ray.train.report(metrics, checkpoint=...)``: on rank 0 a Ray checkpoint
    holding only the reference (:data:`REFERENCE_NAME`, a few hundred bytes, copied by Ray into
    its ``storage_path``), ``None`` on the other ranks. ``ray.train.report`` is a barrier across
    the workers; it returns on every worker once each reached it.

    Args:
        checkpointer: the worker's open :class:`~snapkeep.Checkpointer`, sharded (the default
            inside a Ray Train worker, where torch.distributed is initialized).
        step: the training step (int >= 0); names the snapshot (``ckpt_<step>``).
        state: str keys to what is saved, as for :meth:`Checkpointer.save` (modules,
            optimizers, schedulers, torchdata ``StatefulDataLoader``, generators, plain values).
        metrics: what Ray records with this report (``ray.train.report``'s ``metrics``: str keys
            to plain values, no tensors; Ray keeps rank 0's); ``None``: none.

    Returns:
        The reference Ray was given (the same on every rank).

    Raises:
        RuntimeError: called outside a Ray Train worker (the driver, a plain script).
        TypeError: ``checkpointer`` is not a Checkpointer, or ``metrics`` not a mapping.
        ValueError: ``checkpointer`` writes single files in a group of several workers, or
            the ranks name different steps.
        SnapshotSaveError, SnapshotCorruptError, RankFailedError: the save, its commit or its
            verification failed (Ray is not told of the step).
    """
    rank, world_size = _worker("report")
    _check_checkpointer(checkpointer, world_size, "report")
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError(f"snapkeep.ray.report: metrics must be a mapping of str keys to plain "
                        f"values (or None), got {type(metrics).__name__}")
    checkpointer.save(step, state, force=True)
    checkpointer.wait()
    path = checkpointer.verify(step)
    reference = SnapshotReference(directory=_normalized(checkpointer.directory),
                                  name=path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1],
                                  step=step, world_size=world_size, version=__version__)
    if rank != 0:
        ray.train.report(dict(metrics or {}), checkpoint=None)
        return reference
    with tempfile.TemporaryDirectory(prefix="snapkeep-ray-") as local:
        with open(os.path.join(local, REFERENCE_NAME), "w", encoding="utf-8") as f:
            f.write(reference.to_json())
        ray.train.report(dict(metrics or {}), checkpoint=ray.train.Checkpoint.from_directory(
            local))  # copied (synchronously) into Ray's storage before this returns
    return reference


def resume(checkpointer: Checkpointer, into: MutableMapping[str, Any]) -> int | None:
    """Load what a restarted Ray Train worker resumes from into the live objects of ``into``;
    return its step, or ``None`` on a first start. Every worker calls it, before training.

    Ray's checkpoint (``ray.train.get_checkpoint()``), when there is one, must be a reference
    written by :func:`report` naming ``checkpointer``'s directory. Then snapkeep's newest
    committed snapshot that every rank verifies is loaded (``checkpointer.load(into)``: all
    ranks agree, falling back together past a corrupt one, resharded by DCP): the step Ray
    names, or a newer one committed before Ray registered its report. A resume behind the step
    Ray names is refused. Without a Ray checkpoint, snapkeep's newest snapshot in the directory
    is loaded if there is one (a snapshot committed before Ray registered any report), else
    nothing (``None``).

    Args:
        checkpointer: the worker's open :class:`~snapkeep.Checkpointer` (sharded inside a group
            of several workers).
        into: the same mapping later given to :func:`report` (its keys select what is loaded).

    Returns:
        The step loaded, or ``None`` (a first start).

    Raises:
        RuntimeError: called outside a Ray Train worker.
        TypeError: ``checkpointer`` is not a Checkpointer.
        ValueError: Ray's checkpoint is not a snapkeep reference, or names another directory
            (nothing loaded); ``checkpointer`` writes single files in a group of several
            workers.
        NoValidSnapshotError: the directory holds no snapshot at or after the step Ray names
            (deleted, or none verifies); when the newer ones fail verification the older state
            may have been loaded into ``into``: do not train on.
        StateMismatchError, RankFailedError, NoCommonSnapshotError: as
            :meth:`Checkpointer.load`.
    """
    world_size = _worker("resume")[1]
    _check_checkpointer(checkpointer, world_size, "resume")
    checkpoint = ray.train.get_checkpoint()
    return resume_from(checkpointer, into,
                       reference_of(checkpoint) if checkpoint is not None else None)


def resume_from(checkpointer: Checkpointer, into: MutableMapping[str, Any],
                reference: SnapshotReference | None) -> int | None:
    """What :func:`resume` does once it has Ray's checkpoint, given as its ``reference`` (or
    ``None``): also usable outside Ray, to load the snapshot a finished run's
    ``result.checkpoint`` names, or a newer one, into live objects. Collective when
    ``checkpointer`` is sharded under torch.distributed.

    Args:
        checkpointer: an open :class:`~snapkeep.Checkpointer` on the directory the reference
            names.
        into: str keys to the live objects to load into, as for :meth:`Checkpointer.load`.
        reference: from :func:`reference_of`; ``None``: the directory's newest valid snapshot,
            if any.

    Returns:
        The step loaded, or ``None`` when there is nothing to resume (no reference, no
        snapshot).

    Raises:
        TypeError: ``checkpointer`` is not a Checkpointer, or ``reference`` not a
            SnapshotReference or None.
        ValueError: ``reference`` names another directory than ``checkpointer``'s; nothing
            loaded.
        NoValidSnapshotError: the directory holds no committed snapshot at or after the
            reference's step (nothing loaded), or those there do not verify (an older one was
            loaded into ``into``: do not train on).
        StateMismatchError, RankFailedError, NoCommonSnapshotError: as
            :meth:`Checkpointer.load`.
    """
    _check_checkpointer(checkpointer, 1, "resume_from")
    if reference is not None and not isinstance(reference, SnapshotReference):
        raise TypeError(f"snapkeep.ray.resume_from: reference must be a SnapshotReference (from "
                        f"snapkeep.ray.reference_of) or None, got {type(reference).__name__}")
    if reference is not None:
        mine = _normalized(checkpointer.directory)
        if reference.directory != mine:
            raise ValueError(
                f"snapkeep.ray: Ray's checkpoint refers to step {reference.step} in "
                f"{reference.directory!r}, but checkpointer writes to {mine!r}; nothing was "
                "loaded. Next: build the Checkpointer on the directory the run wrote to, or "
                "start a new Ray run (another RunConfig(name=...)) for a new directory")
        newest = checkpointer.latest_step()
        if newest is None or newest < reference.step:
            raise NoValidSnapshotError(
                f"snapkeep.ray: Ray's checkpoint names step {reference.step} "
                f"({reference.path}), but {mine!r} holds no committed snapshot at or after it "
                f"(steps there: {checkpointer.all_steps()[-20:]}); nothing was loaded. Was it "
                "deleted? Restore it, or start a new Ray run (another RunConfig(name=...))")
    step = checkpointer.load(into)
    if reference is not None and (step is None or step < reference.step):
        raise NoValidSnapshotError(
            f"snapkeep.ray: the snapshots of {reference.directory!r} at and after step "
            f"{reference.step} (the step Ray's checkpoint names) do not verify (each skipped "
            f"one is named on stderr); step {step} was loaded instead, behind what Ray "
            "recorded. Do not train on: repair or restore them (snapkeep verify DIR), or start "
            "a new Ray run")
    return step


def reference_of(checkpoint: ray.train.Checkpoint) -> SnapshotReference:
    """The snapshot a Ray checkpoint written by :func:`report` refers to: in a worker (from
    ``ray.train.get_checkpoint()``) or on the driver (``result.checkpoint`` after
    ``trainer.fit()``); ``snapkeep.load_latest(ref.directory, template="ckpt_{step}")`` or a
    Checkpointer on ``ref.directory`` then loads it.

    Args:
        checkpoint: a ``ray.train.Checkpoint``.

    Raises:
        TypeError: ``checkpoint`` is not a ``ray.train.Checkpoint``.
        ValueError: it holds no snapkeep reference (written by something else), or the
            reference is malformed (larger than 64 KiB, not JSON, a field missing or of the
            wrong type).
    """
    if not isinstance(checkpoint, ray.train.Checkpoint):
        raise TypeError(f"snapkeep.ray.reference_of: checkpoint must be a ray.train.Checkpoint "
                        f"(ray.train.get_checkpoint(), result.checkpoint), got "
                        f"{type(checkpoint).__name__}")
    with checkpoint.as_directory() as local:
        storage, directory = resolve_storage(local)
        path = storage.join(directory, REFERENCE_NAME)
        try:  # bounded, a regular file only, never blocking: it may be anyone's
            data = storage.read_bytes(path, max_bytes=MAX_REFERENCE_BYTES)
        except FileNotFoundError:
            raise ValueError(
                f"Ray checkpoint {checkpoint.path!r} holds no {REFERENCE_NAME}: it was not "
                "reported by snapkeep.ray.report (another tool's checkpoint, or a run started "
                "without snapkeep); start a new Ray run (another RunConfig(name=...))") from None
        except OSError as e:
            raise ValueError(f"Ray checkpoint {checkpoint.path!r}: {REFERENCE_NAME} is "
                             f"unreadable ({e})") from e
    try:
        record = parse_json(data, max_bytes=MAX_REFERENCE_BYTES)
    except RecordError as e:
        raise ValueError(f"Ray checkpoint {checkpoint.path!r}: {REFERENCE_NAME} is not a "
                         f"snapkeep reference ({e})") from e
    fields = {"directory": str, "name": str, "step": int, "world_size": int, "version": str}
    if not isinstance(record, dict) or record.get("format") != FORMAT or any(
            not isinstance(record.get(k), t) or isinstance(record.get(k), bool)
            for k, t in fields.items()):
        raise ValueError(f"Ray checkpoint {checkpoint.path!r}: {REFERENCE_NAME} is not a "
                         f"{FORMAT} reference (fields {sorted(fields)} expected); got "
                         f"{str(record)[:200]}")
    return SnapshotReference(**{k: record[k] for k in fields})


def _worker(function: str) -> tuple[int, int]:
    """(world rank, world size) of this Ray Train worker; RuntimeError naming ``function``
    anywhere else."""
    try:
        context = ray.train.get_context()
        return int(context.get_world_rank()), int(context.get_world_size())
    except RuntimeError as e:
        raise RuntimeError(
            f"snapkeep.ray.{function} must be called inside a Ray Train worker (the "
            "train_loop_per_worker function given to ray.train.torch.TorchTrainer, run by "
            f"trainer.fit()); outside Ray use the Checkpointer itself (checkpointer.save / "
            f"checkpointer.load). Ray said: {e}") from e


def _check_checkpointer(checkpointer: Any, world_size: int, function: str) -> None:
    if not isinstance(checkpointer, Checkpointer):
        raise TypeError(f"snapkeep.ray.{function}: checkpointer must be a snapkeep.Checkpointer "
                        f"(snapkeep.Checkpointer(directory) inside the train function), got "
                        f"{type(checkpointer).__name__}")
    if world_size > 1 and not checkpointer.sharded:
        raise ValueError(
            f"snapkeep.ray.{function}: checkpointer writes single files (sharded=False) in a "
            f"group of {world_size} workers: every worker would write the same file, and the "
            "other ranks' data positions and random streams would be lost. Create it with "
            "sharded=None (the default; sharded under torch.distributed) or sharded=True")


def _normalized(directory: str) -> str:
    """A local directory as an absolute path (Ray's workers may start in other working
    directories); a URL as given."""
    return directory if "://" in directory else os.path.abspath(directory)
