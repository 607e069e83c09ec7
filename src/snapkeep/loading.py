"""Load the newest verified snapshot of a directory without building a manager.

:func:`load_latest` is what ``snapshot(autoload=True)`` does before it applies the state, for
evaluation scripts, notebooks and exports: the same choice of file (the highest step parsed from
the filename template among snapshots that verify), the same fallback to an older snapshot (with a
warning naming each one skipped), and the same errors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from snapkeep.session import Session, warn_user
from snapkeep.store import (
    Entry,
    SnapshotStore,
    lookalike_message,
    newest_valid,
    ppe_template,
    resolve_storage,
    skip_message,
)

__all__ = ["DEFAULT_TEMPLATE", "load_latest"]

logger = logging.getLogger(__name__)

#: ppe's default snapshot filename (``extensions.snapshot()``).
DEFAULT_TEMPLATE = "snapshot_iter_{.iteration}"


def _store(storage: Any, directory: str, template: str) -> SnapshotStore:
    """The object owning the template's files in ``directory`` (one call site to port);
    ``template`` spelled as ppe's ``filename`` or as the store's (``'ckpt_{step}'``)."""
    return SnapshotStore(storage, directory, ppe_template(template))


def load_latest(
    out_dir: str | os.PathLike[str], *, template: str = DEFAULT_TEMPLATE,
    map_location: Any = "cpu", weights_only: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Any | None:
    """Return the state of the newest verified snapshot in ``out_dir``, or ``None`` when there
    is none.

    The snapshot is chosen as autoload chooses it: the highest step parsed from ``template``
    (never mtime) among files that match their checksum manifest, or -- without a manifest
    (written by ppe, or interrupted before it) -- load completely. A file that fails is skipped
    with a ``RuntimeWarning`` naming it, and the next older one is tried.

    Example::

        state = snapkeep.load_latest("result/demo")
        if state is not None:
            model.load_state_dict(state["models"]["main"])

    Args:
        out_dir: the snapshot directory: a local path or an fsspec URL (``s3://bucket/run``,
            ``memory://run``); the trainer's ``manager.out`` or the writer's ``out_dir``.
        template: the filename template the snapshots were written with (the ``filename`` of
            ``extensions.snapshot``), or the same in the store's spelling (``'ckpt_{step}'``,
            the Checkpointer's); snapshots are ordered by its fields (``{.iteration}``).
        map_location: as ``torch.load``'s (default ``'cpu'``: tensors are loaded to CPU memory
            whatever device they were saved from).
        weights_only: ``True`` (default) loads tensors, containers and primitive values only
            (``torch.load(weights_only=True)``); ``False`` allows arbitrary unpickling, which
            can run code: trusted files only.
        storage_options: fsspec options for a URL (``endpoint_url``, credentials, ...).

    Returns:
        The state as saved (for a manager snapshot a dict with ``models``, ``optimizers``,
        ``extensions``, ...; for ``snapshot_object(model, ...)`` the model's ``state_dict``;
        for a sharded (DCP) snapshot directory of ``snapshot_mode=SHARDED``, its whole state
        gathered into one dict: ``models``, ``optimizers``, ``objects``, ``rank_state``), or
        ``None`` when ``out_dir`` holds no snapshot matching ``template`` -- the case in which
        autoload starts fresh -- or does not exist yet (a first run; a WARNING log line names
        the path, so that a typo shows). Files there that look like snapshots of another
        template (``100.pt`` for ``'snapshot_iter_{.iteration}'``) are named in a
        ``RuntimeWarning`` with the template that would match them (``'{.iteration}.pt'``).

    Raises:
        NoValidSnapshotError: files of the template exist but none verifies and loads (each
            reason listed); nothing is deleted.
        UnsafeSnapshotError: the newest valid file needs ``weights_only=False``; nothing in it
            was executed, and no older snapshot is loaded instead.
        SnapshotStorageError: the storage could not be reached (a URL's endpoint, credentials).
        NotADirectoryError: ``out_dir`` is a local file, not a directory.
        ValueError: ``template`` is malformed.
        TypeError: an argument has the wrong type.
    """
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"load_latest: out_dir must be a path or URL string, got "
                        f"{type(out_dir).__name__}")
    if not isinstance(template, str):
        raise TypeError(f"load_latest: template must be a str such as {DEFAULT_TEMPLATE!r}, "
                        f"got {type(template).__name__}")
    if not isinstance(weights_only, bool):
        raise TypeError(f"load_latest: weights_only must be True or False, got "
                        f"{weights_only!r}")
    location = os.fspath(out_dir)
    storage, directory = resolve_storage(
        location, storage_options=dict(storage_options) if storage_options else None)
    if storage.is_local and not os.path.isdir(directory):
        if os.path.exists(directory):
            raise NotADirectoryError(
                f"load_latest: out_dir {location!r} is not a directory; pass the directory the "
                "snapshots were written to (the trainer's out_dir)")
        # a first run: nothing to resume (one line, so that a typo in the path shows too)
        logger.warning("load_latest: %s does not exist: no snapshot to resume", location)
        return None
    try:
        store = _store(storage, directory, template)
    except ValueError as e:
        raise ValueError(f"load_latest: template {template!r} is malformed: {e}") from e

    # the engine's read: verified while loaded (one read of a local file), fallback warned
    found = Session(store, quiet=True).read_newest(map_location=map_location,
                                                   weights_only=weights_only)
    if found is None:
        sharded = _load_newest_sharded(
            storage, directory, template, map_location=map_location, weights_only=weights_only,
            storage_options=dict(storage_options) if storage_options else None)
        if sharded is not None:
            return sharded
        message = lookalike_message(storage.list_names(directory), template, "{.iteration}",
                                    location)
        if message is not None:
            warn_user(message, RuntimeWarning)
        logger.info("no snapshot matching %r in %s", template, location)
        return None
    entry, state = found
    logger.info("loaded snapshot %s (step %s)", entry.path, entry.step)
    return state


def _load_newest_sharded(storage: Any, directory: str, template: str, *, map_location: Any,
                         weights_only: bool,
                         storage_options: dict[str, Any] | None = None) -> Any | None:
    """The newest committed sharded (DCP) snapshot directory of ``template`` that verifies
    against its marker and reads safely, gathered into one state dict in memory; ``None`` when
    there is none. Falls back past a corrupt one with a warning, as autoload does. DCP's
    ``.metadata`` is read through an allow-list (see :mod:`snapkeep._core.distributed.dcp_safe`)
    and its ``CheckpointException`` becomes a snapkeep error.

    Raises:
        NoValidSnapshotError: sharded snapshots exist but none verifies and reads.
        UnsafeSnapshotError: the newest valid one needs ``weights_only=False``.
    """
    import torch

    from snapkeep.distributed import ShardedStore, gather_dcp

    sharded = ShardedStore(storage, directory, ppe_template(template),
                           storage_options=storage_options)

    def check(entry: Entry) -> Any:
        manifest = sharded.validate_part(entry, 0, 1, weights_only=weights_only)
        return gather_dcp(storage, entry.path, weights_only=weights_only,  # as autoload checks
                          storage_options=storage_options, listed=manifest.files)

    def skipped(entry: Entry, error: Exception) -> None:
        warn_user(skip_message(entry, error, kind="sharded snapshot"), RuntimeWarning)

    found = newest_valid(sharded.entries(), check, skipped=skipped,
                         what=f"{template!r} in {directory!r} (sharded)")
    if found is None:
        return None
    entry, state = found
    if isinstance(map_location, (str, torch.device)):
        state = _to_location(state, map_location, torch)
    logger.info("loaded sharded snapshot %s (step %s)", entry.path, entry.step)
    return state


def _to_location(state: Any, map_location: Any, torch: Any) -> Any:
    """Move every tensor of a gathered state as ``torch.load(map_location=...)`` would."""
    if isinstance(state, torch.Tensor):
        return state.to(map_location)
    if isinstance(state, dict):
        return {k: _to_location(v, map_location, torch) for k, v in state.items()}
    return state
