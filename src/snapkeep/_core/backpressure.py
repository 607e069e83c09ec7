"""Back-pressure: at most ``max_pending`` snapshots are staged or being written at once, each
holding one reusable buffer set (so memory is bounded by ``max_pending`` copies of the state). When
all are busy, ``on_full`` decides:

- ``'block'`` (default): wait for a slot; a log line every ``warn_after_s`` names the snapshot being
  waited on; ``timeout_s`` bounds the wait with :class:`SnapshotTimeoutError`.
- ``'skip'``: drop the new snapshot (logged) and return ``None``.
- ``'replace'``: drop the oldest snapshot that has not started writing (logged) and take its slot;
  when every pending snapshot is already being written, block as ``'block'``.

:class:`SlotPool` is the half of :class:`~snapkeep._core.saver.Saver` that hands out and takes
back those slots; the saver sets the attributes it declares.
"""

from __future__ import annotations

import logging
import threading
import time

from snapkeep._core.errors import SnapshotTimeoutError
from snapkeep._core.staging import BufferSet
from snapkeep._core.ticket import SaveHandle, _Slot

logger = logging.getLogger(__name__)

ON_FULL_POLICIES = ("block", "skip", "replace")


class SlotPool:
    """The saver's slots (see the module docstring); every method is called with or takes
    ``_cond``, which also guards the saver's other shared state.

    Attributes (set by the saver's ``__init__``):
        max_pending: most slots (>= 1).
        on_full: ``'block'``, ``'skip'`` or ``'replace'``.
        timeout_s: bound on a blocked slot acquisition, seconds (``None``: unbounded).
        warn_after_s: interval of the "still waiting" log line, seconds.
    """

    max_pending: int
    on_full: str
    timeout_s: float | None
    warn_after_s: float
    _slots: list[_Slot]
    _cond: threading.Condition

    def _new_buffers(self) -> BufferSet:
        """A fresh buffer set for a new slot (the saver's: shared memory for a worker process)."""
        raise NotImplementedError

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until nothing is pending (errors are kept for ``raise_pending_error``).

        Raises:
            SnapshotTimeoutError: still pending after ``timeout_s`` seconds.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while any(s.handle is not None for s in self._slots):
                if not self._wait_step(deadline, "all pending snapshots"):
                    pending = [s.handle.path for s in self._slots if s.handle is not None]
                    raise SnapshotTimeoutError(
                        f"snapshots {pending} still not committed after {timeout_s} s"
                    )

    @property
    def pending(self) -> int:
        with self._cond:
            return sum(1 for s in self._slots if s.handle is not None)

    def pending_paths(self) -> list[str]:
        """Paths of the snapshots staged or being written, oldest slot first."""
        with self._cond:
            return [s.handle.path for s in self._slots if s.handle is not None]

    def _acquire_slot(self, handle: SaveHandle) -> _Slot | None:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                for slot in self._slots:
                    if slot.handle is None:
                        slot.handle, slot.started = handle, False
                        return slot
                if len(self._slots) < self.max_pending:
                    slot = _Slot(buffers=self._new_buffers(), handle=handle)
                    self._slots.append(slot)
                    return slot
                if self.on_full == "skip":
                    busy = [s.handle.path for s in self._slots if s.handle is not None]
                    logger.warning(
                        "skipping snapshot %s (step %s): %d snapshot(s) still in flight %s "
                        "(on_full='skip')", handle.path, handle.step, len(busy), busy)
                    return None
                if self.on_full == "replace":
                    for slot in self._slots:
                        old = slot.handle
                        if old is not None and not slot.started and old.committed.cancel():
                            # its queued ticket is skipped by the dispatcher (cancelled future)
                            logger.warning(
                                "replacing pending snapshot %s (step %s) by %s (step %s) "
                                "(on_full='replace')", old.path, old.step, handle.path,
                                handle.step)
                            slot.handle = handle
                            return slot
                if not self._wait_step(deadline, handle.path):
                    busy = [s.handle.path for s in self._slots if s.handle is not None]
                    raise SnapshotTimeoutError(
                        f"snapshot {handle.path!r} waited {self.timeout_s} s for a slot: "
                        f"{self.max_pending} earlier snapshot(s) still writing {busy}; raise "
                        "timeout_s or max_pending, or use on_full='skip'"
                    )

    def _wait_step(self, deadline: float | None, what: str) -> bool:
        """One bounded wait on the condition; False when the deadline passed. Caller holds it."""
        start = time.monotonic()
        step = self.warn_after_s
        if deadline is not None:
            remaining = deadline - start
            if remaining <= 0:
                return False
            step = min(step, remaining)
        if not self._cond.wait(timeout=step):
            waited = time.monotonic() - start
            busy = [s.handle.path for s in self._slots if s.handle is not None]
            logger.warning("still waiting for snapshot(s) %s to commit before %s (%.0f s)",
                           busy, what, waited)
        return deadline is None or time.monotonic() < deadline

    def _release(self, slot: _Slot, handle: SaveHandle) -> None:
        with self._cond:
            if slot.handle is handle:
                slot.handle = None
                slot.started = False
            self._cond.notify_all()
