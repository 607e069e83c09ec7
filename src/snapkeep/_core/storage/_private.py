"""Directories private to this user on a shared tmpfs (the memory tier's ``/dev/shm``).

A tmpfs root such as ``/dev/shm`` is writable by every local user, so anything under it may
have been planted: a symlink named as our directory, a directory of another user, a FIFO in
place of a record. The rules here make a tree under such a root private:

- the root must not let other users rename or delete what is ours: writable by others only
  with the sticky bit (``/dev/shm``, ``/tmp``), owned by us or by root (:func:`check_root`);
- every component under the root is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to its
  parent's descriptor (``openat``) and checked with ``fstat`` on that descriptor: a directory
  owned by this effective uid, else refused (:class:`NotPrivateError`); ours with a wider mode
  is narrowed to ``0700``; a new one is made ``0700``;
- a file is read the same way (``O_NOFOLLOW | O_NONBLOCK``), only when it is a regular file we
  own, at most ``max_bytes`` (:func:`read_private`);
- a tree is removed only once its top is checked as ours (:func:`remove_private`);
  ``shutil.rmtree`` then walks it by descriptors and follows no symlink.

Once a directory is checked as ours, ``0700``, under a root where no one else can rename it,
nothing under it can be changed by another (non-root) user: paths through it are then safe to
hand to :class:`~._storage.Storage` (whose commits create files ``0600``, see
:func:`private_storage`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator, Sequence

from fsspec.implementations.local import LocalFileSystem

from snapkeep._core.storage._commit import ReplaceCommit
from snapkeep._core.storage._storage import Storage

_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))
_FILE_FLAGS = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))


class NotPrivateError(PermissionError):
    """A path under a shared root is not this user's private directory or file: a symlink,
    another type, or owned by another uid. Nothing was read, written or removed through it."""


def _kind(mode: int) -> str:
    return ("a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a regular file" if stat.S_ISREG(mode) else "not a regular file")


def check_root(root: str) -> None:
    """Refuse a root where another user could rename or delete our directories: one writable by
    group or others without the sticky bit, or owned by another user than us or root.

    Raises:
        NotPrivateError: naming the root, its mode and owner.
        FileNotFoundError: it does not exist.
    """
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivateError(errno.ENOTDIR, f"{root} is {_kind(st.st_mode)}, not a directory")
    me = os.geteuid()
    shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid not in (me, 0) or (shared and not st.st_mode & stat.S_ISVTX):
        raise NotPrivateError(
            errno.EPERM, f"{root} (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}) lets "
            "other users rename or delete what is in it: a root for private directories must "
            "be ours or root's, and writable by others only with the sticky bit (as /dev/shm)")


def _check(fd: int, where: str, *, directory: bool) -> None:
    st = os.fstat(fd)
    wanted = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not wanted:
        raise NotPrivateError(errno.EPERM, f"{where} is {_kind(st.st_mode)}; refused")
    if st.st_uid != os.geteuid():
        raise NotPrivateError(
            errno.EPERM, f"{where} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); never read, written or removed")
    if directory and stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)  # ours, left wider by an older snapkeep or a umask: narrowed


def _open_child(parent_fd: int, name: str, where: str, *, create: bool) -> int:
    if not name or name in (".", "..") or "/" in name:
        raise ValueError(f"{name!r} is not a plain directory name")
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass  # made meanwhile (another rank of this job, or planted): checked below
        fd = _reopen(parent_fd, name, where)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotPrivateError(errno.EPERM, f"{where} is {_lkind(parent_fd, name)}, not a "
                                  "directory of ours; refused (never followed)") from e
        raise
    try:
        _check(fd, where, directory=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reopen(parent_fd: int, name: str, where: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotPrivateError(errno.EPERM, f"{where} is {_lkind(parent_fd, name)}, not a "
                                  "directory of ours; refused (never followed)") from e
        raise


def _lkind(parent_fd: int, name: str) -> str:
    try:
        return _kind(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
    except OSError:
        return "gone"


@contextlib.contextmanager
def private_dir(root: str, parts: Sequence[str], *, create: bool = False) -> Iterator[int]:
    """A descriptor of ``root/parts[0]/parts[1]/...``, each component checked (see the module
    docstring; the root itself with :func:`check_root`); closed on exit.

    Args:
        root: the shared root (a local directory).
        parts: plain directory names under it (none: the root's own descriptor).
        create: make missing components (``0700``), and the root when missing (as
            ``os.makedirs``); else a missing one raises.

    Raises:
        NotPrivateError: a component is a symlink, not a directory, or another user's.
        FileNotFoundError: a component is missing (``create`` False).
    """
    if create:
        os.makedirs(root, exist_ok=True)
    check_root(root)
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        where = root
        for name in parts:
            where = os.path.join(where, name)
            child = _open_child(fd, name, where, create=create)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def read_private(dir_fd: int, name: str, *, max_bytes: int, where: str) -> bytes:
    """The bytes of the file ``name`` in the checked directory ``dir_fd``: opened without
    following a symlink and without blocking, only when it is a regular file of ours, at most
    ``max_bytes``.

    Raises:
        NotPrivateError: a symlink, FIFO, device, directory, or another user's file.
        OSError: ``EFBIG`` when larger than ``max_bytes``; ``ENOENT`` when gone.
    """
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotPrivateError(errno.EPERM, f"{where} is a symlink; refused (never "
                                  "followed)") from e
        raise
    with os.fdopen(fd, "rb") as f:
        _check(fd, where, directory=False)
        os.set_blocking(fd, True)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"{where} is larger than the {max_bytes}-byte limit")
    return data


def list_private(dir_fd: int) -> list[str]:
    """The names in the checked directory ``dir_fd``, sorted."""
    return sorted(os.listdir(dir_fd))


def lstat_private(dir_fd: int, name: str, where: str, *, directory: bool) -> os.stat_result:
    """``lstat`` of ``name`` in ``dir_fd``, which must be a directory (``directory``) or a
    regular file of ours.

    Raises:
        NotPrivateError: otherwise (a symlink included).
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    wanted = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not wanted:
        raise NotPrivateError(errno.EPERM, f"{where} is {_kind(st.st_mode)}; refused")
    if st.st_uid != os.geteuid():
        raise NotPrivateError(errno.EPERM, f"{where} is owned by uid {st.st_uid}, not by this "
                              f"user (uid {os.geteuid()}); never read, written or removed")
    return st


def remove_private(root: str, parts: Sequence[str]) -> None:
    """Remove the tree ``root/parts...`` once every component is checked as ours (see
    :func:`private_dir`); a missing one is not an error. ``shutil.rmtree`` then removes it
    through descriptors, following no symlink inside.

    Raises:
        NotPrivateError: a component is not ours (nothing removed).
        OSError: the removal failed.
    """
    if not parts:
        raise ValueError("remove_private needs at least one component under the root")
    try:
        with private_dir(root, parts[:-1]) as parent:
            where = os.path.join(root, *parts)
            try:
                lstat_private(parent, parts[-1], where, directory=True)
            except FileNotFoundError:
                return
            # the checked directory cannot be swapped: the root is sticky or ours, and every
            # parent under it is ours and 0700
            shutil.rmtree(where)
    except FileNotFoundError:
        return


def remove_private_file(dir_fd: int, name: str) -> None:
    """Unlink ``name`` in the checked directory ``dir_fd`` (a missing one is not an error)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def private_storage() -> Storage:
    """A local :class:`Storage` whose commits create their files ``0600`` (owner only), for
    paths under a directory checked by :func:`private_dir`."""
    return Storage(LocalFileSystem(), ReplaceCommit(file_mode=0o600))


__all__ = ["NotPrivateError", "check_root", "list_private", "lstat_private", "private_dir",
           "private_storage", "read_private", "remove_private", "remove_private_file"]
