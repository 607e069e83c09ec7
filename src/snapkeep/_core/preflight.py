"""Checks made when training starts, so that a fault is found before the first snapshot (with an
async writer, a whole snapshot interval of training would otherwise be lost first)."""

from __future__ import annotations

import logging

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.storage import Storage

logger = logging.getLogger(__name__)

#: Base name of the probe file (a temporary name, so a crash between write and delete leaves
#: something the stale-temp sweep removes).
PROBE_NAME = "write-probe"


def check_writable(storage: Storage, directory: str) -> None:
    """Write and delete a small probe file in ``directory`` (a local path or an object-store
    prefix) through the same commit path as snapshots.

    Raises:
        SnapshotStorageError: the probe could not be written; the message names ``directory``,
            the cause and what to do. A probe that cannot be deleted again is only logged.
    """
    probe = storage.temp_name_for(storage.join(directory, PROBE_NAME), "probe")
    try:
        storage.write_bytes(probe, b"", tag="probe")
    except OSError as e:
        errno = getattr(e, "errno", None)
        raise SnapshotStorageError(
            f"out_dir {storage.url(directory)!r} is not writable ({type(e).__name__}: {e}); "
            "every snapshot would fail. Fix its permissions, free space or credentials, or pass "
            "another out_dir", errno=errno if isinstance(errno, int) else None,
            filename=storage.url(directory)) from e
    try:
        storage.remove(probe)
    except OSError as e:
        logger.warning("could not remove the write probe %s: %s", storage.url(probe), e)
