"""A staging budget: snapshots staged and written in pieces through at most ``staging_budget``
bytes of host memory.

Without a budget a background snapshot stages a full copy of the state (``max_pending`` copies at
most), so it holds the state's size in host memory while it writes. With
``staging_budget=N`` and a state larger than ``N`` bytes, the save is a *stream*:

- At the call, the state's containers and non-tensor leaves are copied (the skeleton that
  ``torch.save`` pickles), and every tensor storage smaller than
  :data:`~snapkeep._core.save.overlap.MIN_DEFERRED_BYTES` that no guarded optimizer protects is
  copied into its own small buffer (counted against the budget).
- The large storages are copied, in the order ``torch.save`` writes them, in pieces of at most
  ``N / 8`` bytes into a ring of ``N`` bytes (minus the small copies); the writer thread writes
  each piece into the snapshot file as soon as it is copied and gives its room back.
- Consistency is the same as without a budget: a storage no optimizer protects is copied before
  the call returns (the call waits for the ring to drain through the last of them: that is the
  part of the stall the budget cannot hide); a storage owned by a guarded optimizer (the overlap
  of :mod:`snapkeep._core.save.overlap`) may be copied after the call, and that optimizer's next
  ``step()`` waits until every one of them is copied, then validates their version counters on
  the training thread. The file is published (renamed) only after that verdict: a moved counter
  drops the snapshot, never tears it.
- A storage larger than the ring is copied and written piece by piece (never refused).
- The bytes of the file are exactly those of :func:`~snapkeep._core.format.codec.torch_save`:
  ``torch.save``'s own ``_save`` under ``torch.serialization.skip_data`` writes the pickle and
  the zip records, and each skipped tensor record (a ``seek`` of its length on our file) is
  filled from the ring.

Host memory above training's own is then the ring plus the small copies (the budget) plus the
skeleton and the writer's own buffers (a constant, measured in ``benchmarks/bench_budget.py``).

The time until every tensor is staged, from the call, is predicted from the pieces the storages
go through the ring in (each storage in blocks of ``P`` bytes, its last one partly filled: a
ring of ``B`` blocks holds ``B`` pieces, not always ``R`` bytes), and what the previous streamed
snapshot measured: the copy rate ``c``, the rate ``w`` at which the writer drained the ring
while the stager copied (the writes and the writer's own work between them; the writer runs
faster once it is alone, so the rate over the whole write overstates it) and the writer's lag
``L`` (from the call to its first piece's write: its thread, the file, the pickle before the
first record): with ``S`` bytes in ``n > B`` pieces, ``D`` the bytes of all but the last ``B``
pieces (written before the last piece has room), ``max(S / c, max(p_1 / c, L) + D / w + p_n /
c)``, else ``S / c``. With the optimizer step right after the call that is the stall. (With
``D = S - R`` and ``w`` over the whole write, the forecast ran 0.1-0.3 s short at half the
state's size, 2 GiB in 85 MiB tensors: a ring of 8 blocks of 128 MiB held 8 pieces of 85 MiB,
683 MiB, not 1 GiB; and the writer runs faster once it is alone.)
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import logging
import mmap
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from snapkeep._core.errors import SnapshotError, SnapshotTimeoutError

logger = logging.getLogger(__name__)

#: Most pieces the ring holds at once (the piece size is the ring's size over this).
RING_PIECES = 8
#: Smallest ring a budget may leave after the small copies, bytes.
MIN_RING_BYTES = 1 << 20
_PAGE = mmap.PAGESIZE
_POLL_S = 0.5


def check_staging_budget(value: Any) -> int | None:
    """Return ``value`` as the budget in bytes, or None (unbounded).

    Raises:
        TypeError, ValueError: naming ``staging_budget`` and the accepted values.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"staging_budget must be a positive int (bytes of host memory for "
                        f"staging a snapshot) or None (unbounded: a full copy of the state), "
                        f"got {value!r}")
    if value < MIN_RING_BYTES:
        raise ValueError(f"staging_budget must be a positive int of at least {MIN_RING_BYTES} "
                         f"bytes (1 MiB) or None (unbounded), got {value!r}; e.g. "
                         "staging_budget=512 << 20 for 512 MiB")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetStats:
    """One streamed snapshot, measured (all times from the call, seconds; sizes in bytes).

    Attributes:
        budget_bytes: the staging budget.
        state_bytes: tensor bytes of the state.
        streamed_bytes: bytes that went through the ring.
        ring_bytes: the ring's size.
        held_bytes: small storages copied at the call.
        call_s: time the call waited for the ring (unprotected storages).
        staged_s: time until every storage was copied.
        copy_Bps: copy rate (bytes per second of time spent copying pieces).
        write_Bps: the rate the writer drained the ring while the stager copied (bytes written
            from its first piece's write until the last piece was copied, over that time; when
            fewer than half a ring was written by then, over the whole write).
        predicted_staged_s: the prediction of ``staged_s`` made at the call from the previous
            snapshot's rates (None for the first one).
        write_lag_s: time from the call to the writer's first piece's write.
        pieces: the streamed pieces' sizes, in order (what the forecast is computed from).
        blocks: the ring's blocks.
    """

    budget_bytes: int
    state_bytes: int
    streamed_bytes: int
    ring_bytes: int
    held_bytes: int
    call_s: float
    staged_s: float
    copy_Bps: float
    write_Bps: float
    predicted_staged_s: float | None
    write_lag_s: float = 0.0
    pieces: tuple[int, ...] = ()
    blocks: int = RING_PIECES

    def as_status(self) -> dict[str, Any]:
        """The figures the run status records (``snapkeep status``)."""
        return {"budget_bytes": self.budget_bytes, "state_bytes": self.state_bytes,
                "ring_bytes": self.ring_bytes, "predicted_stall_s": self.predicted_staged_s,
                "staged_s": self.staged_s, "copy_Bps": self.copy_Bps,
                "write_Bps": self.write_Bps, "write_lag_s": self.write_lag_s}


def piece_sizes(storage_bytes: list[int], piece_bytes: int) -> list[int]:
    """The pieces (bytes) storages of ``storage_bytes`` go through a ring of ``piece_bytes``
    blocks in: each storage in blocks of its own, its last one partly filled."""
    return [min(piece_bytes, n - off) for n in storage_bytes for off in range(0, n, piece_bytes)]


def predict_staged_s(pieces: list[int], blocks: int, copy_Bps: float, write_Bps: float,
                     write_lag_s: float = 0.0) -> float:
    """Seconds from the call until every streamed byte is copied (see the module docstring):
    ``pieces`` (bytes, in order) through a ring of ``blocks`` blocks."""
    streamed = sum(pieces)
    copy_s = streamed / copy_Bps
    if len(pieces) <= blocks:
        return copy_s
    drained = sum(pieces[:len(pieces) - blocks])  # written before the last piece has room
    return max(copy_s, max(pieces[0] / copy_Bps, write_lag_s) + drained / write_Bps
               + pieces[-1] / copy_Bps)


class Ring:
    """``size`` bytes of page-aligned host memory in :data:`RING_PIECES` equal blocks, reused by
    every streamed snapshot of one writer; one stream uses it at a time (:meth:`claim`). Its
    pages are touched once when it is made, so the first snapshot's copy rate (from which the
    next one's stall is forecast) is a copy's, not a first touch's."""

    def __init__(self, size: int) -> None:
        self.piece = max(_PAGE, size // RING_PIECES // _PAGE * _PAGE)
        count = max(1, size // self.piece)
        self.size = count * self.piece
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        self._map = mmap.mmap(-1, self.size, flags=flags) if flags else mmap.mmap(-1, self.size)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.address = int(self._array.ctypes.data)
        for off in range(0, self.size, 64 << 20):  # fault in (releases the GIL)
            ctypes.memset(self.address + off, 0, min(64 << 20, self.size - off))
        self._free = list(range(count))
        self._cond = threading.Condition()
        self._owner: object | None = None

    def claim(self, owner: object, abort: threading.Event) -> bool:
        """Wait until no other stream uses the ring; False when ``abort`` was set first."""
        with self._cond:
            while self._owner is not None:
                if abort.is_set():
                    return False
                self._cond.wait(_POLL_S)
            self._owner = owner
            return True

    def unclaim(self, owner: object) -> None:
        with self._cond:
            if self._owner is owner:
                self._owner = None
                self._free = list(range(self.size // self.piece))
            self._cond.notify_all()

    def take(self, abort: threading.Event) -> int | None:
        """A free block's index (waits for one); None when ``abort`` was set first."""
        with self._cond:
            while not self._free:
                if abort.is_set():
                    return None
                self._cond.wait(_POLL_S)
            return self._free.pop()

    def give(self, block: int) -> None:
        with self._cond:
            self._free.append(block)
            self._cond.notify_all()

    def view(self, block: int, nbytes: int) -> memoryview:
        start = block * self.piece
        return memoryview(self._array[start:start + nbytes])  # type: ignore[arg-type]

    def close(self) -> None:
        del self._array
        try:
            self._map.close()
        except BufferError:  # a view still exported (a failed write's traceback): GC frees it
            pass


_Piece = tuple[int, int, int, int]  # (storage position in write order, offset, block, nbytes)


class Stream:
    """One budgeted snapshot: the skeleton ``torch.save`` pickles, the stager that copies the
    large storages into the ring, and the savefun that writes them (see the module docstring).

    Thread use: :meth:`start` and :meth:`wait_call` on the training thread; :meth:`copy` (the
    overlap's background copy, :class:`~snapkeep._core.save.overlap.PendingVerdict`) on the
    staging thread; :meth:`savefun` on the writer's thread; :meth:`abort` from anywhere.
    """

    def __init__(self, *, ring: Ring, skeleton: Any, order: list[torch.UntypedStorage],
                 held: dict[int, torch.UntypedStorage], protected: list[bool],
                 members: list[tuple[str, torch.Tensor, int]], budget_bytes: int,
                 state_bytes: int, predicted_staged_s: float | None,
                 alignment: int) -> None:
        self.ring = ring
        self.skeleton = skeleton
        self._order = order  # storages of the file's records, in write order
        self._held = held  # position -> its small copy
        self._protected = protected
        self.members = members  # for the overlap's verdict: (path, tensor, version at the call)
        self._budget = budget_bytes
        self._state_bytes = state_bytes
        self._predicted = predicted_staged_s
        self._alignment = alignment
        last_unprotected = [i for i, p in enumerate(protected) if not p and i not in held]
        self._call_upto = last_unprotected[-1] if last_unprotected else -1
        self._pieces: list[_Piece] = []
        self._cond = threading.Condition()
        self.abort_event = threading.Event()
        self._error: BaseException | None = None
        self.call_done = threading.Event()
        self.all_done = threading.Event()
        self._t0 = time.perf_counter()
        self._copy_s = 0.0
        self._first_write_at: float | None = None  # the writer's first piece, started
        self._last_write_end = 0.0
        self._written = 0  # bytes of pieces written
        self._written_when_staged = 0  # ... when the last piece was copied
        self._streamed = 0
        self._staged_s = 0.0
        self._call_s = 0.0
        self.verdict_wait: Callable[[], None] | None = None
        self.stats: BudgetStats | None = None

    # -- the stager (its own thread) -------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._stage, name="snapkeep-budget-stage", daemon=True).start()

    def _stage(self) -> None:
        try:
            if not self.ring.claim(self, self.abort_event):
                raise SnapshotError("the snapshot was abandoned before it was staged")
            if self._call_upto < 0:
                self.call_done.set()
            for pos, src in enumerate(self._order):
                nbytes = src.nbytes()
                if pos in self._held or not nbytes:
                    continue
                for off in range(0, nbytes, self.ring.piece):
                    size = min(self.ring.piece, nbytes - off)
                    block = self.ring.take(self.abort_event)
                    if block is None:
                        raise SnapshotError("the snapshot's write ended before it was staged")
                    start = time.perf_counter()
                    dst = self.ring.address + block * self.ring.piece
                    if src.device.type == "cpu":
                        ctypes.memmove(dst, src.data_ptr() + off, size)
                    else:
                        out = torch.frombuffer(self.ring.view(block, size), dtype=torch.uint8)
                        whole = torch.empty((0,), dtype=torch.uint8, device=src.device).set_(src)
                        out.copy_(whole[off:off + size])
                    self._copy_s += time.perf_counter() - start
                    self._streamed += size
                    with self._cond:
                        self._pieces.append((pos, off, block, size))
                        self._cond.notify_all()
                if pos == self._call_upto:
                    self._call_s = time.perf_counter() - self._t0
                    self.call_done.set()
            self._staged_s = time.perf_counter() - self._t0
            self._written_when_staged = self._written
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            self.call_done.set()
            self.all_done.set()

    # -- the training thread ---------------------------------------------------------------------
    def wait_call(self, timeout_s: float | None) -> None:
        """Wait until every storage no optimizer protects is copied (the call's part).

        Raises:
            SnapshotTimeoutError: not within ``timeout_s``.
        """
        if not self.call_done.wait(timeout_s):
            raise SnapshotTimeoutError(
                f"a budgeted snapshot's call waited {timeout_s} s for its ring to drain "
                "(the writer is slower than that); raise timeout_s or staging_budget")

    def copy(self) -> Any:
        """The overlap's background copy: wait until every storage is copied; return the
        stats :class:`~snapkeep._core.save.overlap.PendingVerdict` resolves with.

        Raises:
            Exception: the stager's error (the snapshot is dropped).
        """
        from snapkeep._core.save.staging import StageStats

        self.all_done.wait()
        if self._error is not None:
            raise self._error
        return StageStats(tensor_bytes=self._state_bytes, allocated_bytes=0,
                          num_storages=len(self._order))

    def moved(self) -> Any:
        from snapkeep._core.save.overlap import race_error

        for name, t, version in self.members:
            if t._version != version:
                return race_error(name, version, t._version)
        return None

    def abort(self) -> None:
        """Stop the stager (the snapshot will not be written) and give the ring back."""
        self.abort_event.set()
        with self._cond:
            self._cond.notify_all()
        self.all_done.wait()
        self.ring.unclaim(self)

    # -- the writer's thread ---------------------------------------------------------------------
    def savefun(self, obj: Any, f: Any, **kwargs: Any) -> None:
        """Write the snapshot file (``obj`` is :attr:`skeleton`), byte for byte what
        :func:`~snapkeep._core.format.codec.torch_save` writes for the state at the call; then
        wait for the overlap's verdict, if any, before returning (the storage publishes
        after).

        Raises:
            SnapshotError: the stream failed or was abandoned; StagingRaceError: the verdict
            dropped the snapshot; OSError and the like: the file's.
        """
        ser: Any = torch.serialization
        sink = _StreamFile(f, self)
        writer = torch._C.PyTorchFileWriter(sink, False, self._alignment)  # type: ignore[call-overload]
        try:
            with ser.skip_data():
                ser._save(obj, writer, pickle, ser.DEFAULT_PROTOCOL, False)
        except BaseException:
            try:
                writer.write_end_of_file()
            except Exception:
                pass
            self.abort_event.set()
            raise
        writer.write_end_of_file()
        if sink.position != len(self._order):
            raise SnapshotError(f"a budgeted snapshot wrote {sink.position} of "
                                f"{len(self._order)} tensor records; nothing was published")
        f.flush()
        if self.verdict_wait is not None:
            self.verdict_wait()
        first = self._first_write_at
        written, writing_s = self._streamed, 0.0 if first is None else self._last_write_end - first
        if first is not None and self._written_when_staged >= self.ring.size // 2 \
                and self._t0 + self._staged_s > first:  # the rate while the stager copied
            written = self._written_when_staged  # (what the forecast needs: the writer runs
            writing_s = self._t0 + self._staged_s - first  # faster once it is alone)
        self.stats = BudgetStats(
            budget_bytes=self._budget, state_bytes=self._state_bytes,
            streamed_bytes=self._streamed, ring_bytes=self.ring.size,
            held_bytes=sum(s.nbytes() for s in self._held.values()), call_s=self._call_s,
            staged_s=self._staged_s,
            copy_Bps=self._streamed / self._copy_s if self._copy_s > 0 else 0.0,
            write_Bps=written / writing_s if writing_s > 0 else 0.0,
            predicted_staged_s=self._predicted,
            write_lag_s=0.0 if first is None else first - self._t0,
            pieces=tuple(piece_sizes([s.nbytes() for p, s in enumerate(self._order)
                                      if p not in self._held], self.ring.piece)),
            blocks=self.ring.size // self.ring.piece)

    def _next_piece(self) -> _Piece:
        with self._cond:
            while not self._pieces:
                if self._error is not None:
                    raise SnapshotError(f"budgeted staging failed: {self._error}") \
                        from self._error
                if self.abort_event.is_set():
                    raise SnapshotError("the snapshot was abandoned while it was written")
                self._cond.wait(_POLL_S)
            return self._pieces.pop(0)

    def write_record(self, f: Any, position: int, nbytes: int) -> None:
        """Write the tensor record at ``position`` (``nbytes`` long) into ``f``."""
        while position < len(self._order) and not self._order[position].nbytes():
            position += 1  # empty records are not written (torch writes nothing for them)
        if position >= len(self._order) or self._order[position].nbytes() != nbytes:
            raise SnapshotError("a budgeted snapshot's records are not in the order they were "
                                "staged in; nothing was published")
        held = self._held.get(position)
        if held is not None:
            f.write(memoryview(_bytes_of(held)))
            return
        done = 0
        while done < nbytes:
            pos, off, block, size = self._next_piece()
            if pos != position or off != done:
                raise SnapshotError("a budgeted snapshot's pieces are out of order; nothing "
                                    "was published")
            if self._first_write_at is None:
                self._first_write_at = time.perf_counter()
            f.write(self.ring.view(block, size))
            self._last_write_end = time.perf_counter()
            self._written += size
            self.ring.give(block)
            done += size

    def close(self) -> None:
        """After the write, whichever way it ended: stop the stager, give the ring back."""
        self.abort()


def _bytes_of(storage: torch.UntypedStorage) -> Any:
    return (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())


class _StreamFile(io.RawIOBase):
    """The file ``torch.save`` writes into: bytes pass through to ``f``; a skipped tensor record
    (``seek(n, SEEK_CUR)``) is filled from the stream."""

    def __init__(self, f: Any, stream: Stream) -> None:
        super().__init__()
        self._f = f
        self._stream = stream
        self.position = 0  # next record in write order (empty ones counted when skipped)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        self._f.write(data)
        return len(memoryview(data))

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 1:
            raise io.UnsupportedOperation("a budgeted snapshot's file is written in order")
        order = self._stream._order
        while self.position < len(order) and not order[self.position].nbytes():
            self.position += 1
        self._stream.write_record(self._f, self.position, offset)
        self.position += 1
        while self.position < len(order) and not order[self.position].nbytes():
            self.position += 1
        return 0

    def flush(self) -> None:
        pass


class _OrderPickler(pickle.Pickler):
    """Records the storages a pickle of the skeleton meets, in ``torch.save``'s order."""

    def __init__(self, sink: Any) -> None:
        super().__init__(sink, protocol=2)
        self.seen: dict[int, torch.UntypedStorage] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            obj = obj._untyped_storage
        if isinstance(obj, torch.UntypedStorage):
            self.seen.setdefault(obj._cdata, obj)
            return obj._cdata
        return None


class _NullSink:
    def write(self, data: Any) -> int:
        return len(data)


def write_order(skeleton: Any) -> list[torch.UntypedStorage]:
    """The storages of ``skeleton`` in the order ``torch.save`` writes their records."""
    pickler = _OrderPickler(_NullSink())
    pickler.dump(skeleton)
    return list(pickler.seen.values())


def tensor_bytes(tree: Any) -> int:
    """Bytes of the distinct tensor storages of ``tree`` (what a full staging copy holds).

    Raises:
        TypeError: as staging (tensors that cannot be staged).
    """
    from snapkeep._core.save.staging import collect_storages

    return sum(s.nbytes() for s in collect_storages(tree)[1])


def build_stream(tree: Any, *, budget_bytes: int, ring_for: Callable[[int], Ring],
                 plan: Any = None, previous: BudgetStats | None = None,
                 alignment: Callable[[Any], int]) -> Stream | None:
    """Plan a budgeted snapshot of ``tree`` (on the training thread, at the call), or None when
    a full copy of its tensors fits ``budget_bytes`` (the ordinary staging then runs).

    ``plan``: the call's :class:`~snapkeep._core.save.overlap.OverlapPlan` (its protected
    storages may be copied after the call), or None (every storage is copied before the call
    returns). ``ring_for(size)``: the writer's ring of at most ``size`` bytes.
    ``alignment(skeleton)``: the tensor records' alignment in the file.

    Raises:
        ValueError: the state's small storages leave less than :data:`MIN_RING_BYTES` of the
            budget (names ``staging_budget`` and the bytes needed).
        TypeError: as staging (tensors that cannot be staged).
    """
    from snapkeep._core.save.overlap import MIN_DEFERRED_BYTES
    from snapkeep._core.save.staging import collect_storages, rebuild_onto

    sources, storages = collect_storages(tree)
    state_bytes = sum(s.nbytes() for s in storages)
    if state_bytes <= budget_bytes:
        return None
    idents = {index: ident for ident, index in sources.items()}
    members: list[tuple[str, torch.Tensor, int]] = []
    if plan is not None:
        defer, by_storage = plan.protection(tree)
        protected = {i for i, ident in idents.items()
                     if storages[i].device.type == "cpu" and defer(ident)}
        members = [m for i in sorted(protected) for m in by_storage[idents[i]]]
    else:
        protected = set()
    placeholders: list[torch.UntypedStorage] = []
    held_by_index: dict[int, torch.UntypedStorage] = {}
    for index, src in enumerate(storages):
        nbytes = src.nbytes()
        if index not in protected and nbytes < MIN_DEFERRED_BYTES:
            copy = torch.UntypedStorage(nbytes)
            if nbytes:
                copy.copy_(src)
            held_by_index[index] = copy
            placeholders.append(copy)
        elif src.device.type == "cpu":
            placeholders.append(src)  # only its size and dtype are read by the pickle
        else:  # an accelerator storage saves as a CPU one, as staged (never touched: no RSS)
            placeholders.append(torch.UntypedStorage(nbytes))
    held_bytes = sum(s.nbytes() for s in held_by_index.values())
    if budget_bytes - held_bytes < MIN_RING_BYTES:
        raise ValueError(
            f"staging_budget={budget_bytes} bytes is too small for this state: its "
            f"{len(held_by_index)} small tensors alone take {held_bytes} bytes at the call, and "
            f"the ring needs {MIN_RING_BYTES} more; pass staging_budget >= "
            f"{held_bytes + MIN_RING_BYTES} or None")
    skeleton = rebuild_onto(tree, sources, placeholders)
    index_of = {s._cdata: i for i, s in enumerate(placeholders)}
    order: list[torch.UntypedStorage] = []
    held: dict[int, torch.UntypedStorage] = {}
    is_protected: list[bool] = []
    for position, storage in enumerate(write_order(skeleton)):
        found = index_of.get(storage._cdata)
        if found is None or found in held_by_index:  # a copy made at the call
            copy = storage if found is None else held_by_index[found]
            held[position] = copy
            order.append(copy)
            is_protected.append(False)
        else:
            order.append(storages[found])
            is_protected.append(found in protected)
    ring = ring_for(budget_bytes - held_bytes)
    pieces = piece_sizes([s.nbytes() for p, s in enumerate(order) if p not in held],
                         ring.piece)
    predicted = None
    if previous is not None and previous.copy_Bps > 0 and previous.write_Bps > 0:
        predicted = predict_staged_s(pieces, ring.size // ring.piece, previous.copy_Bps,
                                     previous.write_Bps, previous.write_lag_s)
    return Stream(ring=ring, skeleton=skeleton, order=order, held=held, protected=is_protected,
                  members=members, budget_bytes=budget_bytes, state_bytes=state_bytes,
                  predicted_staged_s=predicted, alignment=alignment(skeleton))


__all__ = ["MIN_RING_BYTES", "BudgetStats", "Ring", "Stream", "build_stream", "piece_sizes",
           "check_staging_budget", "predict_staged_s", "tensor_bytes", "write_order"]
