"""The node-memory store kind: one rank's snapshots (and the peer copies it holds) in a tmpfs
directory that outlives the process.

Layout, under ``root`` (default ``/dev/shm``)::

    <root>/snapkeep-<job>/owner-rank<R>.json        who wrote this rank's tier (pid, host, time)
    <root>/snapkeep-<job>/rank<R>/ram_iter_<N>       rank R's own state at step N (+ .snapkeep/)
    <root>/snapkeep-<job>/rank<R>/peer<S>/ram_iter_<N>  rank S's state, held by rank R

Each directory is a :class:`MemoryStore`: a :class:`~snapkeep._core.store.files.SnapshotStore` on
the
local filesystem (the same atomic commit -- temp, fsync, rename -- and XXH3 manifest as snapshot
files), so it implements :class:`~snapkeep._core.store.contract.StoreKind` and runs through the
store contract. What differs is only where it lives and its retention
(:meth:`MemoryStore.keep_newest` keeps the newest committed step alone; RAM is bounded: own
copy + replicas + one in flight).

Identity: the tier is named after the training, never after a launch. The job id
(:func:`job_id`) hashes the user's uid, the output directory (absolute, or the URL) and the
snapshot's filename template: what makes a rerun of the same command the same training (never
``TORCHELASTIC_RUN_ID``, which ``torchrun --standalone`` draws anew at every launch). Each
rank's owner record holds that identity (:class:`Identity`), and a RAM snapshot is used only by
the training whose identity its record holds (:func:`foreign_reason`).

Privacy: the root is a shared tmpfs, so every directory of a tier is ``0700`` and every file
``0600``, and every path component under the root is opened without following a symlink and
checked to be a directory (or regular file) of this user before anything is read, written or
removed through it (:mod:`snapkeep._core.storage`'s private directories). Another user's tier,
or a planted symlink, is never read, written or removed. Owner records are read bounded
(:data:`MAX_RECORD_BYTES`) and never blocking; a malformed one is skipped with a log line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import mmap
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from snapkeep._core.errors import (
    MemoryTierTooSmallError,
    SnapshotCorruptError,
)
from snapkeep._core.format.checksum import (
    ALGORITHM,
    MAPPED_CHUNK_BYTES,
    digest_file,
    digest_stream,
    new_hasher,
    require_match,
)
from snapkeep._core.format.json_records import UNIX_TIME_LIMIT_S, parse_json
from snapkeep._core.format.manifest import MANIFEST_DIR
from snapkeep._core.format.naming import FilenameTemplate, ppe_template
from snapkeep._core.load.loading import load_file
from snapkeep._core.save.job import SaveJob
from snapkeep._core.storage import (
    NotPrivateError,
    check_root,
    list_private,
    lstat_private,
    private_dir,
    private_storage,
    read_private,
    remove_private,
    remove_private_file,
)
from snapkeep._core.store.contract import newest_valid
from snapkeep._core.store.files import Entry, SnapshotStore

logger = logging.getLogger(__name__)

TEMPLATE = "ram_iter_{step}"
"""Filename template of the snapshots in a memory store (parsed for the step)."""
PREFIX = "snapkeep-"
"""Every tier directory under the root starts with this (``snapkeep ls --memory`` lists them)."""


#: Largest owner record read, in bytes (a real one is ~300 bytes).
MAX_RECORD_BYTES = 64 * 1024

_OWNER = re.compile(r"owner-rank(\d{1,9})\.json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Identity:
    """What makes a rerun the same training: its output directory (absolute, or the URL) and
    the snapshot's filename template. Recorded in each owner record; a RAM snapshot is used only
    by a training of the same identity.

    Attributes:
        out_dir: the output directory, absolute (a URL as given).
        template: the filename template of the snapshots the tier stands in for.
    """

    out_dir: str
    template: str

    @classmethod
    def of(cls, out_dir: str, template: FilenameTemplate | str) -> Identity:
        """The identity of the training writing ``template``'s snapshots into ``out_dir``: a
        template (in either spelling: :func:`ppe_template`) by the names it matches
        (:attr:`FilenameTemplate.lock_key`: ppe's ``'s_{.iteration}'`` and ``'s_{0.iteration}'``
        and the store's ``'s_{step}'`` are one training), or a door's own name for its
        snapshots that is no template, as given."""
        if isinstance(template, FilenameTemplate):
            key = template.lock_key if template.parsable else template.text
        else:
            try:  # a template in either spelling, or a door's name that is none
                key = ppe_template(template).lock_key
            except (TypeError, ValueError):
                key = str(template)
        return cls(out_dir=out_dir if "://" in out_dir else os.path.abspath(out_dir),
                   template=key)

    def describe(self) -> str:
        return f"out_dir {self.out_dir!r}, template {self.template!r}"


def job_id(out_dir: str, template: FilenameTemplate | str) -> str:
    """The id naming a job's tier: the first 16 hex digits of SHA-256 over this user's uid,
    ``out_dir`` (absolute, or the URL) and ``template``: the same for every rerun of the same
    training by the same user, whatever the launcher (never ``TORCHELASTIC_RUN_ID``: torchrun
    draws a new one at every ``--standalone`` launch, so a restart would never find its tier
    and each launch would leave one more in the tmpfs)."""
    identity = Identity.of(out_dir, template)
    key = f"{os.geteuid()}\0{identity.out_dir}\0{identity.template}"
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:16]


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
        self.parts = [PREFIX + job, f"rank{rank}"] + ([] if source is None
                                                       else [f"peer{source}"])
        super().__init__(private_storage(), os.path.join(root, *self.parts), TEMPLATE)
        self.root = root
        self.job = job
        self.rank = rank
        self.source = rank if source is None else source

    def __repr__(self) -> str:
        return f"MemoryStore({self.directory!r})"

    def private(self, *, create: bool = False) -> bool:
        """Check (``create``: make, ``0700``) every directory of this store under the root,
        its manifest directory included: each a directory of this user, no symlink followed.
        False when one is missing (``create`` False).

        Raises:
            NotPrivateError: a component is a symlink, not a directory, or another user's.
        """
        try:
            with private_dir(self.root, [*self.parts, MANIFEST_DIR], create=create):
                return True
        except FileNotFoundError:
            if create:
                raise
            try:  # a store without its manifest directory yet: the rest checked
                with private_dir(self.root, self.parts):
                    return True
            except FileNotFoundError:
                return False

    def entries(self) -> list[Entry]:
        """The committed snapshots, as :meth:`SnapshotStore.entries`, once every directory of
        the store is checked as this user's (:meth:`private`); none when one is missing or not
        ours (logged)."""
        try:
            if not self.private():
                return []
        except NotPrivateError as e:
            logger.warning("memory tier: %s not used: %s", self.directory, e)
            return []
        return super().entries()

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
                size = _own_regular(entry.path).st_size
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
        (:func:`~snapkeep._core.store.contract.newest_valid`) over this tier's snapshots, each
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
        (:mod:`snapkeep._core.load.one_pass`): it reads into new storages, and on tmpfs filling
        fresh
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
            NotPrivateError: a directory of the store is not this user's (nothing written).
        """
        self.private(create=True)  # 0700, ours, no symlink: then the commit (files 0600)
        path = self.storage.join(self.directory, self.template.name_at(step))
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


def _own_regular(path: str) -> os.stat_result:
    """``lstat`` of ``path``, a regular file of this user (inside a checked directory).

    Raises:
        NotPrivateError: a symlink, another type or another user's.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise NotPrivateError(f"{path} is not a regular file of this user (mode "
                              f"{st.st_mode:o}, uid {st.st_uid}); refused")
    return st


def write_owner(root: str, job: str, rank: int, *, world: int = 1,
                identity: Identity | None = None) -> str:
    """Record this process as the owner of ``rank``'s tier (pid, host, time, world size, and
    the training's ``identity``) in a file ``0600`` of the private tier directory; return its
    path.

    Raises:
        NotPrivateError: the tier directory is not this user's (nothing written).
    """
    directory = tier_dir(root, job)
    with private_dir(root, [PREFIX + job], create=True):
        pass
    path = os.path.join(directory, f"owner-rank{rank}.json")
    body: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(),
                            "time": time.time(), "rank": rank, "world": world}
    if identity is not None:
        body.update(out_dir=identity.out_dir, template=identity.template)
    private_storage().write_bytes(path, json.dumps(body).encode(), tag="owner")  # atomic
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(record: dict[str, Any]) -> bool:
    """Whether the process of an owner record (:func:`owners`) lives on this host (another
    host's: assumed alive, it cannot be asked)."""
    if record["host"] != socket.gethostname():
        return True
    return _alive(record["pid"])


def _tiers(root: str) -> Iterator[tuple[str, str]]:
    """``(name, reason)`` of every entry named like a tier under ``root``: reason ``""`` for a
    directory of this user, else why it is not used (a symlink, a file, another user's)."""
    try:
        with private_dir(root, []) as fd:
            names = list_private(fd)
            for name in names:
                if not name.startswith(PREFIX):
                    continue
                try:
                    lstat_private(fd, name, os.path.join(root, name), directory=True)
                except NotPrivateError as e:
                    yield name, str(e)
                    continue
                except FileNotFoundError:
                    continue
                yield name, ""
    except FileNotFoundError:
        return
    except NotPrivateError as e:  # the start refuses such a root (check_space); tools skip it
        logger.warning("memory tier: %s not read: %s", root, e)


def reclaim_stale(root: str, *, keep: str, stale_after_s: float,
                  identity: Identity | None = None) -> list[str]:
    """Remove the tiers of this user under ``root`` that no future restart will use:

    - a tier of the same training (owner records holding ``identity``) under another name than
      ``keep`` (named by an older snapkeep, by a per-launch id, or another ``job=``) whose
      owners are all dead on this host: replaced by this run's (no tmpfs growth in a crash
      loop);
    - a tier of another job whose every owner is dead (same host, pid gone) or unknown
      (another host, or no record) and whose newest record is older than ``stale_after_s``.

    ``keep`` (this job's id) is never removed; another user's tier, or anything that is not a
    directory of ours, is never read or removed. Returns the removed directories; failures are
    logged."""
    removed: list[str] = []
    now = time.time()
    for name, refused in _tiers(root):
        if refused or name == PREFIX + keep:
            continue
        directory = os.path.join(root, name)
        records = owners(directory)
        same = identity is not None and bool(records) and all(
            r.get("out_dir") == identity.out_dir and r.get("template") == identity.template
            for r in records)
        if any(owner_alive(r) for r in records):
            continue
        if not same:
            newest = max((r["time"] for r in records), default=0.0)
            if not records:
                try:
                    newest = os.stat(directory, follow_symlinks=False).st_mtime
                except OSError:
                    continue
            if now - newest < stale_after_s:
                continue
        try:
            remove_private(root, [name])
            removed.append(directory)
            logger.info("memory tier: removed %s (%s)", directory,
                        f"the tier of this training under an old name; replaced by "
                        f"{PREFIX}{keep}" if same else "owners dead")
        except OSError as e:
            logger.warning("memory tier: could not remove %s: %s", directory, e)
    return removed


def _record(data: bytes, where: str) -> dict[str, Any]:
    """An owner record's fields, type-checked.

    Raises:
        ValueError: not JSON, not an object, or a field of the wrong type.
    """
    body = parse_json(data, max_bytes=MAX_RECORD_BYTES)  # RecordError: a ValueError
    if not isinstance(body, dict):
        raise ValueError(f"a JSON {type(body).__name__}, not an object")

    def integer(v: Any, low: int) -> bool:  # pids, ranks, world sizes: below 2**31
        return isinstance(v, int) and not isinstance(v, bool) and low <= v < 1 << 31

    checks: dict[str, Callable[[Any], bool]] = {
        "pid": lambda v: integer(v, 1),
        "host": lambda v: isinstance(v, str) and len(v) <= 1024,
        "time": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v) and 0 <= v < UNIX_TIME_LIMIT_S,
        "rank": lambda v: integer(v, 0),
    }
    for key, ok in checks.items():
        if key not in body or not ok(body[key]):
            raise ValueError(f"{key!r} missing or of the wrong type")
    record = {key: body[key] for key in checks}
    record["time"] = float(record["time"])
    world = body.get("world")
    if world is not None and not integer(world, 1):
        raise ValueError("'world' is not an int >= 1")
    record["world"] = world
    for key in ("out_dir", "template"):
        value = body.get(key)
        if value is not None and not (isinstance(value, str) and len(value) <= 4096):
            raise ValueError(f"{key!r} is not a string")
        record[key] = value
    return record


def owners(directory: str) -> list[dict[str, Any]]:
    """The owner records of one tier directory of this user: ``{"pid", "host", "time",
    "rank", "world", "out_dir", "template"}`` each (``world``, ``out_dir`` and ``template``
    None when an older snapkeep wrote it). Read without following a symlink, without
    blocking (a FIFO is refused at once), at most :data:`MAX_RECORD_BYTES` each; a record
    that is not a regular file of ours, too large or malformed is skipped with a log line.
    None at all when ``directory`` is not a directory of this user."""
    found: list[dict[str, Any]] = []
    root, name = os.path.split(directory.rstrip("/"))
    try:
        with private_dir(root, [name]) as fd:
            for entry in list_private(fd):
                if not _OWNER.fullmatch(entry):
                    continue
                where = os.path.join(directory, entry)
                try:
                    found.append(_record(read_private(fd, entry, max_bytes=MAX_RECORD_BYTES,
                                                      where=where), where))
                except FileNotFoundError:
                    continue
                except (OSError, ValueError) as e:
                    logger.warning("memory tier: owner record %s skipped: %s", where, e)
    except FileNotFoundError:
        return found
    except NotPrivateError as e:
        logger.warning("memory tier: %s not read: %s", directory, e)
    return found


def foreign_reason(root: str, job: str, rank: int, identity: Identity) -> str | None:
    """Why the RAM of ``rank`` in ``job``'s tier is not this training's: its owner record
    names another identity, or holds none (an older snapkeep's, or no record beside
    snapshots). None when it is this training's, or when the rank holds nothing.

    Raises:
        NotPrivateError: the tier directory is not this user's.
    """
    directory = tier_dir(root, job)
    try:
        with private_dir(root, [PREFIX + job]) as fd:
            names = set(list_private(fd))
    except FileNotFoundError:
        return None
    if f"rank{rank}" not in names:
        return None
    mine = [r for r in owners(directory) if r["rank"] == rank]
    if not mine:
        return "no owner record of this rank: not known to be this training's"
    record = mine[0]
    if record["out_dir"] is None:
        return "its owner record names no training (written by an older snapkeep)"
    if (record["out_dir"], record["template"]) != (identity.out_dir, identity.template):
        return (f"it belongs to another training (out_dir {record['out_dir']!r}, template "
                f"{record['template']!r})")
    return None


def forget_rank(root: str, job: str, rank: int) -> None:
    """Remove ``rank``'s directory and owner record of ``job``'s tier (this user's only), the
    tier directory itself staying.

    Raises:
        NotPrivateError: the tier directory is not this user's (nothing removed).
    """
    remove_private(root, [PREFIX + job, f"rank{rank}"])
    try:
        with private_dir(root, [PREFIX + job]) as fd:
            remove_private_file(fd, f"owner-rank{rank}.json")
    except FileNotFoundError:
        pass


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (``'tmpfs'``, ``'ext4'``), from the longest
    mount point above it in ``/proc/self/mounts``; None where that cannot be read."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    real = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) > best[0]:
                best = (len(point), kind)
    return best[1] if best is not None else None


def check_space(root: str, needed_bytes: int, *, held_bytes: int = 0) -> None:
    """Refuse to start when the filesystem of ``root`` cannot hold ``needed_bytes`` (what this
    rank's tier holds already, ``held_bytes``, counts as available).

    Raises:
        MemoryTierTooSmallError: naming the size needed, the size free and how to fix it.
        NotPrivateError: other users could rename or delete what is in ``root`` (see
            :func:`~snapkeep._core.storage.check_root`).
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"MemoryTier root {root!r} is not a directory; pass root= a tmpfs "
                         "directory such as '/dev/shm' (the default)")
    created = not os.path.exists(root)
    os.makedirs(root, exist_ok=True)
    if created and (kind := filesystem_type(root)) not in ("tmpfs", "ramfs", None):
        logger.warning("memory tier: root %r did not exist and was created on a %s "
                       "filesystem, not a tmpfs: the tier's copies go to that disk, not to RAM. "
                       "Check the path, or pass root= a tmpfs such as '/dev/shm'", root, kind)
    check_root(root)
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize + held_bytes
    if free < needed_bytes:
        raise MemoryTierTooSmallError(
            f"memory tier: {root!r} has {_mib(free)} free but this rank needs {_mib(needed_bytes)} "
            "(own copy + replicas + one in flight); enlarge the tmpfs (docker run --shm-size, "
            "mount -o remount,size=...), pick another root= or fewer replicas=")


def tier_bytes(root: str, job: str, rank: int) -> int:
    """Bytes held now under ``rank``'s directory of ``job``'s tier (0 when it is not this
    user's)."""
    total = 0
    for source in [None, *peer_sources(root, job, rank)]:
        store = MemoryStore(root, job, rank, source)
        for entry in store.entries():
            try:
                total += _own_regular(entry.path).st_size
            except OSError:
                continue
    return total


def peer_sources(root: str, job: str, rank: int) -> list[int]:
    """The ranks whose copies ``rank``'s directory of ``job``'s tier holds (``peer<S>``
    directories of this user)."""
    try:
        with private_dir(root, [PREFIX + job, f"rank{rank}"]) as fd:
            names = list_private(fd)
    except (FileNotFoundError, NotPrivateError):
        return []
    return sorted(int(n[4:]) for n in names if re.fullmatch(r"peer\d{1,9}", n))


def ranks_in(root: str, job: str) -> list[int]:
    """The ranks with a directory or owner record in ``job``'s tier (this user's)."""
    try:
        with private_dir(root, [PREFIX + job]) as fd:
            names = list_private(fd)
    except (FileNotFoundError, NotPrivateError):
        return []
    return sorted({int(m.group(1)) for n in names
                   if (m := re.fullmatch(r"(?:owner-)?rank(\d{1,9})(?:\.json)?", n))})


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe_tiers(root: str) -> list[dict[str, Any]]:
    """What each tier of this user under ``root`` holds: ``{"dir", "owners", "held": [{rank,
    source, step, bytes}]}`` per job (for ``snapkeep ls --memory``). Another user's tier, or a
    symlink or file named like one, is not read: skipped with a log line."""
    out: list[dict[str, Any]] = []
    for name, refused in _tiers(root):
        directory = os.path.join(root, name)
        if refused:
            logger.warning("memory tier: %s not read: %s", directory, refused)
            continue
        job = name[len(PREFIX):]
        held = []
        for rank in ranks_in(root, job):
            for source in [None, *peer_sources(root, job, rank)]:
                store = MemoryStore(root, job, rank, source)
                for entry in store.entries():
                    try:
                        size = _own_regular(entry.path).st_size
                    except OSError as e:
                        logger.warning("memory tier: %s not listed: %s", entry.path, e)
                        continue
                    held.append({"rank": rank, "source": store.source, "step": entry.step,
                                 "bytes": size})
        out.append({"dir": directory, "owners": owners(directory), "held": held})
    return out


def remove_rank(root: str, job: str, rank: int) -> None:
    """Remove ``rank``'s directory and owner record of ``job``'s tier, and the tier directory
    when nothing else is left in it (a run that finished). Only this user's: a tier directory
    that is not (a symlink, another user's) is left alone, logged."""
    try:
        forget_rank(root, job, rank)
        with private_dir(root, []) as fd:
            os.rmdir(PREFIX + job, dir_fd=fd)
    except NotPrivateError as e:
        logger.warning("memory tier: %s not removed: %s", tier_dir(root, job), e)
    except OSError:
        pass  # other ranks' directories are still there: the last one removes it


__all__ = ["Held", "Identity", "MAX_RECORD_BYTES", "MemoryStore", "NotPrivateError", "PREFIX",
           "TEMPLATE", "check_space", "describe_tiers", "forget_rank", "foreign_reason",
           "job_id", "owner_alive", "owners", "peer_sources", "ranks_in", "reclaim_stale",
           "remove_rank", "tier_bytes", "tier_dir", "write_owner"]
