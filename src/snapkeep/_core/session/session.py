"""The engine session: what one trainer does with one store, whichever door it came through.

A door (ppe's snapshot extensions, the plain-loop ``Checkpointer``, the Lightning and Hugging
Face adapters) holds one :class:`Session` per store it writes (either kind: single files or
sharded directories, :class:`~snapkeep._core.store.contract.StoreKind`), and calls, in this order,
on the training thread::

    session.open()                      # once: list, kind check, lock, sweep (one order)
    run = session.run_control(...)      # the run status, preemption hook, deadline, exit
    session.resume(load, apply)         # at most once (single files; sharded: its own agreement)
    session.save(writer, name, ...)     # each save: retention input check, the door's
                                        # pre-write step, the writer (stage + commit), whose
                                        # Retain stage runs after the commit
    session.close()                     # idempotent: the lock is released, handlers put back

so that every door has the same start-up, the same lineage (what retention may count and
delete), the same refusal of a misspelled ``KeepBest`` metric before anything is deleted, and
the same resume notice on stderr. What differs between doors is only how their state maps to a
tree (the door's own code) and which writer commits it.

Which rank calls what: the rank that writes the store (the saver rank, or rank 0 of sharded
snapshots) calls :meth:`Session.open` with ``opener=True``; with a ``control`` process group
every rank calls it and the outcome is exchanged, so every rank raises the same error or none.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from snapkeep._core.distributed.agreement import (
    agree_on_resume,
    all_gather,
    broadcast_object,
    exchange_outcomes,
    together,
)
from snapkeep._core.errors import (
    SnapshotCorruptError,
    SnapshotStorageError,
    StateMismatchError,
    UnsafeSnapshotError,
)
from snapkeep._core.load.loading import load_file
from snapkeep._core.load.one_pass import one_pass_loader
from snapkeep._core.load.preflight import check_writable
from snapkeep._core.load.resume_notice import (
    FOREIGN_SHARDED,
    INCOMPLETE_SHARDED,
    ResumeNotice,
    Skipped,
    announce,
    skipped_on_ranks,
)
from snapkeep._core.load.structure import describe
from snapkeep._core.session.run_control import RunControl
from snapkeep._core.store.contract import StoreKind, newest_valid
from snapkeep._core.store.files import Entry, Retain, SnapshotStore
from snapkeep._core.store.lineage import RunLineage
from snapkeep._core.store.retention import RetentionPolicy
from snapkeep._core.store.retention_check import MetricCheck

logger = logging.getLogger(__name__)


class Session:
    """One trainer's session on one store (see the module docstring for the call order).

    Args:
        store: the store (either kind) of the door's template in its directory.
        policy: the retention policy applied after each commit (None keeps everything).
        lineage: the run lineage (shared by the doors of one trainer, e.g. the snapshot
            extensions of one manager); default a fresh one.
        quiet: no resume notice on stderr (it is still logged at INFO).
        shown_template: the door's name for its snapshots in messages (Lightning's
            ``'*.ckpt'``); default the template as its user wrote it
            (:attr:`FilenameTemplate.text`).
        door: the door's name (``'checkpointer'``, ``'ppe'``, ``'lightning'``): recorded in
            the manifest of each snapshot it saves, and its resume takes only snapshots
            recording it (or none): another door's is skipped, named (:meth:`own`). Empty
            (default): every snapshot is taken, nothing recorded.
    """

    def __init__(self, store: StoreKind, *, policy: RetentionPolicy | None = None,
                 lineage: RunLineage | None = None, quiet: bool = False,
                 shown_template: str | None = None, door: str = "") -> None:
        self.store = store
        self.door = door
        self._foreign: dict[str, Skipped] = {}  # path -> another door's snapshot, for the notice
        self.policy = policy
        self.lineage = RunLineage.fresh() if lineage is None else lineage
        self.quiet = quiet
        self.shown_template = store.template.text if shown_template is None else shown_template
        self._metric_check = MetricCheck(policy)
        self._lock: Any = None
        self.opened = False
        self.run: RunControl | None = None

    def __repr__(self) -> str:
        return f"Session({self.store!r}, lineage={self.lineage.run_id})"

    # -- open ----------------------------------------------------------------------------------
    def open(self, *, lock: bool = True, opener: bool = True, control: Any = None,
             timeout_s: float | None = None, claim: Callable[[], None] | None = None,
             before_sweep: Callable[[StoreKind], None] | None = None) -> None:
        """The store's start-up, in one order: create the directory, check it is writable,
        take the one-trainer lock, list it once (held: later saves do not list), refuse a
        template naming snapshots of the other kind, and sweep snapkeep's own unfinished work.

        Args:
            lock: take the store lock (False: a reader, or a door that locks elsewhere).
            opener: this rank writes the store and runs the start-up (the others only hear the
                outcome through ``control``).
            control: a process group to exchange the outcome on (None: single process).
            timeout_s: bound of that exchange, seconds.
            claim: run first on the opener (the Checkpointer's check for another open one in
                this process); its error is exchanged like the store's.
            before_sweep: called with the store after the listing and before the sweep (the
                sharded extension notes the incomplete directories the sweep will remove).

        Raises:
            StoreLockedError: another live trainer holds the directory.
            ValueError: the template already names snapshots of the other kind here (named
                with ``shown_template``).
            SnapshotStorageError: the directory cannot be created or written.
            RankFailedError: with ``control``, the start-up failed on the opener (every rank).
        """
        error: BaseException | None = None
        if opener:
            try:
                if claim is not None:
                    claim()
                self._start(lock=lock, before_sweep=before_sweep)
            except Exception as e:
                error = e
        if control is None:
            if error is not None:
                self.close()
                raise error
            self.opened = True
            return
        try:
            exchange_outcomes(control, error, what=f"starting {self.shown_template!r} in "
                              f"{self.store.directory!r}", timeout_s=timeout_s)
        except BaseException as e:
            self.close()
            if error is not None:
                raise error from e  # the opener keeps the store's own error type
            raise
        self.opened = True

    def _start(self, *, lock: bool, before_sweep: Callable[[StoreKind], None] | None) -> None:
        store = self.store
        store.storage.makedirs(store.directory)
        check_writable(store.storage, store.directory)
        if lock and self._lock is None:
            self._lock = store.lock()
        store.hold_listing()  # the lock holder alone writes here: list once
        try:
            store.check_kind()
        except ValueError as e:  # named as the door names its template, not its translation
            message = str(e)
            for spelled in {store.template.text, str(store.template.template)}:
                message = message.replace(repr(spelled), repr(self.shown_template))
            raise ValueError(message) from None
        if before_sweep is not None:
            before_sweep(store)
        store.sweep(self.lineage.members)

    # -- resume --------------------------------------------------------------------------------
    def resume(
        self, apply: Callable[[Entry, Any], None], *,
        check: Callable[[Entry, Any], Any] | None = None, candidates: list[Entry] | None = None,
        verify_while_loading: bool = True, map_location: Any = "cpu", weights_only: bool = True,
    ) -> Entry | None:
        """Resume from the newest valid single-file snapshot: verify it against its manifest
        (while it is loaded, one read, for local files), fall back past each one that fails,
        ``apply`` the state (the door's all-or-nothing load into its live objects), continue
        its lineage, and say what happened on stderr (rank 0, unless ``quiet``): the snapshot
        resumed from and each one skipped, or that the run starts fresh.

        Args:
            check: ``check(entry, state) -> state`` on each loaded state (the door's format
                check: ``SnapshotCorruptError`` skips the snapshot); default none.
            apply: ``apply(entry, state)`` loads ``state`` into the live objects, or raises
                (``StateMismatchError``) having loaded nothing.
            candidates: the snapshots to consider (default: the store's listing).
            verify_while_loading: verify local files while they are loaded (one pass).
            map_location: as ``torch.load``'s.
            weights_only: as ``torch.load``'s (safe loading by default: see
                :func:`snapkeep._core.load.loading.load_file`).

        Returns:
            The entry resumed from, or None (no snapshot: a first run).

        Raises:
            NoValidSnapshotError: snapshots exist but none is valid (each reason listed).
            StateMismatchError, UnsafeSnapshotError: from ``apply`` / ``load``; nothing loaded.
        """
        store = self._single_file("resume")
        candidates = self.own(store.entries() if candidates is None else candidates)
        notice = ResumeNotice(directory=store.storage.url(store.directory),
                              template=self.shown_template)
        skipped: list[Skipped] = list(self._foreign.values())
        if not candidates:
            announce(dataclasses.replace(notice, skipped=tuple(skipped)), quiet=self.quiet)
            return None
        found = self.read_newest(check=check, candidates=candidates,
                                 verify_while_loading=verify_while_loading,
                                 map_location=map_location, weights_only=weights_only,
                                 on_skip=lambda e, why: skipped.append(
                                     Skipped(name=e.name, step=e.step, reason=why)))
        if found is None:
            return None
        entry, state = found
        apply(entry, state)
        self.lineage.adopt(store, candidates, entry)
        announce(dataclasses.replace(notice, loaded=entry.name, step=entry.step,
                                     skipped=tuple(skipped)), quiet=self.quiet)
        return entry

    def own(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` without the snapshots another door wrote (their manifest records
        another ``door``: a Checkpointer's ``ckpt_100`` in a Lightning ``dirpath`` holds no
        Lightning checkpoint): skipped, never loaded into this door, each named on stderr by
        the next resume notice (:meth:`resume`: ``snapkeep: skipped ckpt_100 (step 100): a
        snapshot of the checkpointer door ...``). Snapshots recording no door (written before
        doors were recorded, by ppe, or without a manifest) are kept: the door's format check
        decides.
        Without a ``door`` (a reader), ``entries`` unchanged. Reads each entry's manifest
        (single-file stores; other kinds unchanged).
        """
        store = self.store
        if not self.door or not isinstance(store, SnapshotStore):
            return entries
        kept = []
        for entry in entries:
            manifest = store.manifest(entry)
            other = manifest.door if manifest is not None else ""
            if other and other != self.door:
                self._foreign[entry.path] = Skipped(
                    name=entry.name, step=entry.step,
                    reason=f"a snapshot of the {other} door, not of this {self.door} door's "
                           "run: never loaded here (keep each door's snapshots in a directory "
                           "of their own)")
                continue
            kept.append(entry)
        return kept

    def read_newest(
        self, *, check: Callable[[Entry, Any], Any] | None = None,
        candidates: list[Entry] | None = None, verify_while_loading: bool = True,
        map_location: Any = "cpu", weights_only: bool = True,
        on_skip: Callable[[Entry, str], None] | None = None,
    ) -> tuple[Entry, Any] | None:
        """The newest valid single-file snapshot and its state, verified while it is loaded (one
        read of a local file), falling back past each one that fails: what :meth:`resume`
        applies, and what the read-only doors (:func:`snapkeep.load_latest`) return. Nothing is
        locked, applied or announced.

        Args:
            check: ``check(entry, state) -> state`` (the door's format check), as ``resume``'s.
            candidates: the snapshots to consider (default: the store's listing).
            verify_while_loading: verify local files while they are loaded (one pass).
            map_location: as ``torch.load``'s.
            weights_only: as ``torch.load``'s.
            on_skip: ``on_skip(entry, reason)`` for each snapshot skipped (default: a
                ``RuntimeWarning`` naming it).

        Returns:
            ``(entry, state)``, or None when there is no snapshot at all.

        Raises:
            NoValidSnapshotError: snapshots exist but none is valid (each reason listed).
            UnsafeSnapshotError: the newest valid one needs ``weights_only=False``.
            SnapshotStorageError: the storage could not be reached.
        """
        store = self._single_file("read_newest")
        checked = check or (lambda entry, state: state)

        def load(entry: Entry, data: bytes | None) -> Any:  # the file's bytes: remote stores
            return checked(entry, load_file(store.storage, entry.path, data=data,
                                            map_location=map_location,
                                            weights_only=weights_only))

        one_pass = one_pass_loader(store, load, checked,
                                   weights_only=weights_only, map_location=map_location
                                   ) if verify_while_loading else None
        return store.load_newest(load, candidates=candidates, one_pass=one_pass,
                                 on_skip=on_skip)

    def _single_file(self, what: str) -> SnapshotStore:
        store = self.store
        if not isinstance(store, SnapshotStore):
            raise TypeError(f"{self!r}: {what}() is for single-file stores; sharded snapshots "
                            "resume through their cross-rank agreement (resume_sharded)")
        return store

    def resume_agreed(
        self, apply: Callable[[Entry, Any], None], *, control: Any, rank: int, saver_rank: int,
        timeout_s: float | None = None, candidates: list[Entry] | None = None,
        map_location: Any = "cpu", weights_only: bool = True,
    ) -> Entry | None:
        """Resume from the single-file snapshot the saver rank verifies, on every rank
        together (collective on ``control``: every rank calls it), for replicated training whose
        snapshots one rank writes (ppe's ``_DistributedSnapshot``):

        1. every rank lists its directory (``candidates``); the candidates are the union,
           newest first;
        2. the saver rank verifies each (the store's one check: checksum, decode, misnamed)
           until one passes; one it lacks or cannot verify is skipped by every rank together;
        3. every other rank uses its own copy when that verifies, else receives the saver
           rank's verified bytes (one broadcast): node-local directories work;
        4. every rank loads it safely and ``apply``-s it; the outcomes are exchanged, so a rank
           that fails makes every rank raise the same error naming it.

        Then the lineage is continued and the resume said on stderr once (rank 0), with the
        ranks' reasons for each snapshot skipped.

        Args:
            apply: ``apply(entry, state)`` loads ``state`` into the live objects or raises
                having loaded nothing.
            control: snapkeep's control process group (None: one process).
            rank: this rank.
            saver_rank: the rank whose snapshots are the truth.
            timeout_s: the group's timeout (for the error messages), seconds.
            candidates: this rank's snapshots (default: its store's listing).
            map_location: as ``torch.load``'s.
            weights_only: as ``torch.load``'s.

        Returns:
            The entry resumed from (the same on every rank), or None when no rank has one.

        Raises:
            NoCommonSnapshotError: snapshot files exist but the saver rank can verify none.
            RankFailedError: loading or applying failed on some rank (named, on every rank).
            CollectiveTimeoutError: a rank did not take part within ``timeout_s``.
        """
        store = self._single_file("resume_agreed")
        entries = self.own(store.entries() if candidates is None else candidates)
        by_name = {e.name: e for e in entries}
        # the same on every rank (node-local directories differ): the messages must be equal
        what = f"resuming {store.template.text!r} (saver rank {saver_rank})"

        def entry_of(name: str) -> Entry:
            found = by_name.get(name)
            if found is not None:
                return found
            key = store.template.parse(name) or ()
            return Entry(name=name, path=store.storage.join(store.directory, name), key=key,
                         step=int(key[0]) if key else None)

        def load(entry: Entry, data: bytes | None) -> Any:
            return load_file(store.storage, entry.path, map_location=map_location,
                             weights_only=weights_only, data=data)

        verified: dict[str, bytes | None] = {}

        def check(name: str) -> str | None:
            if rank != saver_rank:
                return None  # uses its own verified copy or receives the saver rank's bytes
            entry = by_name.get(name)
            if entry is None:
                return "not found on the saver rank"
            data = None if store.storage.is_local else store.storage.read_bytes(entry.path)
            try:
                store.validate(entry, load, data)
            except SnapshotCorruptError as e:
                return str(e)
            verified[name] = data
            return None

        skipped: list[Skipped] = list(self._foreign.values())
        chosen = agree_on_resume(
            control, [(e.key, e.name) for e in entries], check, what=what, timeout_s=timeout_s,
            required=rank == saver_rank,
            on_skip=lambda name, reasons: skipped.append(
                skipped_on_ranks(name, entry_of(name).step, reasons)))
        notice = ResumeNotice(directory=store.storage.url(store.directory),
                              template=self.shown_template,
                              skipped=tuple(skipped))
        if chosen is None:
            announce(notice, quiet=self.quiet, rank=rank)
            return None
        entry = entry_of(chosen)
        own_ok = rank == saver_rank
        if rank != saver_rank and chosen in by_name:
            try:
                store.verify(entry)
                own_ok = store.manifest(entry) is not None
            except (SnapshotCorruptError, SnapshotStorageError) as e:
                logger.warning("rank %d: own copy of %s unusable (%s); receiving the saver rank's",
                               rank, entry.path, e)
        data = verified.get(chosen) if rank == saver_rank else None
        if any(all_gather(control, not own_ok, what=f"{what}: locating {chosen}",
                          timeout_s=timeout_s)):
            error: BaseException | None = None
            payload = data
            if rank == saver_rank and payload is None:
                try:
                    payload = store.storage.read_bytes(entry.path)
                except OSError as e:
                    error = e
            exchange_outcomes(control, error, what=f"{what}: reading {chosen} on the saver rank",
                              timeout_s=timeout_s)
            received = broadcast_object(control, payload, src=saver_rank)
            if not own_ok:
                data = received
                logger.info("rank %d: received %s (%d bytes) from saver rank %d", rank, chosen,
                            len(data or b""), saver_rank)
        error = None
        try:
            apply(entry, load(entry, data))
        except Exception as e:  # exchanged: every rank raises the same error naming this rank
            error = e
        exchange_outcomes(control, error, what=f"{what}: loading {chosen}", timeout_s=timeout_s)
        self.lineage.adopt(store, entries or [entry], entry)
        announce(dataclasses.replace(notice, loaded=entry.name, step=entry.step),
                 quiet=self.quiet, rank=rank)
        return entry

    def choose(self, check: Callable[[Any], Any], *, candidates: list[Any] | None = None,
               required: bool = False) -> Any:
        """Resume for a kind whose door loads the snapshot itself (the Hugging Face Trainer
        reads its ``checkpoint-N`` directories): the newest candidate ``check`` accepts
        (:func:`~snapkeep._core.store.contract.newest_valid`: a ``SnapshotCorruptError`` skips to
        the next older one), said on stderr as :meth:`resume` says it (rank 0, unless
        ``quiet``), its lineage continued (the run id its manifest or marker records).

        Args:
            check: ``check(entry)`` verifies one candidate, or raises.
            candidates: the snapshots to consider (default: the store's listing).
            required: raise when snapshots exist but none is valid (default: None, a fresh
                start, each skipped one named on stderr).

        Returns:
            The entry chosen, or None.

        Raises:
            NoValidSnapshotError: with ``required``, none is valid (each reason listed).
            UnsafeSnapshotError, SnapshotStorageError: as raised by ``check``.
        """
        store = self.store
        entries = store.entries() if candidates is None else candidates
        skipped: list[Skipped] = []
        found = newest_valid(entries, check, what=f"{self.shown_template!r} in "
                             f"{store.directory!r}", required=required,
                             skipped=lambda e, error: skipped.append(
                                 Skipped(name=e.name, step=e.step, reason=str(error))))
        notice = ResumeNotice(directory=store.storage.url(store.directory),
                              template=self.shown_template,
                              skipped=tuple(skipped))
        if found is None:
            announce(notice, quiet=self.quiet)
            return None
        entry = found[0]
        self.lineage.continue_run(getattr(store.manifest(entry), "run_id", None))
        announce(dataclasses.replace(notice, loaded=entry.name, step=entry.step),
                 quiet=self.quiet)
        return entry

    def resume_sharded(
        self, *, groups: Any, rank: int,
        build: Callable[[Entry, set[str]], dict[str, Any]],
        apply: Callable[[Entry, dict[str, Any]], None],
        weights_only: bool = True, candidates: list[Entry] | None = None,
        incomplete: Sequence[Entry] = (),
        values: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        problems: Callable[[Entry, dict[str, Any]], list[str]] | None = None,
    ) -> Entry | None:
        """Resume from the newest sharded snapshot every rank validates, together (collective:
        every rank calls it), in one pass: agree on it (falling back together past one any rank
        objects to: :func:`~snapkeep._core.distributed.agreement.agree_on_resume`), let every
        rank ``build`` what to load into from the keys the snapshot holds, check the small non-
        tensor ``values`` first (loaded alone; DCP fills live tensors in place, so a refusal
        must come before), load through DCP into the rest, ``apply`` it to the live objects,
        continue the run's lineage, and say what happened on stderr once (rank 0): the snapshot
        resumed from, each one skipped with the ranks' reasons, and ``incomplete`` directories
        the start-up swept.

        The validity check is the store's one (:meth:`ShardedStore.validate_part
        <snapkeep._core.distributed.sharded_store.ShardedStore.validate_part>`: the marker, this
        rank's share of the checksums, DCP's ``.metadata`` through the allow-list), the same for
        every door and for :func:`snapkeep.load_latest`.

        Args:
            groups: snapkeep's process groups (None: one process).
            rank: this rank.
            build: ``build(entry, keys) -> state to load into`` (DCP's in-place template).
            apply: ``apply(entry, loaded)`` applies the loaded state to the live objects (its
                failure is exchanged with the load's).
            weights_only: read ``.metadata`` and pickled values through the allow-list.
            candidates: the committed snapshots (default: the store's listing).
            incomplete: directories without a marker the start-up removed (named).
            values: ``values(built) -> the part of it to load and check first`` (the saved
                non-tensor objects: data loader positions, the manager's own state).
            problems: ``problems(entry, loaded values) -> what keeps them from fitting the
                live objects`` (empty: they fit); any makes every rank raise before a tensor
                is loaded.

        Returns:
            The entry resumed from, or None (no rank has any snapshot).

        Raises:
            NoCommonSnapshotError: snapshots exist but none is valid on every rank.
            RankFailedError: building, loading or applying failed on some rank (every rank
                raises, before anything was applied where it failed before the load).
            UnsafeSnapshotError: (one process) the snapshot needs objects outside the
                allow-list.
        """
        from snapkeep._core.distributed.sharded import load_sharded, saved_keys
        from snapkeep._core.distributed.sharded_store import ShardedStore

        store = self.store
        if not isinstance(store, ShardedStore):
            raise TypeError(f"{self!r}: resume_sharded() is for sharded stores")
        control = groups.control if groups else None
        timeout_s = groups.timeout_s if groups else None
        world_size = groups.world_size if groups else 1
        what = f"resuming {self.shown_template!r} in {store.directory!r}"
        entries = store.entries() if candidates is None else candidates

        def check(name: str) -> str | None:
            try:  # the store's validity check; corrupt: objected to, the next older is tried
                store.validate_part(store.entry(name), rank, world_size,
                                    weights_only=weights_only)
            except UnsafeSnapshotError:
                return None  # chosen: its load raises the refusal (never a fallback past it)
            return None

        skipped = [Skipped(name=e.name, step=e.step, reason=INCOMPLETE_SHARDED)
                   for e in reversed(incomplete)]
        skipped += [Skipped(name=e.name, step=e.step, reason=FOREIGN_SHARDED)
                    for e in reversed(store.foreign())] if rank == 0 else []

        def on_skip(name: str, reasons: dict[int, str]) -> None:
            skipped.append(skipped_on_ranks(name, store.entry(name).step, reasons))

        chosen = agree_on_resume(control, [(e.key, e.name) for e in entries], check, what=what,
                                 timeout_s=timeout_s, on_skip=on_skip)
        notice = ResumeNotice(directory=store.storage.url(store.directory),
                              template=self.shown_template, skipped=tuple(skipped))
        if chosen is None:
            announce(notice, quiet=self.quiet, rank=rank)
            return None
        entry = store.entry(chosen)
        # 1. build what to load into (local), 2. DCP load (collective), 3. apply (local)
        error: BaseException | None = None
        loaded: dict[str, Any] = {}
        try:
            loaded = build(entry, saved_keys(store, entry, weights_only=weights_only))
        except Exception as e:  # exchanged below: every rank fails together
            error = e
        together(control, error, what=f"{what}: preparing to load {entry.path}",
                  timeout_s=timeout_s)
        if problems is not None:  # the small values alone first: all or nothing
            try:
                first = values(loaded) if values is not None else {}
                if first:
                    load_sharded(store, entry, first, groups=groups, weights_only=weights_only)
                found = problems(entry, first)
                if found:
                    raise StateMismatchError(
                        f"snapshot {entry.path} (step {entry.step}) does not fit: "
                        f"{describe(found)}. Nothing was loaded or deleted. Next: build the "
                        "state as it was when that step was saved (the keys and shapes above), "
                        "or start fresh in another directory")
            except Exception as e:  # exchanged below: every rank refuses together
                error = e
            together(control, error, what=f"{what}: checking {entry.path}",
                      timeout_s=timeout_s)
        try:
            load_sharded(store, entry, loaded, groups=groups, weights_only=weights_only)
            apply(entry, loaded)
        except Exception as e:  # exchanged below
            error = e
        together(control, error, what=f"{what}: loading {entry.path}", timeout_s=timeout_s)
        manifest = store.manifest(entry)
        self.lineage.continue_run(manifest.run_id if manifest is not None else None)
        logger.info("rank %d resumed from sharded snapshot %s (step %s, saved on %s rank(s))",
                    rank, entry.path, entry.step, manifest.world_size if manifest else "?")
        announce(dataclasses.replace(notice, loaded=entry.name, step=entry.step),
                 quiet=self.quiet, rank=rank)
        return entry

    def continue_lineage(self, step: int) -> None:
        """After a resume from elsewhere (the memory tier) at ``step``: continue the lineage of
        the store's newest snapshot at or before it (one manifest read, no snapshot data), so
        that retention goes on deleting that run's snapshots as after a resume from storage."""
        store = self.store
        older = [e for e in store.entries() if e.step is not None and e.step <= step]
        if not older:
            return
        if isinstance(store, SnapshotStore):
            self.lineage.adopt(store, older, older[-1])
            return
        manifest = store.manifest(older[-1])  # a sharded marker: its run id
        self.lineage.continue_run(getattr(manifest, "run_id", None))

    # -- save ----------------------------------------------------------------------------------
    def retention(self, name: str, step: int, metrics: Mapping[str, float], *,
                  on_error: bool = False) -> Retain:
        """The retention stage of the save of ``name`` at ``step``, after the retention input
        check (on the training thread, before anything is staged or deleted).

        Raises:
            ValueError: a ``KeepBest`` metric of the policy is recorded by none of this run's
                snapshots, this one included (``val_los`` for ``val_loss``): retention would
                delete the best ones. Nothing is written or deleted.
        """
        if not on_error:
            self._metric_check.before_save(self.store, self.lineage.members, name, step,
                                           metrics)
        if not isinstance(self.store, SnapshotStore):
            raise TypeError(f"{self!r}: the Retain stage is for single-file stores")
        return Retain(store=self.store, lineage=self.lineage.members,
                      policy=None if on_error else self.policy, door=self.door)

    def save(self, writer: Any, name: str, directory: str, state: Any, *, step: int | None,
             metrics: Mapping[str, float], on_error: bool = False, incremental: Any = None,
             before_write: Callable[[], None] | None = None, **writer_kwargs: Any) -> Any:
        """The save of one single-file snapshot, the same for every door: the retention input
        check (on the training thread, before anything is staged or deleted), the door's
        ``before_write`` step (the ppe extension settles and arms its overlapped staging there),
        then ``writer`` stages ``state`` and commits it as ``directory``/``name`` with this
        session's :class:`Retain` stage, which it runs after the commit.

        Args:
            writer: a snapkeep writer (``snapkeep.writing``; its call takes the ``step``,
                ``metrics``, ``retain``, ``run_id`` and ``incremental`` extras).
            name: the snapshot's name in ``directory`` (an on-error snapshot's included).
            directory: the output directory or URL the writer writes.
            state: the state tree (tensors on any device; staged by the writer).
            step: the training step the snapshot holds, or None where the door has none
                (then nothing is retained: retention orders snapshots by step).
            metrics: recorded in the manifest (``KeepBest`` reads them after a restart).
            on_error: an on-error snapshot (``<name>.on-error``): never retained or checked.
            incremental: the door's incremental tracker, for incremental snapshots.
            before_write: called after the check, right before the writer.
            writer_kwargs: passed to the writer as they are (``savefun=``).

        Returns:
            the writer's handle (``staged``/``committed`` futures), or None from a writer that
            returns none.

        Raises:
            ValueError: a ``KeepBest`` metric of the policy is recorded by no snapshot of this
                run, this one included (see :meth:`retention`); nothing is written or deleted.
        """
        retain = Retain(store=self._single_file("save")) if step is None \
            else self.retention(name, step, metrics, on_error=on_error)
        extra: dict[str, Any] = {"step": step, "retain": retain, "metrics": dict(metrics),
                                 "run_id": self.lineage.run_id}
        if incremental is not None:
            extra["incremental"] = incremental
        if before_write is not None:
            before_write()
        run = self.run
        started = run.times.start() if run is not None and not on_error else None
        handle = writer(name, directory, state, **writer_kwargs, **extra)
        committed = getattr(handle, "committed", None)
        if run is not None and started is not None and committed is not None:
            run.times.staged(started, committed)  # the deadline's estimate
        return handle

    def check_retention_input(self, name: str, step: int, metrics: Mapping[str, float]) -> None:
        """The retention input check alone (sharded stores, whose saver retains itself); see
        :meth:`retention`."""
        self._metric_check.before_save(self.store, self.lineage.members, name, step, metrics)

    # -- the run ----------------------------------------------------------------------------------
    def run_control(self, *, rank: int = 0, world_size: int = 1, signals: Sequence[int] = (),
                    control: Any = None, timeout_s: float = 600.0,
                    grace_s: float | None = None, step_name: str = "step") -> RunControl:
        """The run control of every door (see :mod:`snapkeep._core.session.run_control`, whose
        :class:`RunControl` this returns and keeps as :attr:`run`; the arguments are its own):
        this run's status in the store's directory and, with ``signals``, the preemption hook
        (installed now), its deadline and its exit. From now on :meth:`save` times each durable
        save for the deadline's estimate (:attr:`RunControl.times`).

        Raises:
            ValueError: ``grace_s`` or ``$SNAPKEEP_GRACE_S`` is not a number of seconds > 0; a
                signal cannot be caught.
        """
        if self.run is not None:
            self.run.close()
        self.run = RunControl(self.store.storage, self.store.directory, rank=rank,
                              world_size=world_size, signals=signals, control=control,
                              timeout_s=timeout_s, grace_s=grace_s, step_name=step_name)
        self.run.install()
        return self.run

    @staticmethod
    def unrecorded_run_control(**arguments: Any) -> RunControl:
        """The run control of a door without a store (ppe's own writers: no snapkeep
        directory to record the status in): the preemption hook (installed now), its
        deadline and its exit, with nothing recorded; the arguments are
        :meth:`run_control`'s."""
        run = RunControl(None, "", **arguments)
        run.install()
        return run

    # -- close ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the lock and put the preemption hook's signal handlers back (idempotent;
        during a preemption they stay until :meth:`RunControl.exit_preempted`). Pending saves
        are the writer's: wait for them first."""
        lock, self._lock = self._lock, None
        try:
            if self.run is not None and not self.run.preempting:  # preempting: the handlers
                self.run.close()  # stay until the exit (RunControl.exit_preempted)
        finally:
            if lock is not None:
                lock.release()

    @property
    def locked(self) -> bool:
        """Whether this session holds the store lock."""
        return self._lock is not None

