"""A verified load in one pass over the file: hash the mapped pages the load will use.

A local ``torch.save`` (zip) file is opened with ``torch.load(mmap=True)`` (its tensors are
copy-on-write views of one private mapping of the file, as PyTorch's own fastest load), then
hashed once, front to back, with the same streaming XXH3 as the manifest's checksum: each
tensor record straight from the mapped pages its tensors view (hashing faults them in from the
page cache: no copy, no second read), the small records between them (``data.pkl``, headers,
the central directory) through the file. The kernel reads ahead of the pass
(``posix_fadvise`` ``SEQUENTIAL`` + ``WILLNEED``, 64 MiB ahead), so a cold file streams at
the disk's speed. The checksum verdict comes at the end of the pass; only then is the state
handed back. What the pass adds to ``torch.load(mmap=True)`` + ``load_state_dict`` is the hash
itself (XXH3 at ~6-8 GiB/s on one core): every page it touches is one the load would touch
anyway (a parameter's copy reads it, an optimizer's first ``step()`` writes it).

All-or-nothing: nothing of the trainer's tensors is touched here. A file whose size or checksum
differs raises :class:`SnapshotCorruptError` and its mapping is dropped, so a corrupt snapshot
leaves the model and optimizer exactly as they were (the caller then falls back to an older
snapshot). After the verdict, ``load_state_dict`` copies parameters into the existing ones
(from the pages just hashed), and a fresh optimizer adopts its state tensors as they are:
mapped file pages, copied by the kernel into memory of the process when the first ``step()``
writes them (the cost of fresh memory is paid there, once, as with ``torch.load(mmap=True)``;
state moved to an accelerator is copied there and the mapping dropped). Until then the
process maps the file: snapkeep only ever replaces or unlinks a committed file (never writes
it in place or truncates it), and an unlinked file's blocks are freed when the mapping goes.
The earlier paths walked every byte twice (hash through one mapping, then load through a
second) or copied it into newly allocated storages (faulting in fresh memory for the whole
state before training starts: 1.2 s/GiB on the benchmarks' VM, ``benchmarks/README.md``).

Which bytes belong to which tensor comes from torch itself: the file is first opened with
``torch.load(mmap=True)`` under the caller's ``weights_only`` rules (unpickling only
``data.pkl``; no tensor page is read), whose storages are slices of one mapping of the file at
each record's data offset. The offsets are read from each record's local zip header as the pass
reaches it; a storage that matches no record (size and offset) makes :func:`load_verified`
return ``None`` (the caller falls back to verifying and loading separately). Files that are not
zip ``torch.save`` files (torch's legacy format, safetensors) also return ``None``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import struct
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from snapkeep._core.format.checksum import require_match
from snapkeep._core.storage import new_hasher

logger = logging.getLogger(__name__)

#: Bytes read (and hashed while in the cache) per ``readinto``.
READ_CHUNK_BYTES = 4 << 20
#: How far ahead of the read position the kernel is asked to read from disk.
READ_AHEAD_BYTES = 64 << 20

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # the zip local file header (30 bytes)
_LOCAL_MAGIC = b"PK\x03\x04"
_DATA_RECORD = re.compile(r"^[^/]+/data/[^/]+$")


class _Layout(Exception):
    """The file's layout is not what this pass handles (the caller falls back)."""


def load_verified(path: str, *, checksum: str, size_bytes: int, algorithm: str,
                  weights_only: bool = True, map_location: Any = "cpu") -> Any | None:
    """Load the local ``torch.save`` file ``path`` and verify it against its manifest in one
    read (see the module docstring).

    Args:
        path: a local file.
        checksum: the manifest's hex digest; size_bytes: its recorded size in bytes;
            algorithm: its algorithm name (for the error message; the hash is XXH3-128, as
            :mod:`snapkeep._core.format.checksum`).
        weights_only: as ``torch.load`` (True refuses arbitrary pickled objects).
        map_location: only ``'cpu'``/``None``/CPU devices take this path.

    Returns:
        The loaded object, its tensors on new CPU storages of their own; ``None`` when this
        file cannot take the one-pass path (not a zip ``torch.save`` file, another
        ``map_location``, an unexpected record layout): verify and load it separately then.

    Raises:
        SnapshotCorruptError: size or checksum differs from the manifest (nothing of the file
            is returned).
        pickle.UnpicklingError: ``weights_only`` refused an object (nothing was executed).
        OSError: the file cannot be read.
    """
    if map_location not in (None, "cpu") and map_location != torch.device("cpu"):
        return None
    with open(path, "rb", buffering=0) as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size_bytes:  # truncated or overwritten: no need to read it
            require_match(path, "", actual, recorded_checksum=checksum,
                          recorded_size=size_bytes, algorithm=algorithm)
        try:
            records = sorted(zipfile.ZipFile(f).infolist(), key=lambda r: r.header_offset)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            return None  # legacy torch format or safetensors: verified and loaded separately
        if any(r.compress_type != zipfile.ZIP_STORED for r in records):
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except Exception as e:  # noqa: BLE001 -- unverified bytes: the separate path decides
            # (it verifies first: a corrupt pickle is reported as corrupt, not as unsafe)
            logger.debug("%s: one-pass load not possible (%s: %s)", path, type(e).__name__, e)
            return None
        f.seek(0)
        tensors = list(_tensors(state))
        try:
            digest, read = _hash_in_place(f, path, records, tensors)
        except _Layout as e:
            logger.debug("%s: one-pass load not possible (%s)", path, e)
            return None
    require_match(path, digest, read, recorded_checksum=checksum, recorded_size=size_bytes,
                  algorithm=algorithm)
    return state


def _hash_in_place(f: Any, path: str, records: list[zipfile.ZipInfo],
                   tensors: list[torch.Tensor]) -> tuple[str, int]:
    """Hash the file front to back once, every byte in order: the small records (``data.pkl``,
    headers, the central directory) read from ``f``, each tensor record straight from the
    mapped pages that ``tensors`` view (hashing faults them in; nothing is copied). Returns
    ``(hexdigest, bytes hashed)``."""
    mapped: dict[int, torch.UntypedStorage] = {}  # data_ptr -> the mapped slice of the file
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            mapped[storage.data_ptr()] = storage
    base: int | None = None  # the address at which the file is mapped
    fd = f.fileno()
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    reader = _Reader(f, fd, new_hasher(), bytearray(READ_CHUNK_BYTES))
    for record in records:
        reader.skip_to(record.header_offset)
        header = reader.read_small(_LOCAL_HEADER.size)
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _LOCAL_MAGIC:
            raise _Layout(f"no local header for {record.filename!r}")
        reader.read_small(fields[10] + fields[11])  # its name and extra field (padding)
        data_start = reader.pos
        nbytes = record.compress_size
        if not (_DATA_RECORD.match(record.filename) and nbytes and mapped):
            continue  # data.pkl, version records...: hashed as the pass reaches them
        if base is None:  # the first tensor record is the lowest mapped address
            base = min(mapped) - data_start
        source = mapped.pop(base + data_start, None)
        if source is None or source.nbytes() != nbytes:
            raise _Layout(f"record {record.filename!r} matches no loaded storage")
        reader.hash_mapped(source.data_ptr(), nbytes)
    reader.skip_to(None)
    if mapped:
        raise _Layout(f"{len(mapped)} loaded storage(s) match no record")
    return str(reader.hasher.hexdigest()), reader.pos


class _Reader:
    """One sequential pass over a file, each byte hashed once, in order: read from the file,
    or hashed where it is mapped (:meth:`hash_mapped`); the kernel reads ahead of the pass."""

    def __init__(self, f: Any, fd: int, hasher: Any, scratch: bytearray) -> None:
        self._f = f
        self._fd = fd
        self.hasher = hasher
        self._scratch = memoryview(scratch)
        self.pos = 0
        self._ahead = 0  # bytes already requested from disk

    def _advance(self, n: int) -> None:
        self.pos += n
        if self.pos + READ_AHEAD_BYTES // 2 > self._ahead and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, self._ahead, READ_AHEAD_BYTES, os.POSIX_FADV_WILLNEED)
            self._ahead += READ_AHEAD_BYTES

    def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self._f.readinto(view[got:])
            if not n:
                raise _Layout(f"file ended at byte {self.pos + got}")
            got += n
        self.hasher.update(view)
        self._advance(len(view))

    def read_small(self, n: int) -> bytes:
        view = self._scratch[:n] if n <= len(self._scratch) else memoryview(bytearray(n))
        self._fill(view)
        return bytes(view)

    def hash_mapped(self, address: int, nbytes: int) -> None:
        """Hash ``nbytes`` at ``address`` (the mapping of the file at the current position) in
        place, then move the file position past them."""
        for off in range(0, nbytes, READ_CHUNK_BYTES):
            n = min(READ_CHUNK_BYTES, nbytes - off)
            view = memoryview((ctypes.c_char * n).from_address(address + off)).cast("B")
            self.hasher.update(view)
            self._advance(n)
        self._f.seek(self.pos)

    def skip_to(self, offset: int | None) -> None:
        """Read (and hash) up to ``offset``, or to the end of the file when None."""
        while offset is None or self.pos < offset:
            want = len(self._scratch) if offset is None \
                else min(len(self._scratch), offset - self.pos)
            n = self._f.readinto(self._scratch[:want])
            if not n:
                if offset is None:
                    return
                raise _Layout(f"file ended at byte {self.pos}")
            self.hasher.update(self._scratch[:n])
            self._advance(n)


def _tensors(node: Any) -> Any:
    """Every tensor of a loaded tree (dicts, lists, tuples), each once."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in seen:
                seen.add(id(item))
                yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def one_pass_loader(
    store: Any, loader: Callable[[Any, bytes | None], Any], check: Callable[[Any, Any], Any],
    *, weights_only: bool = True, map_location: Any = "cpu",
) -> Callable[[Any, Any], Any]:
    """The ``one_pass`` argument of :meth:`SnapshotStore.load_newest
    <snapkeep._core.store.files.SnapshotStore.load_newest>` for a local store.

    Args:
        store: the :class:`~snapkeep._core.store.files.SnapshotStore`.
        loader: ``loader(entry, None) -> state``, used after a separate ``store.verify`` for
            files the one-pass path does not take (no manifest, safetensors, torch's legacy
            format, another ``map_location``).
        check: ``check(entry, state) -> state`` run on a state loaded in one pass (the
            ``loader`` runs its own); raises ``SnapshotCorruptError`` to skip the snapshot.
        weights_only, map_location: as :func:`load_verified`.
    """

    def load(entry: Any, manifest: Any) -> Any:
        state = None
        if manifest is not None:
            state = load_verified(entry.path, checksum=manifest.checksum,
                                  size_bytes=manifest.size_bytes, algorithm=manifest.algorithm,
                                  weights_only=weights_only, map_location=map_location)
        if state is None:  # (an incremental snapshot: loading verifies each blob it reads)
            store.verify(entry, references=False)
            return loader(entry, None)
        return check(entry, state)

    return load
