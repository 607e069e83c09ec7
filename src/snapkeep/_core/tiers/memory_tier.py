"""The memory tier's engine: a layer in front of either store kind (single files or sharded
directories) that keeps each rank's state in node RAM with peer copies, used by every door (the
ppe extension :func:`snapkeep.training.extensions.memory_tier`, ``snapkeep.Checkpointer(...,
memory=MemoryTier(...))``), as Orbax's multi-tier manager sits in front of its storage.

A door holds one :class:`TierEngine` and calls, on the training thread::

    engine.open(state_bytes)                     # identity, claim, space check, stale reclaim
    restored = engine.recover(storage_step, apply, prepare=...)   # at most once, collective
    engine.save(step, build, borrow=...)         # every ``tier.every`` steps
    engine.wait()                                # the RAM snapshot in flight
    engine.close(finished=...)                   # drain; a finished run removes its tier

The engine knows no manager, model or optimizer: the door gives it the state tree to keep (a
callable building it: tensors staged into reused CPU buffers, the rest as is), the newest step
its storage lists, and callbacks applying a recovered tree into the live objects.

What one rank holds in its node's tmpfs (``root``, default ``/dev/shm``), at most: its own newest
step + one peer copy per rank it replicates for (``replicas`` of them) + one snapshot in flight,
i.e. ``(2 + replicas) x`` the size of its ``torch.save``'d state. Retention keeps the newest
complete step alone. The size is checked at :meth:`TierEngine.open` against the tmpfs's free
space (:class:`~snapkeep._core.errors.MemoryTierTooSmallError`, naming the size needed).

Saving: the training loop pays only for a consistent copy of the rank's state, staged into CPU
buffers reused across saves (:class:`~snapkeep._core.save.staging.BufferSet`), or for nothing when
the door lends the copy its writer staged at the same step (:class:`~snapkeep._core.save.ticket.
StagedLoan`: no second staging). A background thread serialises it (``torch.save``), commits it
to tmpfs (atomic, with its XXH3 manifest) and copies it to ``replicas`` peers on snapkeep's
``peer`` process group (gloo; never the training's). At most one RAM snapshot is in flight; a
background failure is raised once, as :class:`~snapkeep._core.errors.SnapshotSaveError` chained
from the original exception, at the next save or at close.

Recovery: every rank lists what its tmpfs holds (its own newest step and the peer copies: step
and checksum from their manifests, no snapshot byte read); all ranks exchange that inventory and
their storage's newest step in one bounded collective, and choose together the newest step that
every rank can take from RAM (own copy, else the first peer holding one) and that is at least
storage's. Each byte used is read and hashed once: the own copy is verified while it is loaded,
peer bytes are checked by the receiver against the owner's checksum; a copy that fails is
excluded on every rank and the choice made again, falling through to an older RAM step or to
storage. A different world size than the tier's falls back to storage. The door's ``prepare``
(e.g. checking local shards against the live ones) may refuse the step on any rank: every rank
then falls back to storage. The door's ``apply`` failing raises on every rank together.

Cleanup: :meth:`TierEngine.close` with ``finished=True`` removes the rank's tier, and the
directories of ranks beyond this world size that an earlier run on more ranks left; a crashed or
killed run leaves it for its restart. At open, tiers of other trainings whose owners are dead and
older than ``stale_after_s`` are reclaimed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from snapkeep._core.distributed.agreement import all_gather, exchange_outcomes
from snapkeep._core.distributed.groups import background_groups, is_distributed
from snapkeep._core.distributed.peer import pairwise, recv_verified, send_bytes
from snapkeep._core.errors import (
    SnapshotCorruptError,
    SnapshotSaveError,
    StagingRaceError,
)
from snapkeep._core.format.naming import FilenameTemplate
from snapkeep._core.load.resume_notice import say
from snapkeep._core.save.engine import SaveEngine
from snapkeep._core.save.staging import BufferSet
from snapkeep._core.save.ticket import StagedLoan
from snapkeep._core.store.contract import CandidateRefused, Listed, newest_valid
from snapkeep._core.store.files import SnapshotStore
from snapkeep._core.tiers.memory_store import (
    Held,
    Identity,
    MemoryStore,
    NotPrivateError,
    check_space,
    foreign_reason,
    forget_rank,
    job_id,
    owner_alive,
    owners,
    peer_sources,
    ranks_in,
    reclaim_stale,
    remove_rank,
    tier_bytes,
    tier_dir,
    write_owner,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryTier:
    """Configuration of the memory tier (see :mod:`snapkeep._core.tiers.memory_tier`).

    Attributes:
        every: commit to RAM every this many steps (iterations; int > 0).
        replicas: peer ranks receiving a copy of each rank's RAM snapshot (int >= 0, less than
            the world size; ignored in a single process).
        stride: peer ``i`` (1..replicas) of rank ``r`` is ``(r + stride*i) % world``. Default:
            ``LOCAL_WORLD_SIZE`` under torchrun when it is less than the world size (peers on
            other nodes), else 1.
        root: the tmpfs directory holding the tiers (default ``/dev/shm``); it must be yours
            or root's, and writable by other users only with the sticky bit (as ``/dev/shm``).
            Each tier under it is private (directories ``0700``, files ``0600``, no symlink
            followed, another user's never read, written or removed).
        job: the job id naming the tier (default: a hash of the user's uid, the snapshot
            directory and template, the same at every rerun of the training; never a per-launch
            id such as ``TORCHELASTIC_RUN_ID``). Whatever the name, a RAM snapshot is resumed
            only by the training (directory and template) recorded in its owner record.
        timeout_s: bound in seconds of every collective of the tier (agreement, peer copies).
        stale_after_s: a tier of another job whose owners are dead is reclaimed once its newest
            owner record is older than this (seconds).

    Raises:
        ValueError: a field out of range (named, with the accepted values).
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
        storage_step: the newest step listed on storage, over all ranks (None: none).
        sources: every rank's source, by rank (the same on every rank).
    """

    step: int
    source: str
    storage_step: int | None
    sources: tuple[str, ...] = ()

    def describe(self) -> str:
        """Where the ranks' states came from, in words: ``'own copy'`` (one rank), ``'own
        copies'``, or ``'own copies; rank 1 from rank 0's peer copy'``."""
        if len(self.sources) <= 1:
            return "own copy" if self.source == "own" else \
                f"rank {self.source[4:]}'s peer copy"
        taken = [f"rank {r} from rank {s[4:]}'s peer copy" for r, s in enumerate(self.sources)
                 if s != "own"]
        return "; ".join(["own copies", *taken] if len(taken) < len(self.sources) else taken)

    @property
    def newer_than_storage(self) -> bool:
        return self.storage_step is None or self.step > self.storage_step


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` (dicts, lists, tuples; a DTensor counts its local
    shard)."""
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            local = _local(item)
            total += local.numel() * local.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def local_shards(state: Any) -> Any:
    """``state`` (dicts, lists, tuples) with every DTensor replaced by its local tensor (a view
    of the live shard, no copy): what one rank keeps in RAM of a sharded state."""
    if isinstance(state, torch.Tensor) and hasattr(state, "to_local"):
        return state.to_local()
    if isinstance(state, dict):
        return {k: local_shards(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_shards(v) for v in state)
    return state


def check_into_live(template: dict[str, Any], state: dict[str, Any]) -> None:
    """Check that ``state`` (a RAM snapshot of local shards) has ``template``'s keys (the live
    state, e.g. DCP's state dicts of the live objects) and each tensor the shape and dtype of the
    live local shard.

    Raises:
        ValueError: the differences (at most 5 named).
    """
    problems = _mismatches(template, state)
    if problems:
        raise ValueError("; ".join(problems[:5]) + (
            f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))


def flat_keys(state: Any) -> set[str]:
    """The dotted key paths of ``state``'s leaves (nested dicts; lists and tuples are leaves),
    as DCP flattens the keys of a sharded snapshot."""
    return set(_flatten(state))


def copy_into_live(template: dict[str, Any], state: dict[str, Any]) -> None:
    """Copy ``state``'s tensors into ``template``'s (their local shards: the live memory) in
    place, and set its other leaves to ``state``'s (checked by :func:`check_into_live`
    first)."""
    _copy_into(template, state)


def newest_listed_step(storage: Any, directory: str, template: Any, *,
                       sharded: bool) -> int | None:
    """The newest step that ``template``'s snapshots in ``directory`` list (names and commit
    markers only: no snapshot opened): committed sharded directories when ``sharded``, else
    single files and the template's directories. What a RAM step competes with at recovery.

    Raises:
        SnapshotStorageError: the storage cannot be listed.
    """
    if sharded:
        from snapkeep._core.distributed.sharded_store import ShardedStore

        steps = [e.step for e in ShardedStore(storage, directory, template).entries()]
    else:
        store = SnapshotStore(storage, directory, template)
        steps = [e.step for e in store.entries()]
        parsed = [store.template.parse(n) for n in store.storage.list_dirs(store.directory)]
        steps += [int(k[0]) for k in parsed if k]  # sharded snapshots' directories
    known = [s for s in steps if s is not None]
    return max(known) if known else None


class TierEngine:
    """One rank's memory tier for one training (see the module docstring).

    Args:
        tier: the configuration.
        directory: the training's snapshot directory (absolute path or URL) and ``template``
            its snapshot template: together the training's identity (the tier's default job
            name, and what an owner record must hold for its RAM to be resumed).
        what: the door, for messages (``'memory tier'``).
    """

    def __init__(self, tier: MemoryTier, *, directory: str, template: FilenameTemplate | str,
                 what: str = "memory tier") -> None:
        if not isinstance(tier, MemoryTier):
            raise TypeError(f"memory must be a MemoryTier(every=..., ...), got {tier!r}")
        self.tier = tier
        self.what = what
        self.identity = Identity.of(directory, template)
        self.job = tier.job or job_id(directory, template)
        self.rank = 0
        self.world = 1
        self.groups: Any = None
        self.restored: Restored | None = None
        #: why the last :meth:`recover` resumed nothing from RAM (None: it resumed, none ran,
        #: or a first run: nothing held in RAM nor listed on storage)
        self.fallback: str | None = None
        self.disabled: str | None = None  # why this rank's tier cannot be used (logged once)
        self.opened = False
        # the RAM snapshot in flight (one), its failure raised once, drained at exit
        self._engine = SaveEngine("memory tier", wrap=_background_error,
                                  timeout_message=_still_committing)
        self._buffers: BufferSet | None = None  # the staged copy, reused across saves
        self._owner_written = False
        self._stride = 1
        self._replicas = 0
        self._previous_world: int | None = None
        self._loan: StagedLoan | None = None  # the loan the RAM snapshot in flight serialises
        self.last_step: int | None = None  # the newest step committed to RAM by this process

    # -- start ------------------------------------------------------------------------------
    def open(self, state_size: int) -> None:
        """Join snapkeep's process groups (collective under torch.distributed), check the
        tmpfs for ``(2 + replicas) x state_size`` bytes (the tensor bytes of this rank's state,
        see :func:`state_bytes`), claim this rank's tier, and reclaim dead trainings' tiers;
        once.

        Raises:
            MemoryTierTooSmallError: the tmpfs cannot hold the tier (size needed named).
            NotPrivateError: (a ``PermissionError``) other users could rename or delete what
                is in ``root``: writable by them without the sticky bit, or another user's.
            ValueError: ``replicas`` is not less than the world size, or ``stride`` makes a
                rank its own peer.
        """
        if self.opened:
            return
        self.opened = True
        tier = self.tier
        if is_distributed():
            self.groups = background_groups(tier.timeout_s)
            self.rank, self.world = self.groups.rank, self.groups.world_size
        if self.world > 1 and tier.replicas >= self.world:
            raise ValueError(f"MemoryTier replicas must be less than the world size "
                             f"({self.world}), got {tier.replicas}")
        self._replicas = tier.replicas if self.world > 1 else 0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self._stride = tier.stride if tier.stride is not None else (
            local if 0 < local < self.world else 1)
        if self._replicas and any((self._stride * i) % self.world == 0
                                  for i in range(1, self._replicas + 1)):
            raise ValueError(f"MemoryTier stride {self._stride} makes a rank its own peer with "
                             f"world size {self.world} and {self._replicas} replica(s)")
        check_space(tier.root, 0)  # the root exists and is safe to hold private directories
        self._claim()
        reclaim_stale(tier.root, keep=self.job, stale_after_s=tier.stale_after_s,
                      identity=self.identity)
        needed = int(state_size * (2 + self._replicas) * 1.05) + 2**20
        check_space(tier.root, needed, held_bytes=0 if self.disabled else tier_bytes(
            tier.root, self.job, self.rank))
        self._previous_world = self._recorded_world()

    def _claim(self) -> None:
        """Make sure this rank's RAM in the tier is this training's, or not used at all.

        - The tier directory is not a directory of this user (a symlink, a file, another
          user's, planted or not): this rank's tier is disabled for the run (one warning; it
          still takes part in the peer copies, holding nothing), and nothing is read, written
          or removed through it.
        - This rank's RAM belongs to another training (its owner record names another
          directory or template, or none): ignored, with one log line, and replaced (removed
          now) unless its owner still runs on this host, which then keeps it (this rank's tier
          disabled).
        """
        root, job, rank, identity = self.tier.root, self.job, self.rank, self.identity
        try:
            reason = foreign_reason(root, job, rank, identity)
        except NotPrivateError as e:
            self.disabled = str(e)
            logger.warning("memory tier: rank %d takes no RAM snapshots this run: %s (pass "
                           "another MemoryTier root= or job=)", rank, e)
            return
        if reason is None:
            return
        live = [r for r in owners(tier_dir(root, job)) if r["rank"] == rank and owner_alive(r)
                and r["pid"] != os.getpid()]
        if live:
            self.disabled = f"{reason}, in use by pid {live[0]['pid']}"
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
        never writes to RAM, e.g. one started after its last step, creates no tier)."""
        if not self._owner_written and self.disabled is None:
            write_owner(self.tier.root, self.job, self.rank, world=self.world,
                        identity=self.identity)
            self._owner_written = True

    def _recorded_world(self) -> int | None:
        if self.disabled is not None:
            return None
        for record in owners(tier_dir(self.tier.root, self.job)):
            if record["rank"] == self.rank:
                return None if record["world"] is None else int(record["world"])
        return None

    def _inventory(self) -> dict[str, Any]:
        root, job, rank, previous = self.tier.root, self.job, self.rank, self._previous_world
        if self.disabled is not None:
            return {"own": None, "held": {}}
        if previous is not None and previous != self.world:
            logger.warning("memory tier: held for world size %d, now %d; resuming from storage",
                           previous, self.world)
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

    # -- recovery ----------------------------------------------------------------------------
    def recover(self, storage_step: int | None, apply: Callable[[Any, int, str], None], *,
                prepare: Callable[[Any], Any] | None = None) -> Restored | None:
        """Resume from RAM when every rank can (collective; see the module docstring).

        Args:
            storage_step: the newest step this rank's storage lists (names only; None: none).
                The newest over all ranks is the floor: an older RAM step is not used.
            apply: ``apply(tree, step, path)`` sets the live objects from ``tree`` (this rank's
                RAM snapshot, verified, or what ``prepare`` made of it) of ``step`` (``path``:
                where it was held, for messages). Its failure on any rank raises on every rank.
            prepare: ``prepare(tree)`` checks the snapshot against the live state before
                anything is applied and returns what ``apply`` gets; raising refuses the step
                on every rank (logged): every rank then resumes from storage.

        Returns:
            What was restored, or None (resume from storage; :attr:`fallback` says why).

        Raises:
            CollectiveTimeoutError: a rank did not take part in time.
            RankFailedError: ``apply`` failed on some rank (named); on that rank its error.
        """
        self.fallback = None
        control = None if self.groups is None else self.groups.control
        what = "memory tier recovery"
        mine = self._inventory()
        mine["storage"] = storage_step
        everyone = all_gather(control, mine, what=what, timeout_s=self.tier.timeout_s)
        storage_steps = [i["storage"] for i in everyone if i["storage"] is not None]
        floor = max(storage_steps) if storage_steps else None
        excluded: set[tuple[int, int]] = set()  # (rank, holder) copies that failed in use
        kept: dict[tuple[int, int], Any] = {}  # (step, source): this rank's copy, verified
        refused: list[str] = []
        while True:
            plan = _plan(everyone, self.world, self._stride, excluded, floor)
            if plan is None:
                held = any(i["own"] is not None or i["held"] for i in everyone)
                if not held and not refused:  # a finished run removed it, or the RAM is gone
                    reason = ("nothing held in RAM (the last run finished and removed it, or "
                              "the node's RAM was lost)")
                else:
                    reason = ("no step held in RAM by every rank" + (
                        "" if floor is None else f" is at least storage's newest (step {floor})")
                        + (f" ({'; '.join(refused)})" if refused else ""))
                logger.info("memory tier: %s; resuming from storage", reason)
                # nothing held anywhere nor on storage (a first run): nothing to say
                self.fallback = reason if held or refused or floor is not None else None
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
                refused.append(f"rank {r}'s copy of step {step} from "
                               f"{_source_name(r, sources[r])}: {message}")
                excluded.add((r, sources[r]))
        own = MemoryStore(self.tier.root, self.job, self.rank)
        path = own.storage.join(own.directory, f"ram_iter_{step}")
        error_load: BaseException | None = None
        tree: Any = None
        try:  # loaded and verified by _fetch (own copy or a peer's)
            tree = kept.pop((step, sources[self.rank]))
            if isinstance(tree, BaseException):
                raise tree
        except Exception as e:  # every rank raises together below
            error_load = e
        kept.clear()
        if prepare is not None and error_load is None:
            problem: str | None = None
            try:
                tree = prepare(tree)
            except Exception as e:  # not loadable here: storage (which reshards) is used
                problem = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) \
                    else str(e)
            problems = all_gather(control, problem, what=f"memory tier: checking step {step}",
                                  timeout_s=self.tier.timeout_s)
            mismatched = {r: p for r, p in enumerate(problems) if p is not None}
            if mismatched:
                for r, p in mismatched.items():
                    logger.warning("memory tier: rank %d's RAM snapshot of step %d does not "
                                   "match its live state (different sharding or model?): %s; "
                                   "every rank resumes from storage", r, step, p)
                r, p = next(iter(mismatched.items()))
                self.fallback = (f"rank {r}'s RAM snapshot of step {step} does not match its "
                                 f"live state: {p}")
                return None
        if error_load is None:
            try:
                apply(tree, step, path)
            except Exception as e:  # every rank raises together below
                error_load = e
        del tree
        exchange_outcomes(control, error_load, what=f"{what}: loading step {step}",
                          timeout_s=self.tier.timeout_s)
        source = _source_name(self.rank, sources[self.rank])
        if sources[self.rank] != self.rank:
            # taken from a peer: the own copy is not written back here (that would put a
            # second write of every byte before training resumes); the holder keeps its copy,
            # storage has the step (persisted first when newer), and the next RAM commit
            # rewrites the own copy
            try:
                self._own_tier()
            except Exception as e:  # best effort: written again at the first RAM commit
                logger.warning("memory tier: could not record the tier's owner: %s", e)
        logger.info("memory tier: rank %d resumed step %d from %s RAM (storage: %s)",
                    self.rank, step, source, floor)
        self.restored = Restored(step=step, source=source, storage_step=floor,
                                 sources=tuple(_source_name(r, h) for r, h in enumerate(sources)))
        return self.restored

    def announce(self, *, quiet: bool = False) -> None:
        """Say on stderr (rank 0, unless ``quiet``; logged at INFO on every rank) what the
        last :meth:`recover` did, as the storage resume notice does: ``snapkeep: resuming from
        RAM step N (own copy; storage's newest: M) in <tier>``, or why RAM was not used
        (``snapkeep: memory tier (<tier>): <reason>; resuming from storage``); nothing on a
        first run."""
        where = tier_dir(self.tier.root, self.job)
        if self.restored is not None:
            r = self.restored
            say(f"resuming from RAM step {r.step} ({r.describe()}; storage's newest: "
                f"{r.storage_step}) in {where}", quiet=quiet, rank=self.rank)
        elif self.fallback is not None:
            say(f"memory tier ({where}): {self.fallback}; resuming from storage", quiet=quiet,
                rank=self.rank)

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
        rank = self.rank
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
                    store = MemoryStore(self.tier.root, self.job, rank, r)
                    held = None if self.disabled else store.newest_listed()
                    if held is not None and held.step == step:
                        mapped = store.mapped(held)
                except SnapshotCorruptError:
                    mapped = None
                try:
                    send_bytes(b"" if mapped is None else mapped, r, control)
                finally:
                    if mapped is not None:
                        with contextlib.suppress(BufferError):  # else closed when collected
                            mapped.close()
            elif rank == r:  # received again on a replan: its holder sends it again
                digest = everyone[holder]["held"][r][1]
                try:
                    kept[(step, holder)] = recv_verified(holder, control, digest,
                                                         check=_check_digest)
                except SnapshotCorruptError as e:
                    error = f"peer copy from rank {holder}: {e}"
                except Exception as e:  # not a corrupt copy: raised on every rank when loading
                    kept[(step, holder)] = e
        if source == rank and (step, rank) not in kept:
            own = MemoryStore(self.tier.root, self.job, rank)
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

    # -- saving ------------------------------------------------------------------------------
    def save(self, step: int, build: Callable[[], Any],
             borrow: Callable[[], StagedLoan | None] | None = None) -> None:
        """Keep ``build()`` (this rank's state tree at ``step``) in RAM: stage it (a consistent
        CPU copy into reused buffers, pinned for accelerator tensors), or take the copy
        ``borrow()`` lends (a writer's staging of the same step: no second staging), then
        serialise, commit and copy it to the peers in the background.

        Returns as soon as the copy is taken: the training loop may mutate its tensors then.
        When the previous RAM snapshot is still being committed, waits for it first (one in
        flight; logged at debug).

        Raises:
            SnapshotSaveError: the previous RAM snapshot failed in the background (serialise,
                tmpfs commit or peer copy); raised once, the original exception chained as
                ``__cause__``. This snapshot is not taken; the next save takes one.
            SnapshotTimeoutError: the previous one was still running after ``2 x timeout_s``.
            RuntimeError: :meth:`open` was not called.
        """
        if not self.opened:
            raise RuntimeError("memory tier: save before open")
        self._drain(f"RAM snapshot of step {step}")
        self._engine.raise_pending_error()
        if self.disabled is not None and not (self._replicas and self.groups is not None):
            return  # nothing to hold here, no peer waiting for this rank's copy
        self._own_tier()
        loan = None if borrow is None else borrow()
        staged = None  # with a loan: the writer staged this step's state, no second staging
        if loan is None:
            tree = build()
            if self._buffers is None:
                self._buffers = BufferSet()
            staged, _ = self._buffers.stage(tree)
            del tree
        self._loan = loan
        self._engine.submit(self._commit_in_background, step, staged, loan,
                            label=f"RAM snapshot of step {step}")

    def _commit_in_background(self, step: int, staged: Any, loan: StagedLoan | None) -> None:
        """Serialise ``staged`` (``torch.save``), or the copy ``loan`` lends once it is final,
        commit it to this rank's tmpfs (atomic, with its XXH3 manifest; the newest step kept
        alone), then copy it to the peers. A failure is logged and kept by the engine for the
        next save or close; a borrowed copy dropped for a staging race drops this RAM snapshot
        (logged)."""
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
        del staged  # the staging buffers are free for the next save once this returns
        data = buf.getvalue()
        del buf
        if self.disabled is not None:  # held nowhere here; the peers still get a copy
            held = Held(step=step, path="", checksum=MemoryStore.digest(data),
                        size_bytes=len(data))
        else:
            held = MemoryStore(self.tier.root, self.job, self.rank).commit_state(
                step, data, _write)
        if self._replicas and self.groups is not None:
            self._copy_to_peers(held, data)
        self.last_step = step

    def _copy_to_peers(self, held: Held, data: bytes) -> None:
        group = self.groups.peer
        for i in range(1, self._replicas + 1):
            dst = (self.rank + self._stride * i) % self.world
            src = (self.rank - self._stride * i) % self.world
            header = torch.tensor([held.step, len(data)], dtype=torch.int64)
            digest = torch.frombuffer(bytearray(held.checksum.encode().ljust(64)),
                                      dtype=torch.uint8)
            got_header = torch.empty(2, dtype=torch.int64)
            got_digest = torch.empty(64, dtype=torch.uint8)
            pairwise(group, [header, digest], [got_header, got_digest], dst, src)
            got = torch.empty(int(got_header[1]), dtype=torch.uint8)
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            pairwise(group, [payload], [got], dst, src)
            checksum = bytes(got_digest.tolist()).decode().strip()
            if self.disabled is None:
                MemoryStore(self.tier.root, self.job, self.rank, src).commit_bytes(
                    int(got_header[0]), got.numpy().tobytes(), checksum)

    def _drain(self, waiter: str | None = None) -> None:
        """Wait for the RAM snapshot in flight (bounded by ``2 x timeout_s``).

        Raises:
            SnapshotTimeoutError: it is still running after that (it stays in flight: its
                staging buffers are not reused).
        """
        loan = self._loan
        if self._engine.busy:
            if loan is not None:  # on the training thread: a safe point
                loan.handle.settle_here(self.tier.timeout_s)  # to validate the borrowed copy
            if waiter is not None:
                logger.debug("memory tier: %s waits for the %s still being committed (one in "
                             "flight)", waiter, ", ".join(self._engine.pending_paths()))
        self._engine.join(self.tier.timeout_s * 2)
        self._loan = None

    def wait(self) -> None:
        """Wait for the RAM snapshot in flight: serialised, committed to tmpfs and copied to
        the peers (bounded by ``2 x timeout_s``). A failure of it is raised at the next save
        or at :meth:`close`.

        Raises:
            SnapshotTimeoutError: still running after ``2 x timeout_s``.
        """
        self._drain()

    # -- end ---------------------------------------------------------------------------------
    def close(self, *, finished: bool, failed: bool = False) -> None:
        """Wait for the RAM snapshot in flight; remove this rank's tier when the run
        ``finished`` (and the directories of ranks beyond this world size); then raise a
        background failure not reported yet (logged instead when the run ``failed``: its own
        error comes first). Idempotent once the failure was raised.

        Raises:
            SnapshotSaveError: the last RAM snapshot failed in the background.
            SnapshotTimeoutError: it was still running after ``2 x timeout_s``.
        """
        self._drain()
        self._buffers = None  # a closed tier keeps no staging copy of the state
        if self.opened and finished and not failed and self.disabled is None:
            remove_rank(self.tier.root, self.job, self.rank)
            for departed in _ranks_beyond(self.tier.root, self.job, self.world):
                remove_rank(self.tier.root, self.job, departed)  # a larger world's
        if failed:  # the run's own error comes first: the tier's is logged
            for label, cause in self._engine.take_errors():
                logger.error("memory tier: the %s had failed in the background: %s: %s",
                             label, type(cause).__name__, cause)
        self._engine.close()  # nothing runs now: raises a failure not raised yet


def _background_error(label: str, cause: BaseException) -> SnapshotSaveError:
    """What the tier raises for a failed RAM snapshot (the engine chains ``cause``)."""
    return SnapshotSaveError(
        f"memory tier: the {label} failed in the background: {type(cause).__name__}: {cause}; "
        "older RAM and storage snapshots are intact")


def _still_committing(labels: list[str], timeout_s: float) -> str:
    return (f"memory tier: the {', '.join(labels)} was still being committed after "
            f"{timeout_s:g} s (2 x MemoryTier timeout_s)")


def _ranks_beyond(root: str, job: str, world: int) -> list[int]:
    """Ranks >= ``world`` with a directory or owner record in ``job``'s tier under ``root``:
    left by an earlier run of the job on more ranks (no process of this run owns them)."""
    return [r for r in ranks_in(root, job) if r >= world]


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
            if key not in template:  # a dict without leaves (the live state has none either:
                continue  # e.g. no rank objects), which DCP's flat keys and _mismatches omit
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


def _check_digest(data: Any, checksum: str) -> None:
    got = MemoryStore.digest(data)
    if got != checksum:
        raise SnapshotCorruptError(f"checksum {got} differs from {checksum}")


def _write(data: bytes, f: Any) -> None:
    f.write(data)


__all__ = ["MemoryTier", "Restored", "TierEngine", "check_into_live", "copy_into_live",
           "flat_keys", "local_shards", "newest_listed_step", "state_bytes"]
