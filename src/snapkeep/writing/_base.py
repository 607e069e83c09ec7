"""ppe-compatible writer base classes: ``Writer`` and ``SimpleWriter`` (``StandardWriter`` is in
:mod:`._standard`).

A writer decides *where* a save runs; the save path itself (stage -> encode -> atomic commit ->
manifest -> post-commit hooks) lives in :mod:`snapkeep._core` and is the same for every writer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.format.codec import torch_save
from snapkeep._core.format.manifest import MANIFEST_SUFFIX
from snapkeep._core.save.executors import InlineRunner, Runner
from snapkeep._core.save.job import CommitRecord, SaveJob
from snapkeep._core.save.overlap import OnRace, StagingGuard, arm
from snapkeep._core.save.prefault import prefault_before_first_snapshot
from snapkeep._core.save.saver import SaveHandle, Saver, Ticket
from snapkeep._core.save.ticket import StagedLoan
from snapkeep._core.storage import Storage, resolve_storage
from snapkeep._core.store.files import Retain
from snapkeep._version import __version__
from snapkeep.writing._ppe_fs import PpeFileSystem

logger = logging.getLogger(__name__)

SaveFun = Callable[..., Any]


class Writer:
    """Base class of snapshot writers (as ppe's ``writing.Writer``).

    The snapshot extension calls ``writer(filename, out_dir, target)`` for each snapshot. Every
    writer commits atomically and durably: temp file in the destination directory with a name
    unique to the writer and process, write, flush, ``fsync``, ``os.replace``, ``fsync`` of the
    directory (object stores: one upload that only becomes visible when complete). A checksum
    manifest is written next to each snapshot (``.snapkeep/<name>.json``).

    Args:
        fs: an fsspec filesystem, or a ppe/pfio-style filesystem object; ``None`` picks the
            filesystem from ``out_dir`` (a local path or an fsspec URL such as ``s3://b/run``).
            The attribute ``writer.fs`` is a :class:`~snapkeep.writing.PpeFileSystem` over the
            same storage, for ppe's snapshot extension (autoload, ``n_retains``).
        out_dir: directory this writer uses. When empty, the ``out_dir`` passed to ``__call__``
            (the manager's ``out``) is used -- ppe instead wrote into the working directory.
            When both are empty, an absolute local ``filename`` is written where it names
            (``writer('/tmp/run/myfile.dat', '', target)``, as ppe's
            ``os.path.join(out_dir, filename)``); otherwise a filename must stay inside the
            directory (an absolute or ``..`` name is refused with ``ValueError``).
        storage_options: keyword arguments for the fsspec filesystem (endpoint, credentials).
        zip_crc32: when ``savefun`` is ``torch.save`` (the default), also compute the CRC-32 of
            every zip record as ``torch.save`` does. Default False: snapkeep writes the same
            bytes without it (:func:`snapkeep.codecs.torch_save`), saving about 0.25 CPU-s per
            GiB; ``torch.load`` never checks that CRC, and snapkeep verifies its own XXH3-128
            checksum instead. Set True if other tools (``unzip -t``) must validate the files.
        staging_budget: most bytes of host memory one snapshot's staging may hold (an int >= 1
            MiB), or None (default: a full copy of the state per snapshot in flight). A state
            whose tensors exceed it is copied and written in pieces through a ring of that
            size, with the same consistency (see :mod:`snapkeep._core.save.budget`): the call
            returns once every tensor no guarded optimizer owns is copied, and an overlapped
            optimizer's next ``step()`` waits for the rest. A tensor larger than the budget is
            streamed in pieces. For thread writers (``ThreadWriter``, ``ThreadQueueWriter``)
            with ``savefun=torch.save``; a process writer raises ``ValueError``, a synchronous
            one (``SimpleWriter``) stages nothing and ignores it.
    """

    _runner_class: type[Runner] = InlineRunner
    _default_max_pending = 1

    def __init__(
        self, fs: Any = None, out_dir: str = "", *,
        storage_options: Mapping[str, Any] | None = None, max_pending: int | None = None,
        on_full: str = "block", timeout_s: float | None = None, zip_crc32: bool = False,
        staging_budget: int | None = None,
    ) -> None:
        if not isinstance(zip_crc32, bool):
            raise TypeError(f"zip_crc32 must be True or False, got {zip_crc32!r}")
        if not isinstance(out_dir, str):
            out_dir = str(out_dir)
        fs, storage_options = PpeFileSystem.unwrap(fs, storage_options)
        self._fs = fs
        self.fs = PpeFileSystem(fs, storage_options)  # what ppe's snapshot extension calls
        self.out_dir = out_dir
        self._storage_options = dict(storage_options or {})
        self._zip_crc32 = zip_crc32
        self._storages: dict[str, tuple[Storage, str]] = {}
        self._tag = uuid.uuid4().hex[:8]
        self._initialized = False
        self._finalized = False
        self._cleanup_hooks: list[Callable[[], None]] = []
        self._saver = Saver(
            self._make_runner(),
            max_pending=self._default_max_pending if max_pending is None else max_pending,
            on_full=on_full, timeout_s=timeout_s, staging_budget=staging_budget,
        )
        self._saver.add_post_commit_hook(self._post_commit)
        self.last_handle: SaveHandle | None = None
        if out_dir and not self._saver.runner.in_process:
            self.storage_for(out_dir)  # fail now for a storage a worker process cannot share

    def _make_runner(self) -> Runner:
        return self._runner_class()

    # -- ppe API -------------------------------------------------------------------------------
    def __call__(
        self, filename: str, out_dir: str, target: Any, *, savefun: SaveFun | None = None,
        append: bool = False,
    ) -> Any:
        """Write ``target`` to ``filename`` under the writer's ``out_dir`` (or ``out_dir``).

        Args:
            filename: concrete file name (not a template), may contain sub-directories.
            out_dir: the manager's output directory; used when the writer has none.
            target: the object to save (typically a state_dict of CPU/CUDA tensors).
            savefun: ``savefun(obj, file, **kwargs)`` (torch.save's order); default torch.save.
            append: open the file in append mode (no atomic commit, no checksum).
        """
        raise NotImplementedError

    def initialize(self, out_dir: str) -> None:
        """Create the output directory and remove temp files left by crashed writers.

        Raises:
            SnapshotStorageError: the output directory cannot be created (the message names
                ``out_dir``, the path and the OS error).
        """
        storage, path = self.storage_for(out_dir)
        try:
            storage.makedirs(path)
        except SnapshotStorageError as e:
            raise SnapshotStorageError(
                f"output directory {storage.url(path)!r} cannot be used for snapshots: {e}"
                + ("" if "; choose" in str(e) else
                   ". Choose a writable directory (a local path or an fsspec URL)"),
                errno=e.errno, filename=path, size_bytes=0,
            ) from e
        storage.remove_stale_temps(path)
        self._initialized = True

    def finalize(self) -> None:
        """Wait for pending snapshots and release the worker; idempotent (as ppe).

        Raises:
            SnapshotSaveError: a background save failed and was not reported yet (raised once,
                with the original exception as ``__cause__``).
        """
        if self._finalized:
            return
        self._finalized = True
        self._saver.close()

    def save(
        self, filename: str, out_dir: str, target: Any, savefun: SaveFun | None, append: bool,
        **savefun_kwargs: Any,
    ) -> CommitRecord:
        """Save synchronously and return when durable (ppe's ``Writer.save``).

        The same save path as ``__call__`` plus a wait: staging (for background writers),
        back-pressure (waits for a free slot per ``on_full``), commit, post-commit hooks.

        Raises:
            RuntimeError: the writer is finalized.
            SnapshotError: the snapshot was skipped (``on_full='skip'`` with every slot busy).
            Exception: the save's own error.
        """
        self._refuse_if_finalized()
        filename, out_dir = self._place(filename, out_dir)
        job = self._job(filename, out_dir, savefun, append, savefun_kwargs)
        if not self._initialized:
            self.initialize(self._directory(out_dir))
        return self._saver.save_now(job, target)

    def _refuse_if_finalized(self) -> None:
        if self._finalized:
            raise RuntimeError(
                f"{type(self).__name__} is finalized: it saves nothing more; create a new "
                "writer to save again")

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finalize()

    def __del__(self) -> None:
        if not getattr(self, "_finalized", True) and getattr(self, "_saver", None) is not None \
                and self._saver.pending:
            logger.warning("%s was garbage-collected with snapshots pending; call finalize()",
                           type(self).__name__)

    # -- snapkeep additions ----------------------------------------------------------------------
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending snapshot is committed, then raise any background error.

        Raises:
            SnapshotTimeoutError: still pending after ``timeout_s`` seconds.
            SnapshotSaveError: a background save failed.
        """
        self._saver.wait(timeout_s)
        self._saver.raise_pending_error()

    def add_post_commit_hook(self, hook: Callable[[CommitRecord], None]) -> None:
        """Call ``hook(record)`` after each committed snapshot (in this process)."""
        self._saver.add_post_commit_hook(hook)

    def _add_cleanup_hook(self, hook_fun: Callable[[], None]) -> None:
        """ppe's hook called after each save with no arguments (used for ``n_retains``)."""
        self._cleanup_hooks.append(hook_fun)

    def storage_for(self, out_dir: str = "") -> tuple[Storage, str]:
        """``(Storage, path)`` of the directory this writer writes to for ``out_dir``."""
        directory = self._directory(out_dir)
        cached = self._storages.get(directory)
        if cached is None:
            cached = resolve_storage(directory, self._fs, self._storage_options)
            if not self._saver.runner.in_process:  # the storage is pickled to a worker process
                cached[0].require_process_shareable(cached[1], type(self).__name__)
            self._storages[directory] = cached
        return cached

    @property
    def initialized(self) -> bool:
        """Whether :meth:`initialize` has run (it also runs before the first save)."""
        return self._initialized

    @property
    def pending(self) -> int:
        """Snapshots staged or being written."""
        return self._saver.pending

    def raise_pending_error(self) -> None:
        """Raise the oldest background save failure not reported yet, once (others are logged);
        return when there is none. Does not wait (see :meth:`wait`).

        Raises:
            SnapshotSaveError: a background save failed (the original error as ``__cause__``).
        """
        self._saver.raise_pending_error()

    def arm_overlap(
        self, optimizers: Iterable[torch.optim.Optimizer], guard: StagingGuard, *,
        before_copy: Callable[[], None] | None = None, on_race: OnRace | None = None,
    ) -> bool:
        """Let the next save stage ``optimizers``' parameters and state in the background while
        training continues; their ``step()`` waits for the copy and ``guard`` validates it (see
        :func:`snapkeep._core.save.overlap.arm`, the snapshot extension's ``overlap``). Call it
        right
        before the save, on the training thread; :meth:`disarm_overlap` after it.

        Args:
            optimizers: the optimizers whose tensors are in the saved tree.
            guard: validates the background copy (one per extension).
            before_copy: called in the background thread before it copies.
            on_race: called with the :class:`StagingRaceError` of a modified tensor (default:
                raise it at the next safe point).

        Returns:
            False when nothing was armed: this writer does not stage (``SimpleWriter``), or
            ``optimizers`` is empty.
        """
        return arm(self._saver, optimizers, guard, before_copy=before_copy, on_race=on_race)

    def lend_staged(self, handle: SaveHandle) -> StagedLoan | None:
        """Lend the staged copy of the snapshot of ``handle`` (e.g. ``last_handle``) to a
        second reader of the same state at the same step, instead of a second staging: the
        memory tier serialises it. Read ``loan.tree`` only after ``loan.wait_staged()`` and
        call ``loan.release()`` when done; until then this writer does not stage into that
        copy's buffers (its next snapshot may wait for the release). See
        :class:`snapkeep._core.save.ticket.StagedLoan` for why the read is safe.

        Returns:
            None when there is nothing to lend: this writer does not stage (``SimpleWriter``),
            it is finalized, or the copy was staged over by a later snapshot.
        """
        return self._saver.lend(handle)

    def disarm_overlap(self) -> None:
        """Undo :meth:`arm_overlap` if the next save has not used it (a save consumes it)."""
        self._saver.overlap_next(None)

    def prefault(
        self, state_fn: Callable[[], Any], optimizers: Iterable[torch.optim.Optimizer], *,
        after_first_step: bool = False,
    ) -> None:
        """Prepare this writer's staging buffers for the tree ``state_fn()`` returns, in a
        background thread, so the first save does not pay for them: now, or after the first
        ``step()`` of each optimizer without state yet (see
        :func:`snapkeep._core.save.prefault.prefault_before_first_snapshot`).

        Args:
            state_fn: returns the tree a save will stage (called on the caller's thread or right
                after an optimizer step).
            optimizers: the optimizers whose state is part of that tree.
            after_first_step: start only after the first ``step()`` of every optimizer (after
                a resume: training goes on before the buffers are prepared).
        """
        prefault_before_first_snapshot(self._saver, state_fn, optimizers,
                                       after_first_step=after_first_step)

    # -- internals -------------------------------------------------------------------------------
    def _directory(self, out_dir: str) -> str:
        return self.out_dir or out_dir or ""

    def _place(self, filename: str, out_dir: str) -> tuple[str, str]:
        """``(name, out_dir)`` for a save: with no directory at all (the writer's and
        ``out_dir`` empty), an absolute local ``filename`` becomes its base name in its own
        directory, as ppe's ``os.path.join('', filename)``; otherwise unchanged (the storage
        then refuses a name that leaves the directory)."""
        if self._directory(out_dir) or not isinstance(filename, str) \
                or not os.path.isabs(filename):
            return filename, out_dir
        directory, name = os.path.split(filename)
        return name, directory

    def _post_commit(self, record: CommitRecord) -> None:
        for hook in list(self._cleanup_hooks):
            try:
                hook()
            except Exception:
                logger.exception("cleanup hook failed after committing %s", record.path)

    @property
    def staging_budget(self) -> int | None:
        """The ``staging_budget`` given (bytes), or None (unbounded)."""
        return self._saver.staging_budget

    @property
    def last_budget_stats(self) -> Any:
        """The last budgeted snapshot's figures
        (:class:`~snapkeep._core.save.budget.BudgetStats`: sizes in bytes, times in seconds,
        rates in bytes per second, the predicted time until staged), or None before one."""
        return self._saver.last_budget_stats

    def _job(
        self, filename: str, out_dir: str, savefun: SaveFun | None, append: bool,
        savefun_kwargs: Mapping[str, Any], *, step: int | None = None,
        metrics: Mapping[str, float] | None = None, run_id: str | None = None,
    ) -> SaveJob:
        if not isinstance(filename, str) or not filename:
            raise ValueError(f"filename must be a non-empty str, got {filename!r}")
        storage, directory = self.storage_for(out_dir)
        if savefun is torch.save and not self._zip_crc32:
            savefun = torch_save  # the same bytes without the zip CRC-32
        return SaveJob(
            storage=storage,  # refuses names outside out_dir or over NAME_MAX (manifest too)
            path=storage.child(directory, filename,
                               reserve_bytes=0 if append else len(MANIFEST_SUFFIX)),
            savefun=savefun,  # type: ignore[arg-type]  # None fails in the save, as ppe
            savefun_kwargs=dict(savefun_kwargs), append=append, tag=self._tag, step=step,
            run_id=run_id, metrics=dict(metrics or {}), version=__version__,
        )

    def _submit(
        self, filename: str, out_dir: str, target: Any, savefun: SaveFun | None, append: bool,
        savefun_kwargs: Mapping[str, Any], extra: Mapping[str, Any],
    ) -> Ticket | None:
        self._refuse_if_finalized()
        filename, out_dir = self._place(filename, out_dir)
        extra = dict(extra)
        retain = extra.pop("retain", None)
        if retain is not None and not isinstance(retain, Retain):
            raise TypeError(f"retain must be a snapkeep._core.store.files.Retain, got {retain!r}")
        tracker = extra.pop("incremental", None)
        job = self._job(filename, out_dir, savefun, append, savefun_kwargs, **extra)
        if retain is not None and retain.door:  # the door's layout, recorded in the manifest
            job = dataclasses.replace(job, door=retain.door)
        if tracker is not None:
            _check_incremental(tracker, job)
        if not self._initialized:
            self.initialize(self._directory(out_dir))
        if tracker is None:
            ticket = self._saver.submit(job, target, retain=retain)
        else:  # unchanged tensors become references: neither staged nor written
            target, plan = tracker.plan(target)
            ticket = None
            try:
                ticket = self._saver.submit(dataclasses.replace(job, incremental=plan.job),
                                            target, retain=retain, incremental=plan)
            finally:
                if ticket is None:  # skipped, or refused before it was in flight
                    plan.finish(None)
        self.last_handle = ticket.handle if ticket is not None else None
        return ticket


def _check_incremental(tracker: Any, job: SaveJob) -> None:
    """Refuse an incremental snapshot this writer cannot write: its skeleton is a
    ``torch.save`` file committed with its manifest.

    Raises:
        TypeError: ``tracker`` is not an
        :class:`~snapkeep._core.tiers.incremental.IncrementalTracker`.
        ValueError: append mode, or a ``savefun`` other than ``torch.save``.
    """
    from snapkeep._core.tiers.incremental import IncrementalTracker

    if not isinstance(tracker, IncrementalTracker):
        raise TypeError(f"incremental must be an IncrementalTracker, got {tracker!r}")
    if job.append or job.savefun not in (torch.save, torch_save):
        raise ValueError(
            "incremental snapshots are torch.save files committed with their manifest: "
            f"savefun must be torch.save (got {job.savefun!r}) and append False")


class SimpleWriter(Writer):
    """Writes in the caller's thread and returns when the snapshot is durable (ppe's
    ``SimpleWriter``). The target is written as given, without a staging copy. A subclass (or
    instance) that replaces :meth:`save` has its ``save`` called for each snapshot instead, as
    ppe's ``SimpleWriter`` does; snapkeep's per-snapshot extras (step, metrics, retention) are
    then the replacement's business, and ``__call__`` returns ``None``.

    Args:
        savefun: ``savefun(obj, file, **kwds)``; default ``torch.save``.
        fs: see :class:`Writer`.
        out_dir: see :class:`Writer`.
        kwds: keyword arguments passed to ``savefun`` (as ppe).
    """

    def __init__(
        self, savefun: SaveFun = torch.save, fs: Any = None, out_dir: str = "", **kwds: Any
    ) -> None:
        options = kwds.pop("storage_options", None)
        super().__init__(fs=fs, out_dir=out_dir, storage_options=options,
                         zip_crc32=kwds.pop("zip_crc32", False))
        self._savefun = savefun
        self._kwds = kwds

    def __call__(
        self, filename: str, out_dir: str, target: Any, *, savefun: SaveFun | None = None,
        append: bool = False, **extra: Any,
    ) -> SaveHandle | None:
        if "save" in vars(self) or type(self).save is not Writer.save:
            # A subclass or instance that replaces save() takes over the write (as ppe's
            # SimpleWriter, whose __call__ is save()); it returns no handle.
            self.save(filename, out_dir, target, savefun or self._savefun, append, **self._kwds)
            return None
        ticket = self._submit(filename, out_dir, target, savefun or self._savefun, append,
                              self._kwds, extra)
        if ticket is None:
            return None
        self._saver.run(ticket, report=False)
        ticket.handle.committed.result()  # raise the save's error here, synchronously
        return ticket.handle
