"""Temporary file names: what a writer calls a file until it commits it, and which such files
a crashed writer left behind.

A temp name carries the first bytes of the final name, this host (hashed), the writer's pid (base
36) and a per-process token, and 8 random hex digits; it is never longer than
:data:`TEMP_NAME_MAX_BYTES`. Every temp name contains :data:`TEMP_MARKER` and is never listed as a
snapshot. A temp file is abandoned when its writer, on this host, is gone (or was an earlier
process with this pid), or when it is older than :data:`STALE_TEMP_AGE_S`.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from typing import Any

from snapkeep._core.storage._paths import truncate_utf8

#: Every temporary name contains this marker; such names are never listed as snapshots.
TEMP_MARKER = ".snapkeep-tmp."
#: Temporary files whose owner cannot be checked are removed once older than this.
STALE_TEMP_AGE_S = 24 * 3600.0
#: This host, as 8 hex digits (temp names of other hosts on a shared filesystem are left alone).
_HOST = hashlib.blake2s(socket.gethostname().encode(), digest_size=4).hexdigest()
#: Random per process, in every temp name: a restarted trainer that gets the same pid on the same
#: host (pid 1 in a container) tells its predecessor's temp files from its own.
_PROCESS_TOKEN = uuid.uuid4().hex[:6]
#: Bytes of the final name kept at the front of a temp name (for people reading a listing).
TEMP_PREFIX_BYTES = 24
#: Longest temp name :func:`temp_basename` (so :meth:`~._storage.Storage.temp_name_for`) makes, in
#: bytes, whatever the final name:
#: '.' + prefix + marker + host(8) '.' pid(base 36, <= 13) '.' token(6) + random(8).
TEMP_NAME_MAX_BYTES = 1 + TEMP_PREFIX_BYTES + len(TEMP_MARKER) + 8 + 1 + 13 + 1 + 14


def is_temp_name(name: str) -> bool:
    """Whether ``name`` (a basename) is a snapkeep temporary file."""
    return TEMP_MARKER in name


def base36(n: int) -> str:
    """``n`` (>= 0) in base 36, lowercase: compact pids and times in temp and arena names."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


def temp_basename(final_name: str) -> str:
    """A fresh temporary basename for a file to be committed as ``final_name`` (a basename), at
    most :data:`TEMP_NAME_MAX_BYTES` long; :func:`_temp_owner` reads its writer back."""
    prefix = truncate_utf8(final_name, TEMP_PREFIX_BYTES)
    return (f".{prefix}{TEMP_MARKER}{_HOST}.{base36(os.getpid())}.{_PROCESS_TOKEN}"
            f"{uuid.uuid4().hex[:8]}")


def _temp_owner(name: str) -> tuple[str, int, str] | None:
    """``(host, pid, token+random)`` of a temp name (this version's or the older long form)."""
    fields = name.rsplit(TEMP_MARKER, 1)[1].split(".")
    if len(fields) == 3 and len(fields[0]) == 8:  # host(8 hex).pid(base 36).token
        try:
            return fields[0], int(fields[1], 36), fields[2]
        except ValueError:
            return None
    if len(fields) >= 4 and fields[-2].isdigit():  # older: tag.host.pid(decimal).token
        return fields[-3], int(fields[-2]), fields[-1]
    return None


def temp_is_abandoned(name: str, entry: dict[str, Any]) -> bool:
    owner = _temp_owner(name)
    if owner is not None:
        host, pid, token = owner
        if host == _HOST:
            if pid == os.getpid():  # ours, or a predecessor's with the same pid
                return not token.startswith(_PROCESS_TOKEN)
            return not pid_alive(pid)
    mtime: Any = entry.get("mtime") or entry.get("LastModified") or entry.get("created")
    if callable(getattr(mtime, "timestamp", None)):
        mtime = mtime.timestamp()
    if isinstance(mtime, (int, float)):
        return time.time() - float(mtime) > STALE_TEMP_AGE_S
    return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` may still run: this process, one that exists (a zombie does
    not count: it can do nothing more), or one we may not signal (another user's)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but is not reaped yet (Linux ``/proc``; False elsewhere): it
    can write nothing more, whoever its parent is."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return False
    return stat_line[stat_line.rfind(b")") + 2:][:1] in (b"Z", b"X")
