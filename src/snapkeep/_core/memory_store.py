"""The node-memory store kind: one rank's snapshots (and the peer copies it holds) in a tmpfs
directory that outlives the process.

Layout, under ``root`` (default ``/dev/shm``)::

    <root>/snapkeep-<job>/owner-rank<R>.json        who wrote this rank's tier (pid, host, time)
    <root>/snapkeep-<job>/rank<R>/ram_iter_<N>       rank R's own state at step N (+ .snapkeep/)
    <root>/snapkeep-<job>/rank<R>/peer<S>/ram_iter_<N>  rank S's state, held by rank R

Each directory is a :class:`MemoryStore`: a :class:`~snapkeep._core.store.SnapshotStore` on the
local filesystem (the same atomic commit -- temp, fsync, rename -- and XXH3 manifest as snapshot
files), so it implements :class:`~snapkeep._core.store_kinds.StoreKind` and runs through the
store contract. What differs is only where it lives and its retention
(:meth:`MemoryStore.keep_newest` keeps the newest committed step alone; RAM is bounded: own
copy + replicas + one in flight).

The job id (:func:`job_id`) is ``TORCHELASTIC_RUN_ID`` under torchrun, else a hash of the output
directory and filename template, so a restarted process of the same job finds its tier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import mmap
import os
import shutil
import socket
import time
from collections.abc import Callable
from typing import IO, Any

from snapkeep._core.checksum import (
    ALGORITHM,
    MAPPED_CHUNK_BYTES,
    digest_file,
    digest_stream,
    new_hasher,
    require_match,
)
from snapkeep._core.errors import (
    MemoryTierTooSmallError,
    SnapshotCorruptError,
)
from snapkeep._core.job import SaveJob
from snapkeep._core.loading import load_file
from snapkeep._core.storage import resolve_storage
from snapkeep._core.store import Entry, SnapshotStore
from snapkeep._core.store_kinds import newest_valid

logger = logging.getLogger(__name__)

TEMPLATE = "ram_iter_{.iteration}"
"""Filename template of the snapshots in a memory store (parsed for the step)."""
PREFIX = "snapkeep-"
"""Every tier directory under the root starts with this (``snapkeep ls --memory`` lists them)."""


def job_id(out_dir: str, template: str) -> str:
    """The id naming a job's tier: ``TORCHELASTIC_RUN_ID`` when torchrun set it (and not its
    default ``'none'``), else the first 16 hex digits of SHA-256 over ``out_dir`` and
    ``template`` (the same for every restart of the same training)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
        return safe[:64]
    key = f"{os.path.abspath(out_dir) if '://' not in out_dir else out_dir}\0{template}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def tier_dir(root: str, job: str) -> str:
    """The directory of one job's tier under ``root``."""
    return os.path.join(root, PREFIX + job)


@dataclasses.dataclass(frozen=True)
class Held:
    """One verified snapshot in a memory store.

    Attributes:
        step: its step (iteration).
        path: its file.
        checksum: XXH3-128 hex digest recorded in its manifest (and re-measured).
        size_bytes: its size.
    """

    step: int
    path: str
    checksum: str
    size_bytes: int


class MemoryStore(SnapshotStore):
    """The snapshots of one rank (``source`` None) or of one peer ``source`` held by ``rank``,
    in node memory (see the module docstring).

    Args:
        root: the tmpfs root (a local directory).
        job: the job id (:func:`job_id`).
        rank: the rank whose node holds this store.
        source: the rank whose state it holds (None: ``rank`` itself).
    """

    def __init__(self, root: str, job: str, rank: int, source: int | None = None) -> None:
        directory = os.path.join(tier_dir(root, job), f"rank{rank}")
        if source is not None:
            directory = os.path.join(directory, f"peer{source}")
        storage, path = resolve_storage(directory)
        super().__init__(storage, path, TEMPLATE)
        self.root = root
        self.job = job
        self.rank = rank
        self.source = rank if source is None else source

    def __repr__(self) -> str:
        return f"MemoryStore({self.directory!r})"

    def newest_verified(self) -> Held | None:
        """The newest snapshot whose bytes match its manifest (older ones are tried when the
        newest fails, each failure logged); None when none verifies."""

        def check(entry: Entry) -> Held:
            manifest = self.verify(entry)
            if manifest is None or entry.step is None:
                raise SnapshotCorruptError(f"{entry.path}: no manifest")
            return Held(step=entry.step, path=entry.path, checksum=manifest.checksum,
                        size_bytes=manifest.size_bytes)

        return self._newest(check)

    def newest_listed(self) -> Held | None:
        """The newest snapshot whose manifest names it and whose file has the recorded size,
        from the listing, the manifests and one ``stat`` each: no snapshot byte is read (the
        memory tier's inventory at start; the bytes are verified once, where they are used:
        :meth:`load` for the own copy, the receiving rank's check for a peer copy). Older ones
        are tried when the newest has no usable manifest (each skip logged); None when none.
        The checksum is the manifest's, written at commit."""

        def check(entry: Entry) -> Held:
            try:  # an unreadable manifest or a vanished file: skipped, as a corrupt one
                manifest = self.expected(entry)
                size = os.stat(entry.path).st_size
            except OSError as e:
                raise SnapshotCorruptError(f"{entry.path}: {e}") from e
            if manifest is None or entry.step is None:
                raise SnapshotCorruptError(f"{entry.path}: no manifest")
            if size != manifest.size_bytes:
                raise SnapshotCorruptError(
                    f"{entry.path}: size {size} bytes, manifest recorded "
                    f"{manifest.size_bytes} (truncated or overwritten)")
            return Held(step=entry.step, path=entry.path, checksum=manifest.checksum,
                        size_bytes=manifest.size_bytes)

        return self._newest(check)

    def _newest(self, check: Callable[[Entry], Held]) -> Held | None:
        """The stores' one newest-valid-with-fallback
        (:func:`~snapkeep._core.store_kinds.newest_valid`) over this tier's snapshots, each
        skip logged; None when none passes ``check``."""

        def skipped(entry: Entry, error: SnapshotCorruptError) -> None:
            logger.warning("memory tier: %s not used: %s", entry.path, error)

        found = newest_valid(self.entries(), check, skipped=skipped, required=False,
                             what=f"{TEMPLATE!r} in {self.directory!r}")
        return None if found is None else found[1]

    def load(self, held: Held) -> Any:
        """The state of ``held`` (``torch.load``'d, ``weights_only``, CPU), verified: its bytes
        are hashed once in place through a memory map (:func:`digest_file`: no copy), then
        loaded mapped (tensors on the tmpfs pages, no copy). Nothing is returned unless they
        match the manifest's checksum and size. Not the one-pass loader
        (:mod:`snapkeep._core.one_pass`): it reads into new storages, and on tmpfs filling fresh
        pages costs more than a second pass over pages already in memory (1 GiB own copy, two
        gloo ranks: 2.44 s against 0.97 s mapped, ``benchmarks/bench_peer_restart.py``).

        Raises:
            SnapshotCorruptError: size or checksum differs from ``held``'s (or unreadable, or
                not a well-formed snapshot).
            UnsafeSnapshotError: ``weights_only`` refused an object.
        """
        try:
            digest, size = digest_file(held.path)
        except OSError as e:
            raise SnapshotCorruptError(f"{held.path}: unreadable ({e})") from e
        require_match(held.path, digest, size, recorded_checksum=held.checksum,
                      recorded_size=held.size_bytes, algorithm=ALGORITHM)
        return load_file(self.storage, held.path, map_location="cpu", weights_only=True)

    def commit_state(self, step: int, state: Any, savefun: Callable[..., Any]) -> Held:
        """Commit ``state`` as step ``step`` (atomically, with its manifest), then keep it alone.

        Raises:
            SnapshotStorageError: the tmpfs is full or unwritable.
        """
        self.storage.makedirs(self.directory)
        path = self.storage.join(self.directory, TEMPLATE.replace("{.iteration}", str(step)))
        record = self.commit(SaveJob(storage=self.storage, path=path, savefun=savefun,
                                     step=step, tag=f"ram{self.rank}"), state)
        self.keep_newest()
        return Held(step=step, path=path, checksum=record.checksum or "",
                    size_bytes=record.size_bytes)

    def commit_bytes(self, step: int, data: bytes, checksum: str) -> Held:
        """Commit a peer's snapshot bytes after checking them against the ``checksum`` its owner
        recorded (a copy damaged in transit is never committed).

        Raises:
            SnapshotCorruptError: the bytes do not match ``checksum``.
        """
        digest, _ = digest_stream(io.BytesIO(data))
        if digest != checksum:
            raise SnapshotCorruptError(
                f"peer copy of rank {self.source} step {step}: checksum {digest} of the bytes "
                f"received differs from {checksum} recorded by its owner")
        return self.commit_state(step, data, _write_bytes)

    @staticmethod
    def digest(data: Any) -> str:
        """The XXH3-128 hex digest of ``data`` (bytes or any buffer: hashed in place, no copy),
        as manifests record it."""
        view = memoryview(data).cast("B")
        hasher = new_hasher()
        for start in range(0, len(view), MAPPED_CHUNK_BYTES):
            hasher.update(view[start:start + MAPPED_CHUNK_BYTES])
        return str(hasher.hexdigest())

    def mapped(self, held: Held) -> mmap.mmap:
        """``held``'s file mapped (private, copy-on-write: its pages, no copy), not hashed:
        for sending it to the rank that owns it, which checks it against the owner's checksum
        on arrival. Close it after use.

        Raises:
            SnapshotCorruptError: unreadable, or its size differs from the manifest's.
        """
        try:
            with open(held.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != held.size_bytes or size == 0:
                    raise SnapshotCorruptError(
                        f"{held.path}: size {size} bytes, manifest recorded {held.size_bytes}")
                return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise SnapshotCorruptError(f"{held.path}: unreadable ({e})") from e

    def keep_newest(self) -> None:
        """Delete every snapshot but the newest (the retention of the memory tier)."""
        for entry in self.entries()[:-1]:
            self.delete(entry)

    def read(self, held: Held) -> bytes:
        """The bytes of ``held``, checked against its checksum.

        Raises:
            SnapshotCorruptError: they differ from its manifest (or are unreadable).
        """
        try:
            with open(held.path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise SnapshotCorruptError(f"{held.path}: unreadable ({e})") from e
        digest, size = digest_stream(io.BytesIO(data))
        if digest != held.checksum or size != held.size_bytes:
            raise SnapshotCorruptError(f"{held.path}: checksum differs from its manifest")
        return data

    def entry_of(self, held: Held) -> Entry | None:
        """The store entry of ``held``."""
        return self.entry_for(held.path)


def _write_bytes(data: bytes, f: IO[bytes]) -> None:
    f.write(data)


def write_owner(root: str, job: str, rank: int, *, world: int = 1) -> str:
    """Record this process as the owner of ``rank``'s tier (pid, host, time, world size);
    return the path."""
    directory = tier_dir(root, job)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"owner-rank{rank}.json")
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                         "rank": rank, "world": world}).encode()
    storage, _ = resolve_storage(directory)
    storage.write_bytes(path, record, tag="owner")  # the storage layer's atomic commit
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_stale(root: str, *, keep: str, stale_after_s: float) -> list[str]:
    """Remove the tiers under ``root`` of jobs whose every owner is dead (same host, pid gone)
    or unknown (another host, or no record) and whose newest record is older than
    ``stale_after_s`` seconds. ``keep`` (this job's id) is never removed. Returns the removed
    directories; failures are logged."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    host = socket.gethostname()
    now = time.time()
    for name in names:
        if not name.startswith(PREFIX) or name == PREFIX + keep:
            continue
        directory = os.path.join(root, name)
        records = owners(directory)
        newest = max((r.get("time", 0.0) for r in records), default=0.0)
        if not records:
            try:
                newest = os.stat(directory).st_mtime
            except OSError:
                continue
        if now - newest < stale_after_s:
            continue
        if any(r.get("host") == host and _alive(int(r.get("pid", 0))) for r in records):
            continue
        try:
            shutil.rmtree(directory)
            removed.append(directory)
            logger.info("memory tier: reclaimed %s (owner dead since %.0f s)", directory,
                        now - newest)
        except OSError as e:
            logger.warning("memory tier: could not reclaim %s: %s", directory, e)
    return removed


def owners(directory: str) -> list[dict[str, Any]]:
    """The owner records of one tier directory (unreadable ones skipped)."""
    found: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return found
    for name in names:
        if name.startswith("owner-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    found.append(json.load(f))
            except (OSError, ValueError):
                continue
    return found


def check_space(root: str, needed_bytes: int, *, held_bytes: int = 0) -> None:
    """Refuse to start when the filesystem of ``root`` cannot hold ``needed_bytes`` (what this
    rank's tier holds already, ``held_bytes``, counts as available).

    Raises:
        MemoryTierTooSmallError: naming the size needed, the size free and how to fix it.
    """
    os.makedirs(root, exist_ok=True)
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize + held_bytes
    if free < needed_bytes:
        raise MemoryTierTooSmallError(
            f"memory tier: {root!r} has {_mib(free)} free but this rank needs {_mib(needed_bytes)} "
            "(own copy + replicas + one in flight); enlarge the tmpfs (docker run --shm-size, "
            "mount -o remount,size=...), pick another root= or fewer replicas=")


def tier_bytes(root: str, job: str, rank: int) -> int:
    """Bytes held now under ``rank``'s directory of ``job``'s tier."""
    total = 0
    for base, _, files in os.walk(os.path.join(tier_dir(root, job), f"rank{rank}")):
        for name in files:
            try:
                total += os.stat(os.path.join(base, name)).st_size
            except OSError:
                continue
    return total


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe_tiers(root: str) -> list[dict[str, Any]]:
    """What each tier under ``root`` holds: ``{"dir", "owners", "held": [{rank, source, step,
    bytes}]}`` per job (for ``snapkeep ls --memory``)."""
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for name in names:
        directory = os.path.join(root, name)
        if not name.startswith(PREFIX) or not os.path.isdir(directory):
            continue
        job = name[len(PREFIX):]
        held = []
        for rank_dir in sorted(os.listdir(directory)):
            if not rank_dir.startswith("rank") or not rank_dir[4:].isdigit():
                continue
            rank = int(rank_dir[4:])
            sources: list[int | None] = [None]
            for sub in sorted(os.listdir(os.path.join(directory, rank_dir))):
                if sub.startswith("peer") and sub[4:].isdigit():
                    sources.append(int(sub[4:]))
            for source in sources:
                store = MemoryStore(root, job, rank, source)
                for entry in store.entries():
                    held.append({"rank": rank, "source": store.source, "step": entry.step,
                                 "bytes": os.stat(entry.path).st_size})
        out.append({"dir": directory, "owners": owners(directory), "held": held})
    return out


def remove_rank(root: str, job: str, rank: int) -> None:
    """Remove ``rank``'s directory and owner record of ``job``'s tier, and the tier directory
    when nothing else is left in it (a run that finished)."""
    directory = tier_dir(root, job)
    shutil.rmtree(os.path.join(directory, f"rank{rank}"), ignore_errors=True)
    try:
        os.remove(os.path.join(directory, f"owner-rank{rank}.json"))
    except OSError:
        pass
    try:
        os.rmdir(directory)
    except OSError:
        pass  # other ranks' directories are still there: the last one removes it


__all__ = ["Held", "MemoryStore", "PREFIX", "TEMPLATE",
           "check_space", "describe_tiers", "job_id", "owners", "reclaim_stale", "remove_rank",
           "tier_bytes", "tier_dir", "write_owner"]
