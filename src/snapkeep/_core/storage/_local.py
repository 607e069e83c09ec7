"""Local-filesystem operations that a power loss or a FIFO cannot defeat: a read that never
blocks on a non-regular file, and a ``makedirs`` whose new directories are durable."""

from __future__ import annotations

import errno as errno_mod
import os
import stat


def makedirs_durably(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, with an ``fsync`` of the parent of every directory
    it creates (POSIX makes a new directory entry durable only then)."""
    from snapkeep._core.storage._commit import fsync_directory

    missing = []
    probe = os.path.abspath(path)
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue  # another process made it (and synced its parent)
        fsync_directory(os.path.dirname(directory))


def open_regular(path: str) -> int:
    """Open a local file for reading and return its descriptor, only if it is a regular file.

    The open never blocks (``O_NONBLOCK``, cleared once the file is known to be regular), so a
    FIFO, or a symlink to one, is refused at once instead of waiting for a writer.

    Raises:
        FileNotFoundError: no such file.
        OSError: ``EINVAL`` for a FIFO, device, socket or directory (the path named).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise OSError(errno_mod.EINVAL, f"{path} is {kind}, not a regular file; refused")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
