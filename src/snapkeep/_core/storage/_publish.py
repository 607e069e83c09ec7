"""Publishing a file and its companion (a snapshot and its manifest) as one unit.

The one publish step of snapkeep: everything above storage hands it the data writer and a
function that makes the companion's bytes from what was written; nothing above storage renames,
fsyncs or calls fsspec.

- Replace+fsync storages (local files, :class:`~._commit.ReplaceCommit`): the data temp and the
  companion temp are each written, flushed and fsynced; then the old companion of the name is
  removed, both temps are renamed into place (``os.replace``) and the directories fsynced. A
  failure before the renames (disk full on the companion) leaves nothing new visible and the
  previous file of the name intact.
- Every other storage (one complete PUT per object, rename-only filesystems): the data is
  committed by the strategy, then the companion; a companion that cannot be written takes the
  data back out.

Either way a file never stays published without its companion because of a failed write; a kill
between the two publishing steps can leave one (a snapshot then loads as unverified).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.storage._commit import (
    ReplaceCommit,
    Target,
    WriteFn,
    WriteResult,
    check_publish,
    fsync_directory,
    storage_error,
    unlink_quietly,
)

if TYPE_CHECKING:
    from snapkeep._core.storage._storage import Storage

logger = logging.getLogger(__name__)

#: Makes the companion's bytes (a manifest) from the committed data's size and checksum.
CompanionFn = Callable[[WriteResult], bytes]


def publish_pair(
    storage: Storage, path: str, companion: str, write_data: WriteFn,
    companion_for: CompanionFn, *, tag: str, companion_max_bytes: int,
) -> WriteResult:
    """Publish ``path`` (written by ``write_data``) and ``companion`` (``companion_for`` of the
    result) as one unit (see the module docstring for the order per storage).

    Args:
        storage: where both go.
        path: final path of the data file.
        companion: final path of its companion (manifest); an existing one is removed before
            the data is replaced and put back if the save fails.
        write_data: writes the data to a write-only binary file (must not seek).
        companion_for: the companion's bytes, from the data's :class:`WriteResult`.
        tag: short string unique to the writer (kept for temp naming compatibility).
        companion_max_bytes: an existing companion larger than this is not read back.

    Returns:
        The data file's :class:`WriteResult` (final ``path``, bytes, XXH3-128 checksum).

    Raises:
        SnapshotStorageError: an OS/storage fault (file, bytes and errno named); nothing new is
            left under ``path``, ``companion`` or a temporary name.
        Exception: whatever ``write_data`` or ``companion_for`` raised, after the same clean-up.
    """
    if isinstance(storage.strategy, ReplaceCommit):
        return _publish_replace(storage, path, companion, write_data, companion_for, tag,
                                companion_max_bytes)
    return _publish_in_order(storage, path, companion, write_data, companion_for, tag,
                             companion_max_bytes)


def _publish_replace(
    storage: Storage, path: str, companion: str, write_data: WriteFn,
    companion_for: CompanionFn, tag: str, companion_max_bytes: int,
) -> WriteResult:
    data_tmp = storage.temp_name_for(path, tag)
    companion_tmp = storage.temp_name_for(companion, tag)
    strategy = storage.strategy
    published = False
    companion_bytes = b""

    def write_companion(f: Any) -> None:
        f.write(companion_bytes)

    try:
        # a target whose final name is its temp name: written, flushed, fsynced, not published
        result = strategy.write(storage.fs, Target(
            path=data_tmp, temp_path=data_tmp, url=storage.url(path)), write_data)
        companion_bytes = companion_for(result)
        strategy.write(storage.fs, Target(
            path=companion_tmp, temp_path=companion_tmp, url=storage.url(companion)),
            write_companion)
        check_publish()
        # both are durable: publish. The old companion of the name goes first, so that no crash
        # leaves it describing the new file (in between, the old file loads as unverified)
        previous = _drop_stale(storage, companion, companion_max_bytes)
        try:
            os.replace(data_tmp, path)
        except BaseException:
            _restore(storage, companion, previous, tag)
            raise
        published = True
        os.replace(companion_tmp, companion)
    except BaseException as e:
        if published:  # the companion could not follow its file: take the file back
            _roll_back(storage, path, e)
        for tmp in (data_tmp, companion_tmp):
            unlink_quietly(tmp)
        if isinstance(e, OSError) and not isinstance(e, SnapshotStorageError):
            raise storage_error(e, storage.url(path), None, "publishing snapshot") from e
        raise
    finally:
        storage.fs.invalidate_cache(path)
        storage.fs.invalidate_cache(companion)
    fsync_directory(os.path.dirname(path) or ".")
    fsync_directory(os.path.dirname(companion) or ".")
    return WriteResult(path=path, size_bytes=result.size_bytes, checksum=result.checksum)


def _publish_in_order(
    storage: Storage, path: str, companion: str, write_data: WriteFn,
    companion_for: CompanionFn, tag: str, companion_max_bytes: int,
) -> WriteResult:
    previous = _drop_stale(storage, companion, companion_max_bytes)
    try:
        result = storage.write(path, write_data, tag=tag)  # object stores: one complete PUT
    except BaseException:  # the previous file of this name is intact: so must be its companion
        _restore(storage, companion, previous, tag)
        raise
    try:
        storage.write_bytes(companion, companion_for(result), tag=tag)
    except BaseException as e:
        _roll_back(storage, path, e)
        raise
    return WriteResult(path=path, size_bytes=result.size_bytes, checksum=result.checksum)


def _roll_back(storage: Storage, path: str, error: BaseException) -> None:
    """Remove a published data file whose companion could not be published."""
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


def _drop_stale(storage: Storage, companion: str, max_bytes: int) -> bytes | None:
    """Remove the companion of a file about to be overwritten (same name saved again); return
    its bytes (None when there was none) so that a failed save can put it back.

    Otherwise a crash between the new file's commit and its companion's would leave the old
    manifest describing the new file, and a good snapshot would fail verification. Without a
    manifest the file (old or new, each complete) loads as unverified instead.
    """
    try:
        previous = storage.read_bytes(companion, max_bytes=max_bytes)  # a FIFO never blocks
    except FileNotFoundError:
        return None
    try:
        storage.remove(companion)
    except FileNotFoundError:
        return None
    except OSError as e:  # the save itself can still succeed; only the crash window stays open
        logger.warning("could not remove the stale manifest %s before overwriting its snapshot: "
                       "%s", companion, e)
        return None
    return previous


def _restore(storage: Storage, companion: str, data: bytes | None, tag: str) -> None:
    """Put back the companion removed by :func:`_drop_stale` after a failed save."""
    if data is None:
        return
    try:
        storage.write_bytes(companion, data, tag=tag)
    except Exception as e:  # the save's own error is what the caller must see
        logger.warning("could not restore the manifest %s after a failed save; its snapshot "
                       "now loads as unverified: %s", companion, e)


def publish_by_content(storage: Storage, directory: str, write_data: WriteFn, *,
                       tag: str, expect: str | None = None) -> WriteResult:
    """Publish a file in ``directory`` named by the XXH3-128 digest of its own bytes (a blob of
    an incremental snapshot), written by ``write_data``.

    Replace+fsync storages: written, flushed and fsynced under a temporary name while hashed
    (one pass), then renamed to ``directory/<digest>``; a file already there has the same bytes
    (it is replaced by an identical one). The directory is not fsynced here: the caller syncs it
    once after its last blob (``Storage.sync_directory``). Elsewhere the name must be known
    before the one PUT: the bytes are hashed first (``write_data`` runs twice).

    ``expect``: the digest the bytes must have (known beforehand); when they hash to another,
    nothing is published and ``ValueError`` is raised (they changed while being written).

    Raises:
        SnapshotStorageError: an OS/storage fault; nothing new is left in ``directory``.
        ValueError: ``expect`` given and not the bytes' digest.
        Exception: whatever ``write_data`` raised, after the same clean-up.
    """
    if isinstance(storage.strategy, ReplaceCommit):
        tmp = storage.temp_name_for(storage.join(directory, "blob"), tag)
        result = storage.strategy.write_temp(Target(
            path=tmp, temp_path=tmp, url=storage.url(tmp)), write_data)
        final = storage.join(directory, result.checksum)
        try:
            if expect is not None and result.checksum != expect:
                raise ValueError(f"{storage.url(final)}: the bytes written hash to "
                                 f"{result.checksum}, not {expect} (changed while written)")
            check_publish()
            os.replace(tmp, final)
        except BaseException as e:
            unlink_quietly(tmp)
            if isinstance(e, OSError) and not isinstance(e, SnapshotStorageError):
                raise storage_error(e, storage.url(final), None, "publishing blob") from e
            raise
        finally:
            storage.fs.invalidate_cache(final)
        return WriteResult(path=final, size_bytes=result.size_bytes, checksum=result.checksum)
    from snapkeep._core.storage._hashing import HashingWriter

    digest = expect
    if digest is None:
        hashing = HashingWriter(_Discard())  # type: ignore[arg-type]
        write_data(hashing)  # type: ignore[arg-type]
        digest = hashing.hexdigest()
    result = storage.write(storage.join(directory, digest), write_data, tag=tag)
    if result.checksum != digest:
        storage.remove(result.path)
        raise ValueError(f"{storage.url(result.path)}: the bytes written hash to "
                         f"{result.checksum}, not {digest} (changed while written); removed")
    return result


class _Discard:
    """A write-only sink that keeps nothing (the hashing pass of :func:`publish_by_content`)."""

    def write(self, data: Any) -> int:
        return len(memoryview(data))

    def flush(self) -> None:
        pass
