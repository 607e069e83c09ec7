"""The snapshot extension: ``snapshot`` / ``snapshot_object`` with ppe's arguments.

Differences from ppe that users rely on:

- ``autoload`` picks the snapshot with the highest step parsed from the filename template (not
  the newest mtime), verifies its checksum, falls back to the next older valid one with a warning
  naming each skipped file, and raises :class:`~snapkeep.NoValidSnapshotError` when snapshot
  files exist but none is valid (ppe silently started over).
- Loading is safe by default (``torch.load(weights_only=True)``); ``weights_only=False`` opts in to
  arbitrary unpickling.
- ``n_retains`` (and ``retention=``) run after each commit, on the saver rank only, and never
  delete the newest snapshot.

Run lineage (guards against pointing a new experiment at an old output directory): each
extension instance has a ``run_id`` that is recorded in every snapshot's manifest. ``autoload``
adopts the run id of the snapshot it resumes from (for a manifest-less snapshot, that of the
newest older snapshot with a manifest, and the manifest-less files join the lineage), so a
resumed run keeps one id across restarts. Retention only ever deletes snapshots of the current
lineage; snapshots of any other run (or manifest-less ones, unless resumed from) are kept. With
``autoload=False`` and snapshots of the template already in the directory, ``initialize`` warns
once that this run starts fresh beside them.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import types
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed

from snapkeep._core.catalog import Catalog, Entry
from snapkeep._core.errors import SnapshotError, StateMismatchError
from snapkeep._core.job import CommitRecord
from snapkeep._core.loading import load_file
from snapkeep._core.manifest import manifest_path, read_manifest
from snapkeep._core.naming import FilenameTemplate
from snapkeep._core.retention import KeepLatest, RetentionPolicy, SnapshotInfo, plan_deletions
from snapkeep._core.storage import resolve_storage
from snapkeep._core.structure import describe, find_mismatches
from snapkeep.training import extension
from snapkeep.training._rng_state import capture_rng_state, restore_rng_state
from snapkeep.writing import Writer as _SnapkeepWriter

logger = logging.getLogger(__name__)

ON_SAVE_ERROR = ("raise", "log")



_LINEAGE_ATTRIBUTE = "_snapkeep_run_lineage"


@dataclasses.dataclass
class _RunLineage:
    """The run id written into manifests and the ids whose snapshots retention may delete;
    shared by the snapshot extensions of one manager."""

    run_id: str
    members: frozenset[str | None]


def _has_autoloading_snapshot(manager: Any) -> bool:
    """Whether another snapshot extension of ``manager`` resumes the run (``autoload=True``)."""
    entries = getattr(manager, "_extensions", {})
    return any(isinstance(getattr(e, "extension", None), _Snapshot)
               and getattr(e.extension, "autoload", False) for e in entries.values())

class SnapshotMode(enum.Enum):
    """As ppe's ``SnapshotMode``; ``SHARDED`` is not supported yet."""

    DEFAULT = enum.auto()
    DISTRIBUTED = enum.auto()
    SHARDED = enum.auto()


def _always_true() -> bool:
    return True


# -- ppe's module-level helpers, ordered by the step parsed from the name (never by mtime) --------
def _catalog_for(fmt: str, path: str, fs: Any) -> Catalog:
    storage, directory = resolve_storage(path, fs)
    return Catalog(storage, directory, fmt)


def _find_snapshot_files(
    fmt: str, path: str, fs: Any = None,
) -> list[tuple[tuple[float, ...], str]]:
    """Snapshot files of template ``fmt`` directly under ``path``, as ppe's helper of that name.

    Names are matched against the whole template (not only its prefix and suffix); temporary
    files, manifests and other files are never listed. Unlike ppe, the first element of each
    pair is the sort key parsed from the name (iteration, then epoch, then other fields), not
    the mtime, and the list is ordered by it (oldest first).

    Args:
        fmt: a filename template such as ``'snapshot_iter_{.iteration}'``.
        path: directory (local path or fsspec URL).
        fs: filesystem as accepted by the writers' ``fs`` (None: picked from ``path``).
    """
    return [(entry.key, entry.name) for entry in _catalog_for(fmt, path, fs).entries()]


def _find_latest_snapshot(fmt: str, path: str, fs: Any = None) -> str | None:
    """Name of the snapshot with the highest step in ``path`` (None when there is none), as
    ppe's helper of that name but by step instead of mtime. The file is not verified here;
    ``autoload`` verifies and falls back to older snapshots."""
    files = _find_snapshot_files(fmt, path, fs)
    return files[-1][1] if files else None


def _find_stale_snapshots(
    fmt: str, path: str, n_retains: int, fs: Any = None
) -> Iterator[str]:
    """Names of the snapshots beyond the newest ``n_retains`` by step, oldest first (as ppe's
    helper of that name, which used mtime). Yields nothing when ``n_retains`` <= 0."""
    files = _find_snapshot_files(fmt, path, fs)
    if n_retains <= 0:
        return
    for _, name in files[: max(len(files) - n_retains, 0)]:
        yield name


def snapshot_object(target: Any, filename: str, savefun: Any = None, **kwargs: Any) -> _Snapshot:
    """Returns an extension that snapshots ``target`` (as ppe's ``snapshot_object``).

    Args:
        target: an object with ``state_dict()``/``load_state_dict()``, or a dict of them.
        filename: format string formatted with the manager (``'snapshot_{.iteration}'`` becomes
            ``'snapshot_10000'`` at iteration 10,000) or a callable ``manager -> str``.
        savefun: ``savefun(obj, file)`` (torch.save's order); cannot be combined with ``writer``.
        kwargs: the keyword arguments of :func:`snapshot`.
    """
    return snapshot(target=target, filename=filename, savefun=savefun, **kwargs)


def snapshot(
    savefun: Any = None,
    filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}",
    *,
    target: Any = None,
    condition: Callable[[], bool] | None = None,
    writer: Any = None,
    snapshot_on_error: bool = False,
    n_retains: int = -1,
    autoload: bool = False,
    saver_rank: int | None = None,
    snapshot_mode: SnapshotMode = SnapshotMode.DEFAULT,
    retention: RetentionPolicy | None = None,
    weights_only: bool = True,
    map_location: Any = "cpu",
    on_save_error: str = "raise",
) -> _Snapshot:
    """Returns an extension that snapshots the manager (or ``target``), as ppe's ``snapshot``.

    Runs once per epoch by default (trigger ``(1, 'epoch')``) at priority ``PRIORITY_SNAPSHOT``,
    after the other extensions of the same iteration.

    Args:
        savefun: ``savefun(obj, file)``, default ``torch.save``. Cannot be given with ``writer``.
            :func:`snapkeep.codecs.save_safetensors` writes tensor-only states as safetensors
            (autoload recognises the format from the file's first bytes).
        filename: template formatted with the manager, or a callable ``manager -> str``.
            Autoload and retention need a string template.
        target: object with ``state_dict``/``load_state_dict`` (or a dict of them); default: the
            manager (its state_dict holds models, optimizers, extensions, triggers, RNG state).
        condition: callable with no arguments; the snapshot is skipped when it returns False.
        writer: a writer from :mod:`snapkeep.writing` (default: the manager's writer).
        snapshot_on_error: also take a snapshot when the training loop raises, and wait for it.
        n_retains: keep the newest ``n_retains`` snapshots by step; <= 0 keeps all (as ppe).
            Only snapshots of this run's lineage are ever deleted (see the module docstring).
        autoload: load the newest valid snapshot in ``initialize`` (returns its name, as ppe)
            and continue its run lineage. With ``autoload=False``, existing snapshots of the
            template are left alone and a warning says so.
        saver_rank: under ``torch.distributed``, only this rank writes; every rank loads the
            snapshot the saver rank chose.
        snapshot_mode: as ppe; ``DISTRIBUTED`` requires ``saver_rank``.
        retention: a policy from :mod:`snapkeep.retention` (combined with ``n_retains`` by
            any-of).
        weights_only: safe loading (default). ``False`` allows arbitrary unpickling.
        map_location: ``torch.load``'s ``map_location`` for autoload (default ``'cpu'``).
        on_save_error: ``'raise'`` (default) stops training on a failed save; ``'log'`` logs it
            and continues.

    Raises:
        TypeError: ``savefun`` and ``writer`` both given (as ppe); a wrong argument type.
        ValueError: a bad value (the message names the argument and what is accepted).
        RuntimeError: ``saver_rank``/``DISTRIBUTED`` without an initialised process group.
    """
    if savefun is not None and writer is not None:
        raise TypeError("savefun and writer arguments cannot be specified together.")
    kwargs: dict[str, Any] = dict(
        target=target, condition=condition, writer=writer, filename=filename,
        snapshot_on_error=snapshot_on_error, n_retains=n_retains, autoload=autoload,
        savefun=savefun, retention=retention, weights_only=weights_only,
        map_location=map_location, on_save_error=on_save_error,
    )
    if snapshot_mode == SnapshotMode.DEFAULT and saver_rank is None:
        return _Snapshot(**kwargs)
    if snapshot_mode in (SnapshotMode.DEFAULT, SnapshotMode.DISTRIBUTED):
        if saver_rank is None:
            raise ValueError("snapshot_mode=DISTRIBUTED requires saver_rank (an int rank)")
        return _DistributedSnapshot(saver_rank=saver_rank, **kwargs)
    if snapshot_mode == SnapshotMode.SHARDED:
        raise NotImplementedError(
            "snapshot_mode=SHARDED is not supported by snapkeep yet; use DISTRIBUTED with "
            "saver_rank, or torch.distributed.checkpoint for sharded state")
    raise ValueError(f"snapshot_mode must be a SnapshotMode, got {snapshot_mode!r}")


def _check_target(target: Any) -> None:
    if target is None:
        return
    objects = target.items() if type(target) is dict else [("target", target)]
    for key, obj in objects:
        missing = [m for m in ("state_dict", "load_state_dict")
                   if not callable(getattr(obj, m, None))]
        if missing:
            where = "target" if type(target) is not dict else f"target[{key!r}]"
            raise TypeError(
                f"{where} ({type(obj).__name__}) has no {' or '.join(missing)}; snapshot targets "
                "must be objects with state_dict()/load_state_dict() (modules, optimizers, the "
                "manager) or a dict of them")


class _Snapshot(extension.Extension):
    """Takes snapshots of the manager or a target; see :func:`snapshot`."""

    trigger = 1, "epoch"
    priority = extension.PRIORITY_SNAPSHOT
    needs_model_state = True

    def __init__(
        self, target: Any = None, condition: Any = None, writer: Any = None,
        filename: str | Callable[[Any], str] = "snapshot_iter_{.iteration}",
        snapshot_on_error: bool = False, n_retains: int = -1, autoload: bool = False,
        savefun: Any = None, *, retention: RetentionPolicy | None = None,
        weights_only: bool = True, map_location: Any = "cpu", on_save_error: str = "raise",
    ) -> None:
        _check_target(target)
        if condition is None:
            condition = _always_true
        elif not callable(condition):
            raise TypeError(f"condition must be a callable returning bool, got {condition!r}")
        if isinstance(n_retains, bool) or not isinstance(n_retains, int):
            raise TypeError(
                f"n_retains must be an int (> 0 keeps that many snapshots, <= 0 keeps all), "
                f"got {type(n_retains).__name__} {n_retains!r}")
        if retention is not None and not callable(getattr(retention, "select", None)):
            raise TypeError(
                f"retention must be a policy from snapkeep.retention, got {retention!r}")
        if on_save_error not in ON_SAVE_ERROR:
            raise ValueError(
                f"on_save_error must be one of {ON_SAVE_ERROR}, got {on_save_error!r}")
        if writer is not None and not callable(writer):
            raise TypeError(f"writer must be a callable writer object, got {writer!r}")
        if savefun is not None and not callable(savefun):
            raise TypeError(f"savefun must be callable like torch.save(obj, f), got {savefun!r}")
        self._template = FilenameTemplate(filename)
        self._target = target
        self.filename = filename
        self.condition = condition
        self.writer = writer
        self._snapshot_on_error = snapshot_on_error
        self.n_retains = n_retains
        self.autoload = autoload
        self._savefun = savefun
        self._weights_only = weights_only
        self._map_location = map_location
        self._on_save_error = on_save_error
        policies = [p for p in (KeepLatest(n_retains) if n_retains > 0 else None, retention) if p]
        self._retention: RetentionPolicy | None = None
        if len(policies) == 1:
            self._retention = policies[0]
        elif policies:
            from snapkeep._core.retention import AnyOf

            self._retention = AnyOf(*policies)
        self._retention_registered = False
        self.loaded_entry: Entry | None = None
        run_id = uuid.uuid4().hex[:16]
        self._shared = _RunLineage(run_id=run_id, members=frozenset({run_id}))

    @property
    def run_id(self) -> str:
        """Run lineage id written into each snapshot's manifest (adopted on autoload; shared by
        every snapshot extension of one manager)."""
        return self._shared.run_id

    @property
    def _run_id(self) -> str:
        return self._shared.run_id

    @_run_id.setter
    def _run_id(self, value: str) -> None:
        self._shared.run_id = value

    @property
    def _lineage(self) -> frozenset[str | None]:
        return self._shared.members

    @_lineage.setter
    def _lineage(self, value: frozenset[str | None]) -> None:
        self._shared.members = value

    # -- lifecycle -----------------------------------------------------------------------------
    def initialize(self, manager: Any) -> str | None:  # type: ignore[override]
        """Resolve the writer, autoload (returns the loaded file name or None, as ppe) and
        register retention.

        Raises:
            NoValidSnapshotError: snapshot files exist but none verifies.
            StateMismatchError: the chosen snapshot does not fit the target (first 10 listed).
            UnsafeSnapshotError: the snapshot needs ``weights_only=False``.
            ValueError: the filename template names an attribute the manager does not have.
            SnapshotStorageError: the writer's output directory cannot be created.
        """
        self.writer = manager.writer if self.writer is None else self.writer
        # one lineage per manager: a snapshot_object beside an autoloading snapshot continues
        # the run that snapshot resumed (and its retention keeps deleting that run's files)
        shared = getattr(manager, _LINEAGE_ATTRIBUTE, None)
        if isinstance(shared, _RunLineage):
            self._shared = shared
        else:
            setattr(manager, _LINEAGE_ATTRIBUTE, self._shared)
        self._check_template(manager)
        if self._is_saver():
            writer = self.writer
            if isinstance(writer, _SnapkeepWriter) and not writer.initialized:
                writer.initialize(manager.out)  # an unusable out_dir fails now, naming it
            self._remove_stale_temps(manager)
        loaded = None
        if self.autoload:
            loaded = self._autoload(manager)
        elif self._is_saver() and not _has_autoloading_snapshot(manager):
            self._warn_about_existing(manager)
        self._register_retention(manager)
        return loaded

    def _check_template(self, manager: Any) -> None:
        """Fail before training when a string template names an attribute the manager lacks
        (instead of at the first snapshot). Fields that cannot be evaluated yet (observation
        keys, ``elapsed_time`` before the first iteration) are checked at each snapshot."""
        if not self._template.parsable:
            return
        try:
            self._template.format(manager)
        except ValueError as e:
            if isinstance(e.__cause__, (AttributeError, IndexError)):
                raise
        except Exception as e:  # not evaluable yet; format() checks again at each snapshot
            logger.debug("filename template %r not checked before training: %s",
                         self.filename, e)

    def on_error(self, manager: Any, exc: Exception, tb: types.TracebackType) -> None:
        super().on_error(manager, exc, tb)
        if self._snapshot_on_error:
            self._make_snapshot(manager)
            wait = getattr(self.writer, "wait", None)
            if callable(wait):
                wait()

    def __call__(self, manager: Any) -> None:
        if self.condition():
            self._make_snapshot(manager)

    def finalize(self, manager: Any) -> None:
        """Finalize the writer (waits for pending snapshots). A background save failure raised
        there is logged instead when ``on_save_error='log'``."""
        writer = self.writer
        if writer is None:
            return
        try:
            writer.finalize()
        except (SnapshotError, OSError) as e:
            if self._on_save_error == "raise":
                raise
            logger.error("a snapshot failed before finalize and on_save_error='log': %s", e)

    # -- saving --------------------------------------------------------------------------------
    def _is_saver(self) -> bool:
        return True

    def _state(self, manager: Any) -> Any:
        target = manager if self._target is None else self._target
        if type(target) is dict:
            return {k: v.state_dict() for k, v in target.items()}
        return target.state_dict()

    def _make_snapshot(self, manager: Any) -> None:
        writer = manager.writer if self.writer is None else self.writer
        self.writer = writer
        if not self._is_saver():
            return
        self._register_retention(manager)
        state = self._state(manager)
        filename = self._template.format(manager)
        extra: dict[str, Any] = {}
        if isinstance(writer, _SnapkeepWriter):
            extra = {"step": int(manager.iteration), "metrics": _metrics(manager),
                     "run_id": self._run_id}
        if self._on_save_error == "log" and isinstance(writer, _SnapkeepWriter):
            try:  # an earlier background failure is logged here, so this snapshot is still taken
                writer._saver.raise_pending_error()
            except (SnapshotError, OSError) as e:
                logger.error("an earlier snapshot failed and on_save_error='log': %s", e)
        try:
            writer(filename, manager.out, state, savefun=self._savefun, **extra)
        except (SnapshotError, OSError) as e:
            if self._on_save_error == "raise":
                raise
            logger.error("snapshot %s at iteration %s failed and on_save_error='log': %s",
                         filename, manager.iteration, e)

    # -- autoload ------------------------------------------------------------------------------
    def _catalog(self, manager: Any, *, quiet: bool = False) -> Catalog | None:
        writer = self.writer
        if not isinstance(writer, _SnapkeepWriter):
            if not quiet:
                logger.warning("autoload/retention need a snapkeep writer; got %s",
                               type(writer).__name__)
            return None
        if not self._template.parsable:
            if not quiet:
                logger.warning("autoload/retention need a string filename template; %r is "
                               "callable", self.filename)
            return None
        storage, directory = writer.storage_for(manager.out)
        return Catalog(storage, directory, self._template)

    def _choose(self, catalog: Catalog) -> list[Entry] | None:
        """Candidates for autoload (all ranks use the saver rank's list in distributed mode)."""
        return catalog.entries()

    def _autoload(self, manager: Any) -> str | None:
        catalog = self._catalog(manager)
        if catalog is None:
            return None
        candidates = self._choose(catalog)
        if not candidates:
            return None
        target = manager if self._target is None else self._target

        def loader(entry: Entry, data: bytes | None) -> Any:
            return load_file(catalog.storage, entry.path, map_location=self._map_location,
                             weights_only=self._weights_only, data=data)

        found = catalog.load_newest(loader, candidates=candidates)
        if found is None:
            return None
        entry, state = found
        self._apply(target, state, entry)
        self.loaded_entry = entry
        self._adopt_lineage(catalog, candidates, entry)
        logger.info("resumed from snapshot %s (step %s, run id %s)", entry.path, entry.step,
                    self._run_id)
        return entry.name

    def _adopt_lineage(self, catalog: Catalog, candidates: list[Entry], loaded: Entry) -> None:
        """Continue the run lineage of the snapshot just loaded (see the module docstring)."""
        older = [e for e in candidates if e.key <= loaded.key]
        lineage: set[str | None] = set()
        for entry in reversed(older):
            manifest = catalog.manifest(entry)
            run_id = manifest.run_id if manifest is not None else None
            if run_id is None:
                lineage.add(None)  # a manifest-less (ppe) snapshot we resumed through
                continue
            self._run_id = run_id
            break
        lineage.add(self._run_id)
        # union: another extension of this manager may have resumed (and adopted) already; the
        # fresh id of this process wrote nothing yet, so keeping it deletes nothing extra
        self._lineage = frozenset(lineage | self._lineage)

    def _remove_stale_temps(self, manager: Any) -> None:
        """The writer cleans its own directory; a template's sub-directory and the manifest
        directory are only known here."""
        catalog = self._catalog(manager, quiet=True)
        if catalog is not None:
            catalog.remove_stale_temps()

    def _warn_about_existing(self, manager: Any) -> None:
        """``autoload=False`` beside existing snapshots of the template: say so, once."""
        catalog = self._catalog(manager, quiet=True)
        entries = catalog.entries() if catalog is not None else []
        if not entries or catalog is None:
            return
        run_ids = sorted({str(m.run_id) if (m := catalog.manifest(e)) else "unknown"
                          for e in entries})
        message = (
            f"{catalog.directory!r} already holds {len(entries)} snapshot(s) of "
            f"{self._template.template!r} (steps {entries[0].step}..{entries[-1].step}, run ids "
            f"{', '.join(run_ids[:5])}) and autoload=False: this run (run id {self._run_id}) "
            "starts fresh. Retention will not delete them, but a snapshot of this run with the "
            "same name replaces the old file; use another out_dir or autoload=True to resume.")
        warnings.warn(message, UserWarning, stacklevel=3)
        logger.warning("%s", message)

    def _apply(self, target: Any, state: Any, entry: Entry) -> None:
        if type(target) is dict:
            if not isinstance(state, Mapping):
                raise StateMismatchError(
                    f"snapshot {entry.path} holds a {type(state).__name__}, target is a dict")
            missing = [k for k in target if k not in state]
            if missing:
                raise StateMismatchError(
                    f"snapshot {entry.path} lacks target key(s) {missing[:10]}; nothing was "
                    "loaded or deleted")
            pairs = [(target[k], state[k], f"[{k!r}]") for k in target]
        else:
            pairs = [(target, state, "")]
        problems: list[str] = []
        for obj, sub, where in pairs:
            for module, module_state, prefix in _modules_to_check(obj, sub, where):
                if module is None:
                    problems.append(f"missing {prefix}")
                    continue
                problems += [f"{prefix}/{p}" if prefix else p
                             for p in find_mismatches(module.state_dict(), module_state)]
        if problems:
            raise StateMismatchError(
                f"snapshot {entry.path} (step {entry.step}) does not match the target: "
                f"{describe(problems)}. Nothing was loaded or deleted; point out_dir elsewhere or "
                "fix the model definition.")
        for obj, sub, _ in pairs:
            obj.load_state_dict(self._strip_rank_state(sub))
        self._restore_rank_state(state)

    def _strip_rank_state(self, state: Any) -> Any:
        """Hook for the distributed snapshot (per-rank RNG); the plain one keeps ``state``."""
        return state

    def _restore_rank_state(self, state: Any) -> None:
        """Hook for the distributed snapshot (per-rank RNG)."""

    # -- retention -----------------------------------------------------------------------------
    def _register_retention(self, manager: Any) -> None:
        if self._retention_registered or self._retention is None or not self._is_saver():
            return
        catalog = self._catalog(manager)
        writer = self.writer
        if catalog is None or not isinstance(writer, _SnapkeepWriter):
            return
        policy = self._retention
        self._retention_registered = True

        def retain(record: CommitRecord) -> None:
            _apply_retention(catalog, policy, record, self._lineage)

        writer.add_post_commit_hook(retain)


def _modules_to_check(
    obj: Any, state: Any, where: str,
) -> list[tuple[torch.nn.Module | None, Any, str]]:
    """``(module, its saved state, where)`` for the modules in ``obj`` whose state_dict layout
    must match exactly: ``obj`` itself when it is a module, or each of a manager's ``models``
    (from the snapshot's ``'models'`` section). Optimizers have lazily created state and
    validate themselves. ``module`` is None when the snapshot has no entry for it."""
    if isinstance(obj, torch.nn.Module):
        return [(obj, state, where)]
    saved = state.get("models") if isinstance(state, Mapping) else None
    models = getattr(obj, "models", None) if isinstance(saved, Mapping) else None
    if not isinstance(saved, Mapping) or not isinstance(models, Mapping):
        return []
    out: list[tuple[torch.nn.Module | None, Any, str]] = []
    for name, model in models.items():
        prefix = f"{where}models[{name!r}]"
        if not isinstance(model, torch.nn.Module):
            continue
        out.append((model, saved[name], prefix) if name in saved else (None, None, prefix))
    return out


def _metrics(manager: Any) -> dict[str, float]:
    observation = getattr(manager, "observation", None) or {}
    out: dict[str, float] = {}
    for key, value in observation.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out


def _apply_retention(
    catalog: Catalog, policy: RetentionPolicy, record: CommitRecord,
    lineage: frozenset[str | None],
) -> None:
    """Delete what ``policy`` does not keep among the snapshots of the run ``lineage`` (run ids
    from the manifests; None = manifest-less); never the newest or the just-committed one, and
    never a snapshot of another run."""
    entries = []
    infos = []
    foreign = 0
    listed = catalog.entries()
    for entry in listed:
        manifest = catalog.manifest(entry)
        if (manifest.run_id if manifest is not None else None) not in lineage:
            foreign += 1
            continue
        entries.append(entry)
        metrics = dict(manifest.metrics) if manifest is not None else {}
        infos.append(SnapshotInfo(name=entry.name, key=entry.key, step=entry.step,
                                  metrics=metrics))
    if foreign:
        logger.debug("retention after %s leaves %d snapshot(s) of other runs alone", record.path,
                     foreign)
    by_name = {e.name: e for e in entries}
    protect = [e.name for e in entries if e.path == record.path]
    for name in plan_deletions(policy, infos, protect=protect):
        entry = by_name[name]
        for path in (entry.path, manifest_path(catalog.storage, entry.path)):
            try:
                catalog.storage.remove(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("retention could not delete %s (step %s): %s", path, entry.step, e)
            else:
                logger.debug("retention deleted %s (step %s)", path, entry.step)
    _remove_orphan_manifests(catalog, listed, lineage)


def _remove_orphan_manifests(
    catalog: Catalog, listed: list[Entry], lineage: frozenset[str | None],
) -> None:
    """Delete manifests of this lineage whose snapshot is gone (left by a kill between the two
    deletes of a retention pass). A snapshot committed after ``listed`` was taken (an async
    writer's next one) is found by the existence check: its file precedes its manifest."""
    storage = catalog.storage
    for path in catalog.orphan_manifests(listed):
        snapshot = storage.join(storage.dirname(storage.dirname(path)),
                                storage.basename(path)[:-len(".json")])
        try:
            if storage.exists(snapshot):
                continue
        except OSError as e:
            logger.debug("leaving manifest %s: cannot check its snapshot (%s)", path, e)
            continue
        try:
            run_id = read_manifest(catalog.storage, path).run_id  # type: ignore[union-attr]
        except (FileNotFoundError, AttributeError):  # AttributeError: gone (None)
            continue
        except (OSError, ValueError, TypeError) as e:
            logger.debug("leaving unreadable orphan manifest %s: %s", path, e)
            continue
        if run_id not in lineage:
            continue
        try:
            catalog.storage.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("retention could not delete the orphan manifest %s: %s", path, e)
        else:
            logger.info("removed manifest %s, whose snapshot was already deleted", path)


RANK_RNG_KEY = "_rng_state_by_rank"
"""Key of the per-rank RNG states in a distributed manager snapshot (list indexed by rank)."""


class _DistributedSnapshot(_Snapshot):
    """Snapshot under ``torch.distributed``: only ``saver_rank`` writes; all ranks load the
    snapshot the saver rank chose (as ppe's ``_DistributedSnapshot``)."""

    def __init__(self, *, saver_rank: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            raise RuntimeError(
                "snapshot(saver_rank=...) requires torch.distributed to be initialized "
                "(torch.distributed.init_process_group) before the extension is created")
        self._size = torch.distributed.get_world_size()
        self._rank = torch.distributed.get_rank()
        if isinstance(saver_rank, bool) or not isinstance(saver_rank, int) \
                or not 0 <= saver_rank < self._size:
            raise ValueError(
                f"saver_rank must be an int in [0, {self._size}), got {saver_rank!r}")
        self._saver_rank = saver_rank
        self._rank_rng: list[Any] | None = None

    def _is_saver(self) -> bool:
        return self._rank == self._saver_rank

    def _make_snapshot(self, manager: Any) -> None:
        # Every rank's RNG state goes into the saver's snapshot, so a resumed rank continues its
        # own random stream (restoring the saver's state everywhere would make ranks identical).
        self._rank_rng = None
        if self._target is None and self._size > 1 and getattr(manager, "_save_rng_state", False):
            gathered: list[Any] = [None] * self._size
            torch.distributed.all_gather_object(gathered, capture_rng_state())
            self._rank_rng = gathered
        try:
            super()._make_snapshot(manager)
        finally:
            self._rank_rng = None
        if self._size > 1:
            torch.distributed.barrier()

    def _state(self, manager: Any) -> Any:
        state = super()._state(manager)
        if self._rank_rng is not None and isinstance(state, dict):
            state = {**state, RANK_RNG_KEY: self._rank_rng}
        return state

    def _strip_rank_state(self, state: Any) -> Any:
        if isinstance(state, Mapping) and RANK_RNG_KEY in state:
            return {k: v for k, v in state.items() if k != RANK_RNG_KEY}
        return state

    def _restore_rank_state(self, state: Any) -> None:
        per_rank = state.get(RANK_RNG_KEY) if isinstance(state, Mapping) else None
        if not per_rank:
            return
        if len(per_rank) != self._size:
            logger.warning("snapshot holds RNG states of %d ranks, world size is %d; rank %d "
                           "keeps the saver rank's state", len(per_rank), self._size, self._rank)
            return
        restore_rng_state(per_rank[self._rank])

    def _choose(self, catalog: Catalog) -> list[Entry] | None:
        entries = catalog.entries() if self._is_saver() else []
        box: list[Any] = [entries]
        if self._size > 1:
            torch.distributed.broadcast_object_list(box, src=self._saver_rank)
        chosen: list[Entry] = box[0]
        return [Entry(name=e.name, path=catalog.storage.join(catalog.directory, e.name),
                      key=e.key, step=e.step) for e in chosen]


__all__ = ["snapshot", "snapshot_object", "SnapshotMode"]
