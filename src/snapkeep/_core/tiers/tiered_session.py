"""The memory tier as a layer on the engine session: :class:`TieredSession` wraps any
:class:`~snapkeep._core.session.session.Session` (either store kind) and has its interface, so
a door adds the tier in one way, whichever door it is (the Checkpointer's ``memory=``, the
Lightning ``SnapkeepCheckpointIO(memory=...)``, the Hugging Face ``SnapkeepTrainer``'s
``memory=``), as Orbax's multi-tier manager implements the interface of the manager it fronts.

Every attribute the layer does not define is the wrapped session's (``store``, ``lineage``,
``open``, ``own``, ``choose``, ``resume_sharded``, ...). What the layer adds or changes, on the
training thread, in the session's call order::

    session.open(...)                         # the wrapped session's start-up, unchanged
    session.resume(apply, ...)                # single files: RAM first when it is at least
                                              # storage's newest (verified), else storage
    session.recover(storage_step, apply, ...) # the RAM part alone (doors whose resume is their
                                              # own: sharded, the HF Trainer's files)
    session.save(writer, name, ...)           # storage, then RAM when the step is due
    session.keep(step, build, borrow=...)     # RAM only (a step between storage saves)
    session.close(failed=...)                 # the tier (kept unless storage holds its newest
                                              # step), then the wrapped session

What the tier keeps, where, its size check, its peers and its recovery are the engine's
(:mod:`snapkeep._core.tiers.memory_tier`: :class:`TierEngine`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from snapkeep._core.format.naming import FilenameTemplate
from snapkeep._core.save.ticket import StagedLoan
from snapkeep._core.store.files import Entry, SnapshotStore
from snapkeep._core.tiers.memory_store import tier_dir
from snapkeep._core.tiers.memory_tier import MemoryTier, Restored, TierEngine, state_bytes

logger = logging.getLogger(__name__)


def check_memory(memory: Any) -> MemoryTier | None:
    """``memory=`` as every door takes it: a :class:`MemoryTier` or None.

    Raises:
        TypeError: anything else (named, with the accepted values).
    """
    if memory is not None and not isinstance(memory, MemoryTier):
        raise TypeError(f"memory must be a snapkeep.MemoryTier(every=..., ...) or None, got "
                        f"{memory!r}")
    return memory


class TieredSession:
    """A session with the memory tier in front of its store (see the module docstring).

    Args:
        inner: the session wrapped (opened or not; the layer opens nothing itself); None for
            a door whose sessions are held elsewhere (ppe's manager: each snapshot extension
            holds its own, and :func:`snapkeep.training.extensions.memory_tier` is the tier):
            then only the tier's methods apply (:meth:`open_tier`, :meth:`keep`,
            :meth:`recover`, :meth:`wait`, :meth:`close_tier` with ``finished``).
        memory: the tier's configuration.
        directory: the training's snapshot directory (an absolute path or URL) and
            ``template`` its snapshot template: together the training's identity (what the
            tier is named after and what a RAM snapshot must record to be resumed).
        quiet: no RAM resume notice on stderr (still logged at INFO).
    """

    def __init__(self, inner: Any, memory: MemoryTier, *, directory: str,
                 template: FilenameTemplate | str, quiet: bool = False) -> None:
        self.inner = inner
        self.memory = memory
        self.engine = TierEngine(memory, directory=directory, template=template)
        self.quiet = quiet
        self.recovered = False  # recover() ran: a later resume reads storage only
        self._tier_closed = False

    def __getattr__(self, name: str) -> Any:  # the wrapped session's interface
        if name == "inner":  # not set yet (a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"TieredSession({self.inner!r}, every={self.memory.every})"

    # -- the tier ------------------------------------------------------------------------------
    def due(self, step: int | None) -> bool:
        """Whether the tier keeps ``step`` (every ``memory.every`` steps)."""
        return step is not None and step % self.memory.every == 0

    def open_tier(self, size_bytes: int) -> None:
        """Open the tier, sized for a state of ``size_bytes`` tensor bytes (see
        :meth:`TierEngine.open`: collective under torch.distributed); once.

        Raises:
            MemoryTierTooSmallError, NotPrivateError, ValueError: as ``TierEngine.open``.
        """
        if not self.engine.opened:
            self.engine.open(size_bytes)

    def keep(self, step: int, build: Callable[[], Any],
             borrow: Callable[[], StagedLoan | None] | None = None) -> None:
        """Keep ``build()`` (the state tree of ``step``) in RAM, or the copy ``borrow()`` lends
        (a writer's staging of the same step); opens the tier first, sized for that tree.
        Returns once the copy is taken (:meth:`TierEngine.save`).

        Raises:
            SnapshotSaveError, SnapshotTimeoutError: as ``TierEngine.save``.
        """
        if not self.engine.opened:
            tree = build()
            self.open_tier(state_bytes(tree))
            self.engine.save(step, lambda: tree, borrow=borrow)
            return
        self.engine.save(step, build, borrow=borrow)

    def recover(self, storage_step: int | None, apply: Callable[[Any, int, str], None], *,
                prepare: Callable[[Any], Any] | None = None, size_bytes: int = 0
                ) -> Restored | None:
        """Resume from RAM when its newest step every rank holds is at least ``storage_step``
        (:meth:`TierEngine.recover`), and say on stderr what happened (rank 0): ``snapkeep:
        resuming from RAM step N (...)``, or why storage is used. Opens the tier first (sized
        ``size_bytes`` when not open yet). After a RAM resume the store's lineage continues
        from its newest snapshot at or before that step (retention goes on as after a storage
        resume).

        Returns:
            What was restored, or None (resume from storage).
        """
        self.open_tier(size_bytes)
        self.recovered = True
        restored = self.engine.recover(storage_step, apply, prepare=prepare)
        self.engine.announce(quiet=self.quiet)
        if restored is not None and self.inner is not None:
            self.inner.continue_lineage(restored.step)
        return restored

    @property
    def restored(self) -> Restored | None:
        """What the last :meth:`recover` restored (None: nothing from RAM)."""
        return self.engine.restored

    # -- the session's interface, tiered -----------------------------------------------------
    def resume(self, apply: Callable[[Entry, Any], None], *,
               check: Callable[[Entry, Any], Any] | None = None,
               candidates: list[Entry] | None = None, **kwargs: Any) -> Entry | None:
        """:meth:`Session.resume <snapkeep._core.session.session.Session.resume>` with RAM
        first: when the tier holds a step at least the newest of ``candidates`` (its copy
        verified), ``apply(entry, check(entry, tree))`` with that RAM snapshot's tree (an
        entry named ``ram_iter_N`` at its path in the tier) and no storage snapshot read;
        else the wrapped session's resume (its notice, its fallback). Single-file stores.

        Returns:
            The entry resumed from (a RAM one: :attr:`restored` says so), or None.
        """
        if self.recovered:  # RAM was tried once (at most one recovery per run)
            return self.inner.resume(apply, check=check, candidates=candidates, **kwargs)
        store = self.inner.store
        listed = self.inner.own(store.entries() if candidates is None else candidates)
        steps = [e.step for e in listed if e.step is not None]
        newest = max(steps, default=None)
        size = 0
        if listed:  # the newest snapshot's size: what the tier must hold (no byte read)
            try:
                size = int(store.storage.size(listed[-1].path))
            except OSError:
                size = 0
        got: list[Entry] = []

        def from_ram(tree: Any, step: int, path: str) -> None:
            entry = Entry(name=path.rsplit("/", 1)[-1], path=path, key=(float(step),),
                          step=step)
            apply(entry, tree if check is None else check(entry, tree))
            got.append(entry)

        if self.recover(newest, from_ram, size_bytes=size) is not None:
            return got[0]
        return self.inner.resume(apply, check=check, candidates=candidates, **kwargs)

    def save(self, writer: Any, name: str, directory: str, state: Any, *, step: int | None,
             on_error: bool = False, **kwargs: Any) -> Any:
        """:meth:`Session.save <snapkeep._core.session.session.Session.save>`, then, when the
        tier keeps ``step`` (not for an on-error snapshot), the same state in RAM, borrowing
        the copy ``writer`` staged (no second staging) when it lends one."""
        handle = self.inner.save(writer, name, directory, state, step=step, on_error=on_error,
                                 **kwargs)
        if step is not None and not on_error and self.due(step):
            lend = getattr(writer, "lend_staged", None)
            borrow = None if handle is None or lend is None else (lambda: lend(handle))
            self.keep(step, lambda: state, borrow=borrow)
        return handle

    def wait(self) -> None:
        """Wait for the RAM snapshot in flight (:meth:`TierEngine.wait`)."""
        self.engine.wait()

    def newest_stored(self) -> int | None:
        """The newest step the store holds committed (None: none): its single files by name;
        of directories, those with a commit marker (a ``checkpoint-N`` being written, or left
        by a killed save, has none yet)."""
        store = self.inner.store
        entries = store.entries()
        if not isinstance(store, SnapshotStore):
            entries = [e for e in entries if store.manifest(e) is not None]
        steps = [e.step for e in entries if e.step is not None]
        return max(steps, default=None)

    def close_tier(self, *, failed: bool = False, finished: bool | None = None) -> None:
        """Close the tier: drained; removed when the run did not fail and storage holds the
        newest step this session kept in (or resumed from) RAM (or as ``finished`` says, where
        the door knows: ppe's stop trigger), else kept for the next run (logged); a background
        RAM failure raised once (logged instead when ``failed``). Idempotent.

        Raises:
            SnapshotSaveError, SnapshotTimeoutError: as ``TierEngine.close``.
        """
        if self._tier_closed:
            return
        self._tier_closed = True
        engine = self.engine
        if finished is not None:
            engine.close(finished=finished, failed=failed)
            return
        finished = False
        if not failed and engine.opened:
            engine.wait()
            try:
                newest = self.newest_stored()
            except Exception:  # unreachable storage: keep the tier
                newest = None
            # the newest step this session put in RAM or resumed from it (then persisted)
            ram = engine.last_step if engine.last_step is not None else (
                None if engine.restored is None else engine.restored.step)
            finished = ram is not None and newest is not None and newest >= ram
            if ram is not None and not finished:
                logger.info("memory tier: RAM step %s is newer than storage's %s: kept in %s "
                            "for the next run", ram, newest,
                            tier_dir(self.memory.root, engine.job))
        engine.close(finished=finished, failed=failed)

    def close(self, *, failed: bool = False) -> None:
        """:meth:`close_tier`, then the wrapped session's close (its lock released)."""
        try:
            self.close_tier(failed=failed)
        finally:
            self.inner.close()


def tiered(session: Any, memory: MemoryTier | None, *, directory: str,
           template: FilenameTemplate | str, quiet: bool = False) -> Any:
    """``session`` with the memory tier in front (:class:`TieredSession`), or ``session`` as
    it is when ``memory`` is None: how every door adds the tier."""
    if memory is None:
        return session
    return TieredSession(session, memory, directory=directory, template=template, quiet=quiet)


__all__ = ["TieredSession", "check_memory", "tiered"]
