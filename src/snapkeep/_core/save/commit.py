"""The commit of one snapshot: data file and manifest as one unit.

:func:`commit_job` runs wherever the writer's runner puts it (the trainer, a writer thread or
the persistent worker process), so it takes everything from a picklable
:class:`~snapkeep._core.save.job.SaveJob`; :class:`~snapkeep._core.store.files.SnapshotStore` owns
the
files otherwise (``SnapshotStore.commit`` wraps this in the calling thread).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from snapkeep._core.format.manifest import MAX_MANIFEST_BYTES, Manifest, manifest_path, now_unix_s
from snapkeep._core.save.job import CommitRecord, SaveJob
from snapkeep._core.storage import Storage, WriteResult

logger = logging.getLogger(__name__)

#: Name length limit assumed where the filesystem cannot be asked (POSIX NAME_MAX of ext4, xfs).
DEFAULT_NAME_MAX = 255


def commit_job(job: SaveJob, obj: Any) -> CommitRecord:
    """Encode ``obj`` with ``job.savefun`` and commit it with its manifest, as one unit.

    First the name and its manifest's name are checked against the filesystem's limit (nothing
    is written for a name that cannot get a manifest). The storage publishes the data and its
    manifest as one unit (:meth:`~snapkeep._core.storage.Storage.publish_with_companion`:
    both temps durable then both renamed on local files; one complete PUT then the manifest on
    object stores; a manifest that cannot be written takes the snapshot back out). A snapshot
    never stays committed without its manifest because of a failed write; a kill between the
    two publishing steps can leave one, which then loads as unverified.

    Raises:
        ValueError: the name or its manifest's name is longer than the filesystem allows (the
            message names the limit); nothing was written.
        SnapshotStorageError: an OS/storage fault (file, bytes and errno named); nothing partial
            is left under ``job.path``.
        Exception: whatever ``savefun`` raised, after the same clean-up.
    """
    if not callable(job.savefun):
        raise TypeError(
            f"savefun must be a callable like torch.save(obj, file), got {job.savefun!r}"
        )
    start = time.perf_counter()
    storage = job.storage
    directory = storage.dirname(job.path)
    if not job.append:
        check_name_length(storage, job.path)
    storage.makedirs(directory)
    if job.append:
        storage.append(job.path, lambda f: job.savefun(obj, f, **job.savefun_kwargs))
        return CommitRecord(
            path=job.path, size_bytes=storage.size(job.path), checksum=None,
            write_s=time.perf_counter() - start, step=job.step,
        )
    mpath = manifest_path(storage, job.path)
    storage.makedirs(storage.dirname(mpath))
    blobs: dict[str, int] = {}
    blob_bytes = 0
    blob_digests: tuple[Any, ...] = ()
    if job.incremental is not None:  # the blobs first, durable, then the skeleton
        from snapkeep._core.tiers.incremental import encode

        encoded = encode(obj, job.incremental, tag=job.tag)
        obj, blobs = encoded.skeleton, encoded.blobs
        blob_bytes, blob_digests = encoded.written_bytes, encoded.digests

    def write_data(f: Any) -> None:
        job.savefun(obj, f, **job.savefun_kwargs)

    def manifest_for(result: WriteResult) -> bytes:
        return Manifest(
            name=storage.basename(job.path), size_bytes=result.size_bytes,
            checksum=result.checksum, step=job.step, created_unix_s=now_unix_s(),
            snapkeep_version=job.version, run_id=job.run_id, metrics=dict(job.metrics),
            blobs=blobs, blob_area=job.incremental.area_name if blobs else "", door=job.door,
        ).to_bytes()

    result = storage.publish_with_companion(
        job.path, mpath, write_data, manifest_for, tag=job.tag,
        companion_max_bytes=MAX_MANIFEST_BYTES)
    elapsed = time.perf_counter() - start
    logger.debug("committed %s (%d bytes, step %s) in %.3f s", job.path, result.size_bytes,
                 job.step, elapsed)
    return CommitRecord(
        path=job.path, size_bytes=result.size_bytes, checksum=result.checksum, write_s=elapsed,
        step=job.step, blob_bytes=blob_bytes, blob_digests=blob_digests,
    )


def name_max(storage: Storage, directory: str) -> int | None:
    """Longest file name (bytes) the local filesystem under ``directory`` accepts; ``None`` for
    object stores and other non-local storages (keys have no per-component limit there)."""
    if not storage.is_local:
        return None
    probe = directory
    while probe and not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        return int(os.pathconf(probe or ".", "PC_NAME_MAX"))
    except (OSError, ValueError):
        return DEFAULT_NAME_MAX


def check_name_length(storage: Storage, path: str) -> None:
    """Refuse a snapshot name whose manifest name (name + ``'.json'``) exceeds the filesystem's
    NAME_MAX, before anything is written.

    Raises:
        ValueError: names the name, its length and the limit.
    """
    name = storage.basename(path)
    limit = name_max(storage, storage.dirname(path))
    longest = len((name + ".json").encode())
    if limit is not None and longest > limit:
        raise ValueError(
            f"snapshot name {name!r} is {len(name.encode())} bytes; with its manifest's '.json' "
            f"suffix it needs {longest} bytes, over this filesystem's NAME_MAX of {limit} bytes. "
            f"Use a filename template that gives names of at most {limit - 5} bytes")
