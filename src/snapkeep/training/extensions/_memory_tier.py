"""The memory tier: every ``every`` iterations each rank commits its state to node RAM (a tmpfs
directory that outlives the process) and a background thread copies it to ``replicas`` peer
ranks; at start, ranks resume from RAM (own, else a peer's) when it is at least as new as
storage, without reading storage.

Use it beside an autoloading snapshot extension::

    manager.extend(extensions.snapshot(autoload=True), trigger=(1000, "iteration"))
    manager.extend(extensions.memory_tier(MemoryTier(every=50, replicas=1)))

What one rank holds in its node's tmpfs (``root``, default ``/dev/shm``), at most: its own newest
step + one peer copy per rank it replicates for (``replicas`` of them) + one snapshot in flight,
i.e. ``(2 + replicas) x`` the size of its ``torch.save``'d state. Retention keeps the newest
complete step alone. The size is checked at start against the tmpfs's free space
(:class:`~snapkeep.errors.MemoryTierTooSmallError`, naming the size needed).

At the trigger the training loop pays only for a consistent copy of the rank's state: it is
staged into CPU buffers reused across triggers (:class:`~snapkeep.staging.BufferSet`, the
writers' staging; pinned for accelerator tensors), and the loop may mutate its tensors as soon as
the call returns. A background thread then serialises the staged copy (``torch.save``), commits
it to tmpfs (atomic, with its XXH3 manifest) and copies it to the peers. At most one RAM snapshot
is in flight: a trigger that fires while the previous one is still being committed waits for it
(logged at debug). The staging buffers are one more copy of the state in process memory (not in
tmpfs; freed at ``finalize``). A background failure is raised once, as
:class:`~snapkeep.errors.SnapshotSaveError` chained from the original exception, at the next
trigger (which then takes no snapshot) or at ``finalize``, as writers report theirs.

No second staging: at an iteration where the snapshot extension also saved the manager's state
(its trigger and the tier's fire together), the tier takes no copy of its own: it borrows the
one the snapshot's writer staged (:meth:`snapkeep.writing.Writer.lend_staged`; a process
writer's shared memory too), serialises it in the background once that copy is final (after
the verdict of an overlapped staging; a copy dropped for a race drops the RAM snapshot of that
step too, logged), and gives it back; the writer stages into those buffers again only after
that. The tier runs at the snapshot's priority (``PRIORITY_SNAPSHOT``: after every trigger of
the iteration was evaluated, as ppe runs snapshots) and after the snapshot extensions registered
before it, so extend the manager with the tier after the snapshot extension (as above). The
tier stages its own copy when there is nothing to borrow: a step only the tier takes, a
``SimpleWriter`` (which stages nothing), a ``snapshot_object`` of another target, SHARDED
snapshots (DCP stages its own), a tier registered before the snapshot. Peer copies run on
snapkeep's ``peer`` process group (gloo; see :mod:`snapkeep._core.distributed.groups`), never on
the training's.

Recovery (``initialize``, when the manager has an autoloading snapshot extension): every rank
lists what its tmpfs holds (its own newest step and the peer copies: step and checksum from
their manifests, no snapshot byte read), all ranks exchange that inventory in one bounded
collective, and choose together the newest step that every rank can take from RAM (own copy,
else the first peer holding a copy) and that is at least the newest step listed on storage (a
listing only: no storage file is opened). Each byte used is then read and hashed once: the own
copy is verified while it is loaded (one pass), peer bytes travel on the control group unhashed
by the sender and are checked by the receiver against the owner's checksum; a copy that fails
is excluded on every rank (one more collective) and the choice made again, falling through to
an older RAM step or to storage (the snapshot extension's normal autoload). A copy taken from a
peer is not written back to the own tmpfs (the holder keeps it; the next RAM commit rewrites
it). A different world size than the tier's falls back to storage. When the RAM step is newer
than storage, the snapshot extension writes it to storage first ("persist at breakpoint"), then
training goes on.

With SHARDED snapshots (``snapshot_mode=SnapshotMode.SHARDED``, e.g. FSDP2), each rank's RAM
snapshot is its own part of what the SHARDED extension saves
(:meth:`~._sharded._ShardedSnapshot.memory_state`): the local shard of every DTensor
(``to_local()``), plain tensors, and its non-tensor and RNG state as bytes; manifest, checksum
and peer copies as above. At restore every rank checks its snapshot against its live state
(same keys; each tensor the shape and dtype of the live local shard: same world size and
sharding); when any rank's differs, every rank logs why and resumes from storage (which
reshards). Otherwise the bytes are copied into the live local shards in place and the rest is
applied as a storage resume applies it. A RAM step newer than storage is committed to storage as
a SHARDED snapshot (the extension's own save, waited for) before training goes on.

Cleanup: ``finalize`` after the stop trigger fired (a run that finished) removes the rank's tier,
and the directories of ranks beyond this run's world size that an earlier run of the job on
more ranks left in the same root; a crashed or killed run leaves it for its restart. At start,
tiers of other jobs whose owners are dead and older than ``stale_after_s`` are reclaimed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import mmap
import os
import threading
import types
import warnings
from typing import Any

import torch

from snapkeep.distributed import (
    all_gather,
    background_groups,
    exchange_outcomes,
    is_distributed,
)
from snapkeep.errors import (
    SnapshotCorruptError,
    SnapshotSaveError,
    SnapshotTimeoutError,
    StagingRaceError,
)
from snapkeep.staging import BufferSet, StagedLoan, into_existing_state, optimizers_in
from snapkeep.store import (
    CandidateRefused,
    Held,
    Identity,
    Listed,
    MemoryStore,
    NotPrivateError,
    SnapshotStore,
    check_space,
    foreign_reason,
    forget_rank,
    job_id,
    newest_valid,
    owner_alive,
    owners,
    peer_sources,
    ranks_in,
    reclaim_stale,
    remove_rank,
    resolve_storage,
    tier_bytes,
    tier_dir,
    write_owner,
)
from snapkeep.training import extension
from snapkeep.training.extensions._lineage import SNAPSHOT_MARKER
from snapkeep.wrapping import canonical_tree, live_tree

logger = logging.getLogger(__name__)

RESTORED_ATTRIBUTE = "_snapkeep_memory_restored"
"""Set on the manager when the tier restored its state (a :class:`Restored`); the snapshot
extension then skips its autoload and persists the step when it is newer than storage."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryTier:
    """Configuration of the memory tier (see the module docstring).

    Attributes:
        every: commit to RAM every this many iterations (int > 0).
        replicas: peer ranks receiving a copy of each rank's RAM snapshot (int >= 0, less than
            the world size; ignored in a single process).
        stride: peer ``i`` (1..replicas) of rank ``r`` is ``(r + stride*i) % world``. Default:
            ``LOCAL_WORLD_SIZE`` under torchrun when it is less than the world size (peers on
            other nodes), else 1.
        root: the tmpfs directory holding the tiers (default ``/dev/shm``); it must be yours
            or root's, and writable by other users only with the sticky bit (as ``/dev/shm``).
            Each tier under it is private (directories ``0700``, files ``0600``, no symlink
            followed, another user's never read, written or removed).
        job: the job id naming the tier (default: a hash of the user's uid, out_dir and the
            snapshot's template, the same at every rerun of the training; never a per-launch
            id such as ``TORCHELASTIC_RUN_ID``). Whatever the name, a RAM snapshot is resumed
            only by the training (out_dir and template) recorded in its owner record.
        timeout_s: bound in seconds of every collective of the tier (agreement, peer copies).
        stale_after_s: a tier of another job whose owners are dead is reclaimed once its newest
            owner record is older than this (seconds).
    """

    every: int
    replicas: int = 1
    stride: int | None = None
    root: str = "/dev/shm"
    job: str | None = None
    timeout_s: float = 120.0
    stale_after_s: float = 3600.0

    def __post_init__(self) -> None:
        for name, low in (("every", 1), ("replicas", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"MemoryTier {name} must be an int >= {low}, got {value!r}")
        if self.stride is not None and (isinstance(self.stride, bool)
                                        or not isinstance(self.stride, int) or self.stride < 1):
            raise ValueError(f"MemoryTier stride must be None or an int >= 1, got "
                             f"{self.stride!r}")
        if not isinstance(self.root, str) or not self.root or "://" in self.root:
            raise ValueError(f"MemoryTier root must be a local directory path (a tmpfs such as "
                             f"/dev/shm), got {self.root!r}")
        if self.job is not None and (not isinstance(self.job, str) or not self.job
                                     or "/" in self.job):
            raise ValueError(f"MemoryTier job must be None or a name without '/', got "
                             f"{self.job!r}")
        for name in ("timeout_s", "stale_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"MemoryTier {name} must be a positive number of seconds, "
                                 f"got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Restored:
    """What the memory tier restored at start.

    Attributes:
        step: the step every rank resumed from.
        source: where this rank's state came from: ``'own'`` or ``'peer<R>'``.
        storage_step: the newest step listed on storage (None: none).
    """

    step: int
    source: str
    storage_step: int | None

    @property
    def newer_than_storage(self) -> bool:
        return self.storage_step is None or self.step > self.storage_step


def memory_tier(tier: MemoryTier) -> _MemoryTierExtension:
    """The memory-tier extension for ``tier``; extend the manager with it (its trigger is
    ``(tier.every, 'iteration')``). See the module docstring of :mod:`._memory_tier`.

    Raises:
        TypeError: ``tier`` is not a :class:`MemoryTier`.
    """
    if not isinstance(tier, MemoryTier):
        raise TypeError(f"memory_tier expects a MemoryTier(every=..., ...), got {tier!r}")
    return _MemoryTierExtension(tier)


def _snapshot_extensions(manager: Any) -> list[Any]:
    entries = getattr(manager, "_extensions", {})
    return [e.extension for e in entries.values()
            if getattr(getattr(e, "extension", None), SNAPSHOT_MARKER, False)]


def _state_bytes(state: Any) -> int:
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item  # a DTensor's shard
            total += local.numel() * local.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


class _MemoryTierExtension(extension.Extension):
    """See :func:`memory_tier`."""

    # a snapshot-priority extension, run after the snapshots registered before it, so it may
    # borrow their staged copy; its recovery still runs before their autoload: they call
    # recover_before_autoload first
    priority = extension.PRIORITY_SNAPSHOT
    needs_model_state = True

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier
        self.trigger = (tier.every, "iteration")
        self.restored: Restored | None = None
        self._thread: threading.Thread | None = None  # the RAM snapshot in flight
        self._in_flight: int | None = None  # its step
        self._error: tuple[int, BaseException] | None = None  # its failure, not raised yet
        self._buffers: Any = None  # a BufferSet: the staged copy, reused across triggers
        self._failed = False
        self._started = False
        self._owner_written = False
        self._rank = 0
        self._world = 1
        self._groups: Any = None
        self._job = ""
        self._identity: Identity | None = None
        self._disabled: str | None = None  # why this rank's tier cannot be used (logged once)
        self._stride = 1
        self._replicas = 0
        self._sharded: Any = None
        self._initialized = False
        self._loan: Any = None  # the StagedLoan the RAM snapshot in flight serialises

    # -- start ------------------------------------------------------------------------------
    def initialize(self, manager: Any) -> None:  # type: ignore[override]
        """Check the tmpfs, reclaim dead jobs' tiers, record this owner, and recover; once
        (the snapshot extensions call it before their autoload, see
        :func:`recover_before_autoload`; the manager's own call then does nothing).

        Raises:
            MemoryTierTooSmallError: the tmpfs cannot hold the tier (size needed named).
            NotPrivateError: (a ``PermissionError``) other users could rename or delete what
                is in ``root``: writable by them without the sticky bit, or another user's.
            ValueError: ``replicas`` is not less than the world size.
            CollectiveTimeoutError: a rank did not take part in the agreement in time.
        """
        if self._initialized:
            return
        self._initialized = True
        tier = self.tier
        snapshots = _snapshot_extensions(manager)
        if is_distributed():
            self._groups = background_groups(tier.timeout_s)
            self._rank, self._world = self._groups.rank, self._groups.world_size
        if self._world > 1 and tier.replicas >= self._world:
            raise ValueError(f"MemoryTier replicas must be less than the world size "
                             f"({self._world}), got {tier.replicas}")
        self._replicas = tier.replicas if self._world > 1 else 0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self._stride = tier.stride if tier.stride is not None else (
            local if 0 < local < self._world else 1)
        if self._replicas and any((self._stride * i) % self._world == 0
                                  for i in range(1, self._replicas + 1)):
            raise ValueError(f"MemoryTier stride {self._stride} makes a rank its own peer with "
                             f"world size {self._world} and {self._replicas} replica(s)")
        # SHARDED snapshots: each rank's RAM snapshot is its part of what they save
        self._sharded = next((s for s in snapshots if callable(getattr(s, "memory_state", None))),
                             None)
        # the job is named after the snapshot of the whole manager (a snapshot_object
        # registered first must not move the tier)
        named = [s for s in snapshots if getattr(s, "_target", None) is None] or snapshots
        template = str(getattr(named[0], "filename", "")) if named else ""
        self._identity = Identity.of(str(manager.out), template)
        self._job = tier.job or job_id(str(manager.out), template)
        check_space(tier.root, 0)  # the root exists and is safe to hold private directories
        self._claim()
        reclaim_stale(tier.root, keep=self._job, stale_after_s=tier.stale_after_s,
                      identity=self._identity)
        state = canonical_tree(manager, manager.state_dict())
        needed = int(_state_bytes(state) * (2 + self._replicas) * 1.05) + 2**20
        check_space(tier.root, needed, held_bytes=0 if self._disabled else tier_bytes(
            tier.root, self._job, self._rank))
        _say_if_before_snapshot(manager, self)
        previous_world = self._previous_world()
        self._started = True
        if any(getattr(s, "autoload", False) for s in snapshots):
            self.restored = self._recover(manager, snapshots, previous_world)
            if self.restored is not None:
                setattr(manager, RESTORED_ATTRIBUTE, self.restored)

    def _claim(self) -> None:
        """Make sure this rank's RAM in the tier is this training's, or not used at all.

        - The tier directory is not a directory of this user (a symlink, a file, another
          user's, planted or not): this rank's tier is disabled for the run (one warning; it
          still takes part in the peer copies, holding nothing), and nothing is read, written
          or removed through it.
        - This rank's RAM belongs to another training (its owner record names another out_dir
          or template, or none): ignored, with one log line, and replaced (removed now) unless
          its owner still runs on this host, which then keeps it (this rank's tier disabled).
        """
        root, job, rank, identity = self.tier.root, self._job, self._rank, self._identity
        if identity is None:  # set by initialize before it calls this
            raise RuntimeError("memory tier: _claim before the training's identity is known")
        try:
            reason = foreign_reason(root, job, rank, identity)
        except NotPrivateError as e:
            self._disabled = str(e)
            logger.warning("memory tier: rank %d takes no RAM snapshots this run: %s (pass "
                           "another MemoryTier root= or job=)", rank, e)
            return
        if reason is None:
            return
        live = [r for r in owners(tier_dir(root, job)) if r["rank"] == rank and owner_alive(r)
                and r["pid"] != os.getpid()]
        if live:
            self._disabled = f"{reason}, in use by pid {live[0]['pid']}"
            logger.warning("memory tier: rank %d takes no RAM snapshots this run: %s holds "
                           "rank %d of %s, %s (pass another MemoryTier job=)", rank,
                           f"pid {live[0]['pid']} on {live[0]['host']}", rank,
                           tier_dir(root, job), reason)
            return
        logger.warning("memory tier: RAM of rank %d in %s ignored and replaced: %s; this "
                       "training is %s", rank, tier_dir(root, job), reason,
                       identity.describe())
        forget_rank(root, job, rank)

    def _own_tier(self) -> None:
        """Record this process as the owner of the rank's tier (at its first write: a run that
        never writes to RAM, e.g. one started after its last iteration, creates no tier)."""
        if not self._owner_written and self._disabled is None:
            write_owner(self.tier.root, self._job, self._rank, world=self._world,
                        identity=self._identity)
            self._owner_written = True

    def _previous_world(self) -> int | None:
        if self._disabled is not None:
            return None
        for record in owners(tier_dir(self.tier.root, self._job)):
            if record["rank"] == self._rank:
                return None if record["world"] is None else int(record["world"])
        return None

    def _storage_step(self, manager: Any, snapshots: list[Any]) -> int | None:
        """The newest step listed on storage by this rank (names only: nothing opened), of the
        snapshots of the whole manager, which a RAM snapshot competes with (a ``snapshot_object``
        of a model alone, however new, is not a resumable step of the run)."""
        newest: int | None = None
        whole = [s for s in snapshots if getattr(s, "_target", None) is None]
        for snap in whole or snapshots:
            writer = getattr(snap, "writer", None) or manager.writer
            storage_for = getattr(writer, "storage_for", None)
            if not callable(storage_for) and type(writer).__module__.startswith(
                    "pytorch_pfn_extras."):  # ppe's default writer: the snapshot extension
                storage_for = resolve_storage  # writes with a snapkeep one into manager.out
            template = getattr(snap, "filename", None)
            if not callable(storage_for) or not isinstance(template, str):
                continue
            try:
                storage, directory = storage_for(manager.out)
                if callable(getattr(snap, "memory_state", None)):  # committed directories
                    from snapkeep.distributed import ShardedStore
                    entries = ShardedStore(storage, directory, template).entries()
                    steps = [e.step for e in entries if e.step is not None]
                else:
                    store = SnapshotStore(storage, directory, template)
                    steps = [e.step for e in store.entries() if e.step is not None]
                    steps += [s for s in _directory_steps(store) if s is not None]
            except Exception as e:  # an unreachable store: RAM can still be used
                logger.warning("memory tier: could not list %s: %s", template, e)
                continue
            if steps:
                newest = max(steps) if newest is None else max(newest, *steps)
        return newest

    def _inventory(self, previous_world: int | None) -> dict[str, Any]:
        root, job, rank = self.tier.root, self._job, self._rank
        if self._disabled is not None:
            return {"own": None, "held": {}}
        if previous_world is not None and previous_world != self._world:
            logger.warning("memory tier: held for world size %d, now %d; resuming from storage",
                           previous_world, self._world)
            return {"own": None, "held": {}}
        # from the manifests (step, checksum, size): no snapshot byte is read here; the copy
        # used is verified once, where it is read (_fetch)
        own = MemoryStore(root, job, rank).newest_listed()
        held: dict[int, tuple[int, str]] = {}
        for source in peer_sources(root, job, rank):
            found = MemoryStore(root, job, rank, source).newest_listed()
            if found is not None:
                held[source] = (found.step, found.checksum)
        return {"own": None if own is None else (own.step, own.checksum), "held": held}

    def _recover(self, manager: Any, snapshots: list[Any],
                 previous_world: int | None) -> Restored | None:
        control = None if self._groups is None else self._groups.control
        what = "memory tier recovery"
        mine = self._inventory(previous_world)
        mine["storage"] = self._storage_step(manager, snapshots)
        everyone = all_gather(control, mine, what=what, timeout_s=self.tier.timeout_s)
        storage_steps = [i["storage"] for i in everyone if i["storage"] is not None]
        storage_step = max(storage_steps) if storage_steps else None
        excluded: set[tuple[int, int]] = set()  # (rank, holder) copies that failed in use
        kept: dict[tuple[int, int], Any] = {}  # (step, source): this rank's copy, verified
        while True:
            plan = _plan(everyone, self._world, self._stride, excluded, storage_step)
            if plan is None:
                logger.info("memory tier: no step complete in RAM on every rank at or after "
                            "storage's (%s); resuming from storage", storage_step)
                return None
            step, sources = plan
            error = self._fetch(step, sources, everyone, control, kept)
            failures = all_gather(control, None if error is None else error,
                                  what=f"{what}: step {step}", timeout_s=self.tier.timeout_s)
            failed = {r: m for r, m in enumerate(failures) if m is not None}
            if not failed:
                break
            for r, message in failed.items():
                logger.warning("memory tier: rank %d could not use its copy of step %d from "
                               "%s: %s", r, step, _source_name(r, sources[r]), message)
                excluded.add((r, sources[r]))
        own = MemoryStore(self.tier.root, self._job, self._rank)
        path = own.storage.join(own.directory, f"ram_iter_{step}")
        error_load: BaseException | None = None
        state: Any = None
        template: dict[str, Any] = {}
        try:  # loaded and verified by _fetch (own copy or a peer's)
            state = kept.pop((step, sources[self._rank]))
            if isinstance(state, BaseException):
                raise state
        except Exception as e:  # every rank raises together below
            error_load = e
        kept.clear()
        if self._sharded is not None and error_load is None:
            checked = self._sharded_template(manager, state, step, control)
            if checked is None:
                return None
            template = checked
        if error_load is None:
            try:
                if self._sharded is not None:
                    _copy_into(template, state)  # the live local shards, in place
                    self._sharded.apply_memory_state(manager, template, path, step, self._rank)
                else:
                    with into_existing_state(optimizers_in(manager)):  # in place where shapes
                        manager.load_state_dict(live_tree(manager, state))  # match
            except Exception as e:  # every rank raises together below
                error_load = e
        exchange_outcomes(control, error_load, what=f"{what}: loading step {step}",
                          timeout_s=self.tier.timeout_s)
        source = _source_name(self._rank, sources[self._rank])
        if sources[self._rank] != self._rank:
            # taken from a peer: the own copy is not written back here (that would put a
            # second write of every byte before training resumes); the holder keeps its copy,
            # storage has the step (persisted first when newer), and the next RAM commit
            # rewrites the own copy
            try:
                self._own_tier()
            except Exception as e:  # best effort: written again at the first RAM commit
                logger.warning("memory tier: could not record the tier's owner: %s", e)
        logger.info("memory tier: rank %d resumed step %d from %s RAM (storage: %s)",
                    self._rank, step, source, storage_step)
        return Restored(step=step, source=source, storage_step=storage_step)

    def _sharded_template(self, manager: Any, state: Any, step: int,
                          control: Any) -> dict[str, Any] | None:
        """The live state to copy ``state`` (this rank's RAM snapshot of ``step``) into, after
        checking on every rank that it has the same keys, and each tensor the shape and dtype of
        the live local shard (same world size and sharding); None on every rank when some rank's
        does not match (logged: storage is used, which reshards)."""
        problem: str | None = None
        template: dict[str, Any] = {}
        try:
            template = self._sharded.memory_template(manager, set(_flatten(state)), self._rank)
            problems = _mismatches(template, state)
            if problems:
                problem = "; ".join(problems[:5]) + (
                    f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        except Exception as e:  # not loadable here: storage reshards
            problem = f"{type(e).__name__}: {e}"
        problems_all = all_gather(control, problem, what=f"memory tier: checking step {step}",
                                  timeout_s=self.tier.timeout_s)
        failed = {r: p for r, p in enumerate(problems_all) if p is not None}
        if failed:
            for r, p in failed.items():
                logger.warning("memory tier: rank %d's RAM snapshot of step %d does not match "
                               "its live state (different sharding or model?): %s; every rank "
                               "resumes from storage", r, step, p)
            return None
        return template

    def _fetch(self, step: int, sources: list[int], everyone: list[dict[str, Any]],
               control: Any, kept: dict[tuple[int, int], Any]) -> str | None:
        """Load this rank's copy of ``step`` into ``kept[(step, source)]`` (its own, or a
        peer's received), sending the copies it holds to the ranks that take theirs from it.
        Each copy used is read and hashed once, verified before use: the own copy in place
        through a memory map (:meth:`MemoryStore.load`), a peer copy by the receiving rank
        against the checksum its holder's manifest recorded at commit (the sender maps it and
        does not hash it: the receiver's check covers a copy damaged on the sender's tmpfs
        too). Returns the error of a copy that failed (None: usable); every rank agrees on
        these and the copies are excluded. A load failure that is not a corrupt copy is kept
        in ``kept`` and raised on every rank together."""
        rank = self._rank
        error: str | None = None
        source = sources[rank]
        if (step, source) not in kept:
            kept.clear()
        for r, holder in enumerate(sources):
            if holder == r:
                continue
            if rank == holder:
                mapped: Any = None
                try:
                    store = MemoryStore(self.tier.root, self._job, rank, r)
                    held = None if self._disabled else store.newest_listed()
                    if held is not None and held.step == step:
                        mapped = store.mapped(held)
                except SnapshotCorruptError:
                    mapped = None
                try:
                    _send(b"" if mapped is None else mapped, r, control)
                finally:
                    if mapped is not None:
                        with contextlib.suppress(BufferError):  # else closed when collected
                            mapped.close()
            elif rank == r:  # received again on a replan: its holder sends it again
                digest = everyone[holder]["held"][r][1]
                try:
                    kept[(step, holder)] = _recv_verified(holder, control, digest)
                except SnapshotCorruptError as e:
                    error = f"peer copy from rank {holder}: {e}"
                except Exception as e:  # not a corrupt copy: raised on every rank when loading
                    kept[(step, holder)] = e
        if source == rank and (step, rank) not in kept:
            own = MemoryStore(self.tier.root, self._job, rank)
            held = own.newest_listed()
            if held is None or held.step != step:
                error = f"own RAM copy of step {step} is gone"
            else:
                try:
                    kept[(step, rank)] = own.load(held)
                except SnapshotCorruptError as e:
                    error = str(e)
                except Exception as e:  # not a corrupt copy: raised on every rank when loading
                    kept[(step, rank)] = e
        return error

    # -- each trigger ------------------------------------------------------------------------
    def __call__(self, manager: Any) -> None:
        """Stage this rank's state (a consistent CPU copy into reused buffers, pinned for
        accelerator tensors), or borrow the copy a snapshot extension's writer staged at this
        iteration (no second staging, see the module docstring), then serialise, commit and
        copy it to peers in the background.

        Returns as soon as the copy is taken: the training loop may mutate its tensors then.
        When the previous RAM snapshot is still being committed, waits for it first (one in
        flight; logged at debug).

        Raises:
            SnapshotSaveError: the previous RAM snapshot failed in the background (serialise,
                tmpfs commit or peer copy); raised once, the original exception chained as
                ``__cause__``. This snapshot is not taken; the next trigger takes one.
            SnapshotTimeoutError: the previous one was still running after ``2 x timeout_s``.
        """
        step = int(manager.iteration)
        self._drain(f"RAM snapshot of step {step}")
        self._raise_background_error()
        if self._disabled is not None and not (self._replicas and self._groups is not None):
            return  # nothing to hold here, no peer waiting for this rank's copy
        self._own_tier()
        loan = None if self._sharded is not None else _borrow(manager)
        staged = None  # with a loan: the snapshot staged this step's state, no second staging
        if loan is None:
            if self._sharded is not None:  # this rank's local shards and its non-tensor state
                tree = self._sharded.memory_state(manager, self._rank)
            else:
                tree = canonical_tree(manager, manager.state_dict())
            if self._buffers is None:
                self._buffers = BufferSet()
            staged, _ = self._buffers.stage(tree)
            del tree
        self._in_flight, self._loan = step, loan
        self._thread = threading.Thread(
            target=self._commit_in_background, args=(step, staged, loan), daemon=True,
            name="snapkeep-memory-tier")
        self._thread.start()

    def _commit_in_background(self, step: int, staged: Any, loan: StagedLoan | None) -> None:
        """Serialise ``staged`` (``torch.save``), or the copy ``loan`` lends once it is final,
        commit it to this rank's tmpfs (atomic, with its XXH3 manifest; the newest step kept
        alone), then copy it to the peers. A failure is logged and kept for the next trigger or
        ``finalize``; a borrowed copy dropped for a staging race drops this RAM snapshot
        (logged)."""
        try:
            buf = io.BytesIO()
            if loan is not None:
                try:
                    loan.wait_staged(self.tier.timeout_s)  # the tier's bound, not the writer's
                    torch.save(loan.tree, buf)
                except StagingRaceError as e:
                    logger.warning("memory tier: no RAM snapshot of step %d: the snapshot "
                                   "whose staged copy it shares was dropped (%s)", step, e)
                    return
                finally:
                    loan.release()  # the writer may stage into those buffers again
            else:
                torch.save(staged, buf)
            del staged  # the staging buffers are free for the next trigger once this returns
            data = buf.getvalue()
            del buf
            if self._disabled is not None:  # held nowhere here; the peers still get a copy
                held = Held(step=step, path="", checksum=MemoryStore.digest(data),
                            size_bytes=len(data))
            else:
                held = MemoryStore(self.tier.root, self._job, self._rank).commit_state(
                    step, data, _write)
            if self._replicas and self._groups is not None:
                self._copy_to_peers(held, data)
        except BaseException as e:  # never stops training here: raised at the next trigger
            logger.error("memory tier: RAM snapshot of step %d failed: %s: %s", step,
                         type(e).__name__, e)
            self._error = (step, e)

    def _copy_to_peers(self, held: Held, data: bytes) -> None:
        group = self._groups.peer
        for i in range(1, self._replicas + 1):
            dst = (self._rank + self._stride * i) % self._world
            src = (self._rank - self._stride * i) % self._world
            header = torch.tensor([held.step, len(data)], dtype=torch.int64)
            digest = torch.frombuffer(bytearray(held.checksum.encode().ljust(64)),
                                      dtype=torch.uint8)
            got_header = torch.empty(2, dtype=torch.int64)
            got_digest = torch.empty(64, dtype=torch.uint8)
            _pairwise(group, [header, digest], [got_header, got_digest], dst, src)
            got = torch.empty(int(got_header[1]), dtype=torch.uint8)
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            _pairwise(group, [payload], [got], dst, src)
            checksum = bytes(got_digest.tolist()).decode().strip()
            if self._disabled is None:
                MemoryStore(self.tier.root, self._job, self._rank, src).commit_bytes(
                    int(got_header[0]), got.numpy().tobytes(), checksum)

    def _drain(self, waiter: str | None = None) -> None:
        """Wait for the RAM snapshot in flight (bounded by ``2 x timeout_s``).

        Raises:
            SnapshotTimeoutError: it is still running after that (it stays in flight: its
                staging buffers are not reused).
        """
        thread = self._thread
        if thread is None:
            return
        loan = self._loan
        if loan is not None and thread.is_alive():  # on the training thread: a safe point
            loan.handle.settle_here(self.tier.timeout_s)  # to validate the borrowed copy
        if waiter is not None and thread.is_alive():
            logger.debug("memory tier: %s waits for the RAM snapshot of step %s still being "
                         "committed (one in flight)", waiter, self._in_flight)
        bound = self.tier.timeout_s * 2
        thread.join(bound)
        if thread.is_alive():
            raise SnapshotTimeoutError(
                f"memory tier: the RAM snapshot of step {self._in_flight} was still being "
                f"committed after {bound:g} s (2 x MemoryTier timeout_s)")
        self._thread = self._loan = None

    def _raise_background_error(self) -> None:
        """Raise the failure of the last background RAM snapshot, once.

        Raises:
            SnapshotSaveError: chained from the original exception.
        """
        failed, self._error = self._error, None
        if failed is None:
            return
        step, cause = failed
        raise SnapshotSaveError(
            f"memory tier: the RAM snapshot of step {step} failed in the background: "
            f"{type(cause).__name__}: {cause}; older RAM and storage snapshots are intact"
        ) from cause

    def wait(self) -> None:
        """Wait for the RAM snapshot in flight: serialised, committed to tmpfs and copied to
        the peers (bounded by ``2 x timeout_s``). A failure of it is raised at the next trigger
        or at ``finalize``.

        Raises:
            SnapshotTimeoutError: still running after ``2 x timeout_s``.
        """
        self._drain()

    # -- end ---------------------------------------------------------------------------------
    def on_error(self, manager: Any, exc: Exception, tb: types.TracebackType) -> None:
        """Keep the tier: the run did not finish."""
        self._failed = True

    def finalize(self, manager: Any) -> None:
        """Wait for the RAM snapshot in flight; remove this rank's tier when the run finished
        (the stop trigger fired and no iteration raised); then raise a background failure not
        reported yet (logged instead after a failed iteration, whose error comes first).

        Raises:
            SnapshotSaveError: the last RAM snapshot failed in the background (see
                :meth:`__call__`).
            SnapshotTimeoutError: it was still running after ``2 x timeout_s``.
        """
        self._drain()
        self._buffers = None  # a finished tier keeps no staging copy of the state
        if self._started and not self._failed and self._disabled is None:
            try:
                finished = bool(manager.stop_trigger)
            except Exception:  # a manager without a stop trigger: treat the run as unfinished
                finished = False
            if finished:
                remove_rank(self.tier.root, self._job, self._rank)
                for departed in _ranks_beyond(self.tier.root, self._job, self._world):
                    remove_rank(self.tier.root, self._job, departed)  # a larger world's
        if self._failed and self._error is not None:
            step, cause = self._error
            self._error = None
            logger.error("memory tier: the RAM snapshot of step %d had failed in the "
                         "background: %s: %s", step, type(cause).__name__, cause)
            return
        self._raise_background_error()


def _ranks_beyond(root: str, job: str, world: int) -> list[int]:
    """Ranks >= ``world`` with a directory or owner record in ``job``'s tier under ``root``:
    left by an earlier run of the job on more ranks (no process of this run owns them)."""
    return [r for r in ranks_in(root, job) if r >= world]


def recover_before_autoload(manager: Any) -> None:
    """Initialize (and so recover) the manager's memory tiers now, before a snapshot
    extension's autoload reads storage: the snapshot extensions call it first thing in their
    ``initialize`` (the tier runs after them, see the module docstring)."""
    entries = getattr(manager, "_extensions", {})
    for entry in list(entries.values()):
        tier = getattr(entry, "extension", None)
        if isinstance(tier, _MemoryTierExtension):
            tier.initialize(manager)


def _say_if_before_snapshot(manager: Any, tier: _MemoryTierExtension) -> None:
    """Log (info) when the tier was registered before a snapshot extension of the whole
    manager: it then runs first at a step both take and stages its own copy."""
    order = [getattr(e, "extension", None) for e in getattr(manager, "_extensions", {}).values()]
    if not any(x is tier for x in order):
        return
    after = order[[x is tier for x in order].index(True) + 1:]
    if any(getattr(x, SNAPSHOT_MARKER, False) and getattr(x, "_target", True) is None
           for x in after):
        logger.info("memory tier: registered before the snapshot extension, so a step both "
                    "take is staged twice; extend the manager with the tier after the snapshot")


def _borrow(manager: Any) -> StagedLoan | None:
    """The staged copy of this iteration's state that a snapshot extension's writer took (a
    snapshot of the whole manager, fired earlier in this iteration), lent; None when none did."""
    for snap in _snapshot_extensions(manager):
        lend = getattr(snap, "lend_staged", None)
        loan = lend(manager) if callable(lend) else None
        if loan is not None:
            return loan
    return None


def _directory_steps(store: SnapshotStore) -> list[int | None]:
    """Steps of the template's directories (sharded snapshots), from one listing."""
    parsed = [store.template.parse(n) for n in store.storage.list_dirs(store.directory)]
    return [int(k[0]) for k in parsed if k]


def _flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of nested dicts by dotted key path (lists and tuples are leaves), as DCP
    flattens the keys of a sharded snapshot."""
    if not isinstance(state, dict):
        return {prefix: state}
    flat: dict[str, Any] = {}
    for key, value in state.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: its local shard
    return tensor if to_local is None else to_local()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


def _mismatches(template: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """How ``state`` (a RAM snapshot) differs from ``template`` (the live state): keys on one
    side only, tensors of another shape or dtype than the live local shard."""
    live, saved = _flatten(template), _flatten(state)
    problems = []
    for key in sorted(live.keys() | saved.keys()):
        if key not in saved:
            problems.append(f"{key}: not in the RAM snapshot")
        elif key not in live:
            problems.append(f"{key}: not in the live state")
        elif isinstance(live[key], torch.Tensor):
            mine, theirs = _local(live[key]), saved[key]
            if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape \
                    or theirs.dtype != mine.dtype:
                problems.append(f"{key}: saved {_describe(theirs)}, live {_describe(mine)}")
    return problems


def _copy_into(template: dict[str, Any], state: dict[str, Any]) -> None:
    """Copy ``state``'s tensors into ``template``'s (their local shards: the live memory) in
    place, and set its other leaves to ``state``'s (checked by :func:`_mismatches` first)."""
    with torch.no_grad():
        for key, value in state.items():
            if isinstance(template[key], dict):
                _copy_into(template[key], value)
            elif isinstance(template[key], torch.Tensor):
                _local(template[key]).copy_(value)
            else:
                template[key] = value


def _source_name(rank: int, holder: int) -> str:
    return "own" if holder == rank else f"peer{holder}"


def _plan(everyone: list[dict[str, Any]], world: int, stride: int,
          excluded: set[tuple[int, int]], storage_step: int | None,
          ) -> tuple[int, list[int]] | None:
    """The newest step every rank can take from RAM (at least ``storage_step``), and each
    rank's source (itself or a holder rank); None when there is none. The choice is the
    stores' one newest-valid-with-fallback (:func:`snapkeep.store.newest_valid`): a step that
    some rank cannot take from RAM is refused for every rank alike (the inventories are the same
    on every rank), and the next older step is tried."""
    steps: set[int] = set()
    for inv in everyone:
        if inv["own"] is not None:
            steps.add(inv["own"][0])
        steps.update(s for s, _ in inv["held"].values())
    candidates = [Listed(name=f"step {s}", key=(s,), step=s) for s in sorted(steps)
                  if storage_step is None or s >= storage_step]

    def sources_of(candidate: Listed) -> list[int]:
        step = candidate.step
        sources: list[int] = []
        missing: dict[int, str] = {}
        for r in range(world):
            own = everyone[r]["own"]
            if own is not None and own[0] == step and (r, r) not in excluded:
                sources.append(r)
                continue
            holders = [h for h in _holder_order(r, world, stride)
                       if everyone[h]["held"].get(r, (None,))[0] == step
                       and (r, h) not in excluded]
            if not holders:
                missing[r] = f"no usable copy of step {step} in RAM"
                continue
            sources.append(holders[0])
        if missing:
            raise CandidateRefused(missing)
        return sources

    found = newest_valid(candidates, sources_of, what="memory tier", required=False,
                         skipped=lambda candidate, error: None)
    return None if found is None else (int(found[0].step or 0), found[1])


def _holder_order(rank: int, world: int, stride: int) -> list[int]:
    """The ranks that may hold ``rank``'s copy, nearest replica first, then any other."""
    order = [(rank + stride * i) % world for i in range(1, world)]
    seen: list[int] = []
    for h in order + list(range(world)):
        if h != rank and h not in seen:
            seen.append(h)
    return seen


def _pairwise(group: Any, send: list[torch.Tensor], recv: list[torch.Tensor], dst: int,
              src: int) -> None:
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, t, dst, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, src, group) for t in recv]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _send(payload: Any, dst: int, group: Any) -> None:
    """Send ``payload`` (bytes, or a mapped file: sent from its pages, no copy) to ``dst``."""
    import torch.distributed as dist

    size = len(payload)
    dist.send(torch.tensor([size], dtype=torch.int64), dst, group=group)
    if size:
        with warnings.catch_warnings():  # only read: no copy of a read-only buffer
            warnings.filterwarnings("ignore", message=".*not writable.*")
            tensor = torch.frombuffer(payload, dtype=torch.uint8)
        dist.send(tensor, dst, group=group)
        del tensor


def _recv_verified(src: int, group: Any, checksum: str) -> Any:
    """The state sent by ``src`` (``torch.load``'d, ``weights_only``, CPU), its bytes checked
    against ``checksum`` first. The bytes land once in an anonymous memory file
    (``memfd_create``, where the system has it), are hashed in place and loaded mapped: no copy
    of them is made after the transfer.

    Raises:
        SnapshotCorruptError: nothing was sent, or the checksum differs.
    """
    import torch.distributed as dist

    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    n = int(size[0])
    if n == 0:
        raise SnapshotCorruptError("the holder has no copy of this step")
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        out = torch.empty(n, dtype=torch.uint8)
        dist.recv(out, src, group=group)
        data = out.numpy().tobytes()
        del out
        _check_digest(data, checksum)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    fd = os.memfd_create("snapkeep-peer-copy")
    try:
        os.ftruncate(fd, n)
        with mmap.mmap(fd, n) as buf:
            out = torch.frombuffer(buf, dtype=torch.uint8)
            dist.recv(out, src, group=group)
            del out
            _check_digest(buf, checksum)
        return torch.load(f"/proc/self/fd/{fd}", map_location="cpu", weights_only=True,
                          mmap=True)
    finally:
        os.close(fd)


def _check_digest(data: Any, checksum: str) -> None:
    got = MemoryStore.digest(data)
    if got != checksum:
        raise SnapshotCorruptError(f"checksum {got} differs from {checksum}")


def _write(data: bytes, f: Any) -> None:
    f.write(data)


__all__ = ["MemoryTier", "RESTORED_ATTRIBUTE", "Restored", "memory_tier"]
