"""The commit of one snapshot: data file and manifest as one unit.

:func:`commit_job` runs wherever the writer's runner puts it (the trainer, a writer thread or
the persistent worker process), so it takes everything from a picklable
:class:`~snapkeep._core.job.SaveJob`; :class:`~snapkeep._core.store.SnapshotStore` owns the
files otherwise (``SnapshotStore.commit`` wraps this in the calling thread).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.job import CommitRecord, SaveJob
from snapkeep._core.manifest import MAX_MANIFEST_BYTES, Manifest, manifest_path, now_unix_s
from snapkeep._core.storage import ReplaceCommit, Storage, Target, WriteResult
from snapkeep._core.storage._commit import fsync_directory, storage_error

logger = logging.getLogger(__name__)

#: Name length limit assumed where the filesystem cannot be asked (POSIX NAME_MAX of ext4, xfs).
DEFAULT_NAME_MAX = 255


def commit_job(job: SaveJob, obj: Any) -> CommitRecord:
    """Encode ``obj`` with ``job.savefun`` and commit it with its manifest, as one unit.

    First the name and its manifest's name are checked against the filesystem's limit (nothing
    is written for a name that cannot get a manifest). Local files (replace+fsync storages):
    the data temp and the manifest temp are both written, flushed and fsynced, then the old
    manifest of the name is removed and both are renamed into place, then the directories are
    fsynced; a failure before the renames (disk full on the manifest) leaves nothing new
    visible and the previous file of the name intact. Other storages (one PUT per object,
    rename-only filesystems) commit the snapshot, then its manifest; a manifest that cannot be
    written takes the snapshot back out. Either way a snapshot never stays committed without
    its manifest because of a failed write; a kill between the two publishing steps can leave
    one, which then loads as unverified.

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

    def write_data(f: Any) -> None:
        job.savefun(obj, f, **job.savefun_kwargs)

    def manifest_for(result: WriteResult) -> bytes:
        return Manifest(
            name=storage.basename(job.path), size_bytes=result.size_bytes,
            checksum=result.checksum, step=job.step, created_unix_s=now_unix_s(),
            snapkeep_version=job.version, run_id=job.run_id, metrics=dict(job.metrics),
        ).to_bytes()

    if isinstance(storage.strategy, ReplaceCommit):
        result = _commit_pair(storage, job.path, mpath, write_data, manifest_for, job.tag)
    else:
        result = _commit_in_order(storage, job.path, mpath, write_data, manifest_for, job.tag)
    elapsed = time.perf_counter() - start
    logger.debug("committed %s (%d bytes, step %s) in %.3f s", job.path, result.size_bytes,
                 job.step, elapsed)
    return CommitRecord(
        path=job.path, size_bytes=result.size_bytes, checksum=result.checksum, write_s=elapsed,
        step=job.step,
    )


def _commit_pair(
    storage: Storage, path: str, mpath: str, write_data: Callable[[Any], None],
    manifest_for: Callable[[WriteResult], bytes], tag: str,
) -> WriteResult:
    """Local files: both temps (data, then manifest) complete and durable, then both renamed
    into place, then the directories fsynced. A failure before the renames (disk full on the
    manifest) leaves nothing new visible and the previous file of the name intact; a kill
    between the two renames leaves the new file without a manifest (loads as unverified)."""
    data_tmp = storage.temp_name_for(path, tag)
    manifest_tmp = storage.temp_name_for(mpath, tag)
    strategy = storage.strategy
    published = False

    def write_manifest(f: Any) -> None:
        f.write(manifest)

    try:
        # a target whose final name is its temp name: written, flushed, fsynced, not published
        result = strategy.write(storage.fs, Target(
            path=data_tmp, temp_path=data_tmp, url=storage.url(path)), write_data)
        manifest = manifest_for(result)
        strategy.write(storage.fs, Target(
            path=manifest_tmp, temp_path=manifest_tmp, url=storage.url(mpath)), write_manifest)
        # both are durable: publish. The old manifest of the name goes first, so that no crash
        # leaves it describing the new file (in between, the old file loads as unverified)
        previous = _drop_stale_manifest(storage, mpath)
        try:
            os.replace(data_tmp, path)
        except BaseException:
            _restore_manifest(storage, mpath, previous, tag)
            raise
        published = True
        os.replace(manifest_tmp, mpath)
    except BaseException as e:
        if published:  # the manifest could not follow its snapshot: take the snapshot back
            _roll_back(storage, path, e)
        for tmp in (data_tmp, manifest_tmp):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            except OSError as err:
                logger.warning("could not remove the temporary file %s: %s", tmp, err)
        if isinstance(e, OSError) and not isinstance(e, SnapshotStorageError):
            raise storage_error(e, storage.url(path), None, "publishing snapshot") from e
        raise
    finally:
        storage.fs.invalidate_cache(path)
        storage.fs.invalidate_cache(mpath)
    fsync_directory(os.path.dirname(path) or ".")
    fsync_directory(os.path.dirname(mpath) or ".")
    return WriteResult(path=path, size_bytes=result.size_bytes, checksum=result.checksum)


def _commit_in_order(
    storage: Storage, path: str, mpath: str, write_data: Callable[[Any], None],
    manifest_for: Callable[[WriteResult], bytes], tag: str,
) -> WriteResult:
    """Object stores and rename-only filesystems (no two-file publish): the snapshot, then its
    manifest; a manifest that cannot be written takes the snapshot back out."""
    previous = _drop_stale_manifest(storage, mpath)
    try:
        result = storage.write(path, write_data, tag=tag)
    except BaseException:  # the previous file of this name is intact: so must be its manifest
        _restore_manifest(storage, mpath, previous, tag)
        raise
    try:
        storage.write_bytes(mpath, manifest_for(result), tag=tag)
    except BaseException as e:
        _roll_back(storage, path, e)
        raise
    return WriteResult(path=path, size_bytes=result.size_bytes, checksum=result.checksum)


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


def _roll_back(storage: Storage, path: str, error: BaseException) -> None:
    """Remove a committed data file whose manifest could not be committed."""
    try:
        storage.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.error("the manifest of %s could not be written (%s) and removing the snapshot "
                     "failed too (%s); it stays without a manifest (unverified)", path, error, e)
        return
    logger.warning("removed snapshot %s again: its manifest could not be written (%s)", path,
                   error)


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
