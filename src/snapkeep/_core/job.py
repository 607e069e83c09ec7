"""The one save path: encode -> commit -> record checksum.

:func:`execute` runs wherever an executor puts it (the caller's thread, a writer thread or the
persistent worker process); everything it needs travels in a picklable :class:`SaveJob`.
Retention and other post-commit hooks run afterwards in the trainer process (see ``saver``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from snapkeep._core.manifest import MAX_MANIFEST_BYTES, Manifest, manifest_path, now_unix_s
from snapkeep._core.storage import Storage

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveJob:
    """Everything a worker needs to write one snapshot.

    Attributes:
        storage: where to write.
        path: final path of the snapshot on ``storage``.
        savefun: ``savefun(obj, file, **savefun_kwargs)``, torch.save's argument order.
        savefun_kwargs: extra keyword arguments for ``savefun``.
        append: open in append mode without atomic commit or manifest (ppe's ``append=True``).
        tag: short string unique to the writer, used in temporary names.
        step: training iteration, recorded in the manifest.
        run_id: run lineage recorded in the manifest.
        metrics: observation values recorded in the manifest.
        version: snapkeep version recorded in the manifest.
    """

    storage: Storage
    path: str
    savefun: Callable[..., Any]
    savefun_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    append: bool = False
    tag: str = "w"
    step: int | None = None
    run_id: str | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    version: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommitRecord:
    """A committed snapshot.

    Attributes:
        path: final path.
        size_bytes: bytes written.
        checksum: content checksum (``None`` for append-mode writes).
        write_s: seconds spent encoding and committing (in the worker).
        step: training iteration when known.
    """

    path: str
    size_bytes: int
    checksum: str | None
    write_s: float
    step: int | None = None


def execute(job: SaveJob, obj: Any) -> CommitRecord:
    """Encode ``obj`` with ``job.savefun`` and commit it atomically, then its manifest.

    Raises:
        SnapshotStorageError: an OS/storage fault (file, bytes and errno named); nothing partial
            is left under ``job.path`` and the previous snapshot of that name is intact.
        Exception: whatever ``savefun`` raised, after the same clean-up.
    """
    if not callable(job.savefun):
        raise TypeError(
            f"savefun must be a callable like torch.save(obj, file), got {job.savefun!r}"
        )
    start = time.perf_counter()
    storage = job.storage
    directory = storage.dirname(job.path)
    storage.makedirs(directory)
    if job.append:
        storage.append(job.path, lambda f: job.savefun(obj, f, **job.savefun_kwargs))
        return CommitRecord(
            path=job.path, size_bytes=storage.size(job.path), checksum=None,
            write_s=time.perf_counter() - start, step=job.step,
        )
    mpath = manifest_path(storage, job.path)
    previous_manifest = _drop_stale_manifest(storage, mpath)
    try:
        result = storage.write(
            job.path, lambda f: job.savefun(obj, f, **job.savefun_kwargs), tag=job.tag
        )
    except BaseException:
        # the previous file of this name is intact: so must be its manifest
        _restore_manifest(storage, mpath, previous_manifest, job.tag)
        raise
    manifest = Manifest(
        name=storage.basename(job.path), size_bytes=result.size_bytes, checksum=result.checksum,
        step=job.step, created_unix_s=now_unix_s(), snapkeep_version=job.version,
        run_id=job.run_id, metrics=dict(job.metrics),
    )
    storage.makedirs(storage.dirname(mpath))
    storage.write_bytes(mpath, manifest.to_bytes(), tag=job.tag)
    elapsed = time.perf_counter() - start
    logger.debug("committed %s (%d bytes, step %s) in %.3f s", job.path, result.size_bytes,
                 job.step, elapsed)
    return CommitRecord(
        path=job.path, size_bytes=result.size_bytes, checksum=result.checksum, write_s=elapsed,
        step=job.step,
    )


def _drop_stale_manifest(storage: Storage, mpath: str) -> bytes | None:
    """Remove the manifest of a file about to be overwritten (same name saved again); return
    its bytes (None when there was none) so that a failed save can put it back.

    Otherwise a crash between the new file's commit and its manifest's would leave the old
    manifest describing the new file, and a good snapshot would fail verification. Without a
    manifest the file (old or new, each complete) loads as unverified instead.
    """
    try:
        previous = storage.read_bytes(mpath, max_bytes=MAX_MANIFEST_BYTES)  # a FIFO never blocks
    except FileNotFoundError:
        return None
    try:
        storage.remove(mpath)
    except FileNotFoundError:
        return None
    except OSError as e:  # the save itself can still succeed; only the crash window stays open
        logger.warning("could not remove the stale manifest %s before overwriting its snapshot: "
                       "%s", mpath, e)
        return None
    return previous


def _restore_manifest(storage: Storage, mpath: str, data: bytes | None, tag: str) -> None:
    """Put back the manifest removed by :func:`_drop_stale_manifest` after a failed save."""
    if data is None:
        return
    try:
        storage.write_bytes(mpath, data, tag=tag)
    except Exception as e:  # the save's own error is what the caller must see
        logger.warning("could not restore the manifest %s after a failed save; its snapshot "
                       "now loads as unverified: %s", mpath, e)
