"""Which backend: from ``out_dir`` (a local path or an fsspec URL) and an optional ``fs`` to one
:class:`~._storage.Storage` (a missing backend package is named in the error), and the commit
strategy each filesystem gets (see :mod:`._commit`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from snapkeep._core.storage._commit import CommitStrategy, RenameCommit, ReplaceCommit
from snapkeep._core.storage._pfio import PfioFileSystem
from snapkeep._core.storage._put import ObjectPutCommit

if TYPE_CHECKING:
    from snapkeep._core.storage._storage import Storage

#: Protocols whose files honour ``autocommit=False`` (an upload that becomes visible only when
#: committed); objects past the spill threshold stream through it.
DEFERRED_UPLOAD_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})
#: Smallest spill threshold: S3's minimum multipart part size.
MIN_SPILL_BYTES = 5 << 20


def commit_strategy_for(fs: Any) -> CommitStrategy:
    """The commit strategy for ``fs`` (see :mod:`._commit`)."""
    if isinstance(fs, LocalFileSystem):
        return ReplaceCommit()
    if isinstance(fs, PfioFileSystem):
        return RenameCommit()
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & DEFERRED_UPLOAD_PROTOCOLS:
        block = getattr(fs, "default_block_size", None) or getattr(fs, "blocksize", 0)
        return ObjectPutCommit(spill_bytes=max(int(block or 0), MIN_SPILL_BYTES))
    # memory:// (whose pipe_file is one dict assignment) and backends snapkeep does not know:
    # buffer the complete file and publish it with one pipe_file call.
    return ObjectPutCommit(spill_bytes=None)


#: pip package providing each protocol, where fsspec's own registry does not say it plainly.
_PROTOCOL_PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "abfss": "adlfs",
    "az": "adlfs", "adl": "adlfs", "hdfs": "pyarrow", "sftp": "paramiko", "ssh": "paramiko",
    "http": "aiohttp", "https": "aiohttp", "oci": "ocifs", "webdav": "webdav4",
}


def _install_hint(protocol: str) -> str:
    package = _PROTOCOL_PACKAGES.get(protocol)
    if package is None:
        from fsspec.registry import known_implementations

        known = known_implementations.get(protocol)
        if known is not None:
            module = str(known.get("class", "")).split(".")[0]
            if module and module != "fsspec":
                package = module
            elif known.get("err"):
                return str(known["err"])
    if package is None:
        return ("no installed package provides it; see fsspec's list of known implementations, "
                "or pass fs= an fsspec filesystem")
    extra = " (or snapkeep[s3])" if package == "s3fs" else ""
    return f"pip install {package}{extra}"


def resolve_storage(
    out_dir: str, fs: Any = None, storage_options: dict[str, Any] | None = None
) -> tuple[Storage, str]:
    """Turn ``out_dir`` (+ optional ``fs``) into ``(Storage, path on that storage)``.

    Args:
        out_dir: a local path, or an fsspec URL such as ``'s3://bucket/run'``, ``'memory://x'``
            or ``'file:///abs/dir'``.
        fs: an fsspec filesystem, or a ppe/pfio-style object (``open``, ``list``, ``stat``,
            ``exists``, ``makedirs``, ``rename``, ``remove``) as accepted by ppe writers; None
            picks by URL.
        storage_options: keyword arguments for the fsspec filesystem chosen by URL (endpoint,
            credentials); they are never logged or put in messages.

    Raises:
        ValueError: the URL's protocol is unknown or its package is missing (the message names
            the package to install), or ``storage_options`` is given together with ``fs``.
        TypeError: ``fs`` is neither an fsspec filesystem nor a pfio-style object.
    """
    from snapkeep._core.storage._storage import Storage  # it builds on this module

    out_dir = os.fspath(out_dir)
    if fs is not None:
        if storage_options:
            raise ValueError(
                "storage_options only apply when snapkeep creates the filesystem from out_dir; "
                "with fs= given, configure that filesystem instead")
        if isinstance(fs, fsspec.AbstractFileSystem):
            return Storage(fs), fs._strip_protocol(out_dir) if "://" in out_dir else out_dir
        return Storage(PfioFileSystem(fs)), out_dir  # TypeError names missing methods
    if "://" not in out_dir:
        return Storage(fsspec.filesystem("file")), out_dir
    protocol = out_dir.split("://", 1)[0]
    try:
        filesystem, path = fsspec.core.url_to_fs(out_dir, **(storage_options or {}))
    except ImportError as e:
        raise ValueError(
            f"out_dir {out_dir!r} needs the fsspec backend for protocol {protocol!r}, which is "
            f"not installed ({e}): {_install_hint(protocol)}") from e
    except ValueError as e:
        if "protocol" not in str(e).lower():
            raise
        raise ValueError(
            f"out_dir {out_dir!r} uses protocol {protocol!r}, which fsspec does not know "
            f"({e}); {_install_hint(protocol)}. Use a local path or a URL such as "
            "'s3://bucket/run', 'gs://bucket/run', 'memory://run' or 'file:///abs/dir'") from e
    return Storage(filesystem), path
