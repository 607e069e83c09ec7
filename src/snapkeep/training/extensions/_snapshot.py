"""The snapshot extension: ``snapshot`` / ``snapshot_object`` with ppe's arguments.

Differences from ppe that users rely on:

- ``autoload`` picks the snapshot with the highest step parsed from the filename template (not
  the newest mtime), verifies its checksum, falls back to the next older valid one (its resume
  notice on stderr names each skipped file, see ``_resume_notice``), and raises
  :class:`~snapkeep.NoValidSnapshotError` when snapshot files exist but none is valid (ppe
  silently started over). It is all-or-nothing: a snapshot
  that does not fit the target raises :class:`~snapkeep.StateMismatchError` before anything is
  loaded (see :mod:`._restore`).
- Loading is safe by default (``torch.load(weights_only=True)``); ``weights_only=False`` opts in to
  arbitrary unpickling.
- ``n_retains`` (and ``retention=``) are the last stage of each save, run by the core's saver
  after the commit (on the saver rank only), and never delete the newest snapshot.
- One trainer per snapshot directory, whatever its template: ``initialize`` takes the store's
  lock (before autoload; the extensions of one manager share it) and ``finalize`` releases
  it; a second trainer gets
  :class:`~snapkeep.errors.StoreLockedError` naming the holder. Local filesystems only; see
  :mod:`snapkeep._core.store.lock` for what is not locked.
- On-error snapshots (``snapshot_on_error=True``) get their own name (``<name>.on-error``), so
  they never replace or outrank a clean snapshot; autoload never resumes from one.

Run lineage (which snapshots retention may delete) is in :mod:`._lineage`; the extension class
these functions return is in :mod:`._snapshot_extension`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch

from snapkeep.retention import RetentionPolicy
from snapkeep.store import check_timeout_s
from snapkeep.training.extensions._find import (
    find_latest_snapshot,
    find_snapshot_files,
    find_stale_snapshots,
)
from snapkeep.training.extensions._snapshot_extension import SnapshotExtension

# -- ppe compatibility ----------------------------------------------------------------------------
# This module is ppe's ``training/extensions/_snapshot.py`` path, and the one snapkeep module that
# keeps ppe's private names of it importable (code written against ppe imports them from here):
# ``_find_snapshot_files``, ``_find_latest_snapshot``, ``_find_stale_snapshots``, ``_Snapshot`` and
# ``_DistributedSnapshot``. Snapkeep's own code imports the public names from their homes.
# tests/interop/test_ppe_private_paths.py checks that these paths resolve.
_find_snapshot_files = find_snapshot_files
_find_latest_snapshot = find_latest_snapshot
_find_stale_snapshots = find_stale_snapshots
_Snapshot = SnapshotExtension


class SnapshotMode(enum.Enum):
    """As ppe's ``SnapshotMode``; ``SHARDED`` saves through torch.distributed.checkpoint (see
    ``extensions.sharded_snapshot``)."""

    DEFAULT = enum.auto()
    DISTRIBUTED = enum.auto()
    SHARDED = enum.auto()


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
    generators: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    overlap: bool | str = True,
    quiet: bool = False,
    loaders: Mapping[str, Any] | None = None,
    incremental: bool = False,
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
        snapshot_on_error: also take a snapshot when the training loop raises, and wait for it
            (as ppe). It holds mid-iteration state, so it is written as ``<name>.on-error``
            (``snapkeep.store.ON_ERROR_SUFFIX``): it never replaces a clean snapshot of the
            same iteration, autoload never resumes from it and retention never deletes it.
        n_retains: keep the newest ``n_retains`` snapshots by step; <= 0 keeps all (as ppe).
            Only snapshots of this run's lineage are ever deleted (see the module docstring).
        autoload: load the newest valid snapshot in ``initialize`` (returns its name, as ppe)
            and continue its run lineage. All or nothing: the snapshot is checked to fit the
            target first (see ``_restore``). With ``autoload=False``, existing snapshots of the
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
        generators: RNGs the training loop owns, by name (``random.Random``, NumPy
            generators, ``torch.Generator``, or objects with ``state_dict``/``load_state_dict``),
            saved and restored with the global RNG states in this extension's part of the
            manager's state (snapkeep addition; manager snapshots only). A ``DataLoader``'s
            generator belongs in ``loaders=`` instead: its state at the snapshot is not the
            state the next epoch starts from.
        loaders: data loaders the loop iterates, by name (``torch.utils.data.DataLoader`` with
            any sampler, ``num_workers`` >= 0, ``DistributedSampler``; torchdata's
            ``StatefulDataLoader``). Each loader's position (its epoch's order and the batches
            the loop has received) is saved; after a resume the loop's next ``iter(loader)``
            continues the epoch where it stopped, with the same batches in the same order, so
            ``for batch in loader`` ends with the manager's epoch. The loader object is hooked
            in place (see ``snapkeep._core.state.data_position``). snapkeep addition; manager
            snapshots only.
        timeout_s: with ``saver_rank`` or ``SHARDED``: bound in seconds (default 600) of every
            collective snapkeep makes; a rank that fails raises the same error on every rank,
            naming it, and a rank that died makes the others raise within ``timeout_s``.
        overlap: ``True`` (default), ``False`` or ``'strict'``. With a background writer, the
            call copies at once everything but the manager's optimizers' parameters and state,
            which are copied while the next forward/backward runs; those optimizers' ``step()``
            waits for the copy, then checks on the training thread that no tensor was modified
            in place since the call; the snapshot is published only after that check (the
            step, the end of ``run_iteration``, the next snapshot or ``finalize``). A modified
            tensor drops that snapshot (never a torn file): one ``RuntimeWarning`` names it and
            this extension copies in the call from then on; ``'strict'`` raises
            :class:`snapkeep.StagingRaceError` there instead. See :mod:`snapkeep._core.save.overlap`
            for what the check cannot see. ``False`` copies all of the state in the call.
        quiet: with ``autoload``, do not print the resume notice: by default ``initialize``
            writes on stderr (rank 0 only under torch.distributed) one line naming the snapshot
            resumed from and its step, or that it starts fresh in which directory, and one line
            per snapshot skipped with its reason (corrupt, misnamed, incomplete sharded
            directory; see ``_resume_notice``). snapkeep addition.
        incremental: write incremental snapshots (single-file modes with a snapkeep writer, a
            string ``filename`` template and ``torch.save``): each tensor storage of at least
            1 MiB is stored once, as a content-addressed blob in ``out/.snapkeep/blobs/``, and
            a snapshot refers to the blobs of storages unchanged since the previous one (a
            frozen backbone is written once). Autoload, ``snapkeep.load_latest`` and the CLI
            load and verify every blob; retention deletes a blob when no snapshot refers to it
            any more; a bare ``torch.load`` fails pointing to ``snapkeep convert`` (see
            :mod:`snapkeep._core.tiers.incremental`). Default False. snapkeep addition.

    Raises:
        TypeError: ``savefun`` and ``writer`` both given (as ppe); a wrong argument type
            (``quiet`` not a bool, ``loaders`` not a mapping of names to accepted loaders,
            ...).
        ValueError: a bad value (the message names the argument and what is accepted).
        RuntimeError: ``saver_rank``/``DISTRIBUTED`` without an initialised process group.
    """
    if savefun is not None and writer is not None:
        raise TypeError("savefun and writer arguments cannot be specified together.")
    check_timeout_s(timeout_s, none_ok=True)  # (used with saver_rank or SHARDED)
    kwargs: dict[str, Any] = dict(
        target=target, condition=condition, writer=writer, filename=filename,
        snapshot_on_error=snapshot_on_error, n_retains=n_retains, autoload=autoload,
        savefun=savefun, retention=retention, weights_only=weights_only,
        map_location=map_location, on_save_error=on_save_error, generators=generators,
        overlap=overlap, quiet=quiet, loaders=loaders,
    )
    if not isinstance(incremental, bool):
        raise TypeError(f"incremental must be True or False, got {incremental!r}")
    if incremental:
        if snapshot_mode == SnapshotMode.SHARDED:
            raise ValueError("incremental=True is for single-file snapshots; SHARDED "
                             "(torch.distributed.checkpoint) snapshots cannot be incremental yet")
        if savefun is not None and savefun is not torch.save:
            raise ValueError("incremental snapshots are torch.save files: savefun must be "
                             f"None or torch.save, got {savefun!r}")
        if not isinstance(filename, str):
            raise ValueError("incremental=True needs a string filename template (its blobs "
                             "are kept per template), not a callable")
        kwargs["incremental"] = True
    if snapshot_mode == SnapshotMode.DEFAULT and saver_rank is None:
        return _Snapshot(**kwargs)
    if snapshot_mode in (SnapshotMode.DEFAULT, SnapshotMode.DISTRIBUTED):
        if saver_rank is None:
            raise ValueError("snapshot_mode=DISTRIBUTED requires saver_rank (an int rank)")
        from snapkeep.training.extensions._distributed import DistributedSnapshotExtension

        return DistributedSnapshotExtension(saver_rank=saver_rank, timeout_s=timeout_s, **kwargs)
    if snapshot_mode == SnapshotMode.SHARDED:
        from snapkeep.training.extensions._sharded import (  # imports this module
            ShardedSnapshotExtension,
        )

        return ShardedSnapshotExtension(saver_rank=saver_rank, timeout_s=timeout_s or 600.0,
                                        **kwargs)
    raise ValueError(f"snapshot_mode must be a SnapshotMode, got {snapshot_mode!r}")


def __getattr__(name: str) -> Any:
    """``_DistributedSnapshot`` and ``RANK_RNG_KEY`` moved to ``_distributed``."""
    if name in ("_DistributedSnapshot", "RANK_RNG_KEY"):
        from snapkeep.training.extensions import _distributed

        return getattr(_distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["snapshot", "snapshot_object", "SnapshotMode"]
