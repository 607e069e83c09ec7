"""The run's status file: how the last run in an output directory ended, for a job script.

Under torchrun a preempted worker's exit status does not reach the job script (torchrun reports
any non-zero worker exit as a failure and exits 1), so ``extensions.preemption`` records the
outcome in ``<out_dir>/.snapkeep/status.json`` (rank 0, through the storage layer: one atomic
write) and ``snapkeep status OUT_DIR`` prints it with an exit code per state. States:

- ``running``: written when training starts, with the writing process's ``pid``, ``host`` and
  start token (``/proc/<pid>/stat``'s start time, so a reused pid is not taken for the run); still
  there after the job ended means the run died without a word (SIGKILL, out of memory, a node
  lost). On the same host :func:`is_alive` tells which (see there);
- ``preempted``: written after the preemption snapshot is committed on every rank; with a
  deadline (see :mod:`snapkeep._core.session.deadline`), ``preemption`` records where it was
  committed
  (``committed_to``: ``storage``, ``ram`` -- node RAM and peers, the durable write skipped --
  or ``none``) and the estimates the decision used (seconds);
- ``finished``: the manager was finalized without an error or a preemption;
- ``failed``: the training loop raised (the exception's type and first line in ``reason``); on
  another rank too, reported to rank 0 through the preemption extension's per-iteration
  agreement: ``reason`` is then ``rank <r>: <type>: <first line>`` for each failing rank.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from snapkeep._core.errors import SnapshotStorageError
from snapkeep._core.format.json_records import (
    RecordError,
    int_field,
    number_field,
    parse_json,
    str_field,
)
from snapkeep._core.format.manifest import MANIFEST_DIR
from snapkeep._core.storage import Storage

logger = logging.getLogger(__name__)

STATUS_NAME = "status.json"
"""File name of the status, under ``MANIFEST_DIR`` (``.snapkeep``) of the output directory."""

STATES = ("running", "preempted", "finished", "failed")
FORMAT = 1
#: Largest status file read, in bytes; most names listed; longest ``reason`` read.
MAX_STATUS_BYTES = 1 << 20
MAX_SNAPSHOTS = 4096
MAX_REASON_CHARS = 64 << 10


@dataclass(frozen=True, kw_only=True)
class RunStatus:
    """One run's outcome. ``step`` is the manager's iteration when it was recorded;
    ``time_unix_s`` seconds since the epoch (UTC); ``snapshots`` the names committed for a
    preemption; ``reason`` the signals or the error; ``world_size`` the number of ranks;
    ``pid``, ``host`` and ``start_token`` the writing process (0 and '' in files written before
    they were recorded); ``preemption`` the decision of a preemption (``committed_to``:
    ``'storage'``, ``'ram'`` or ``'none'``, ``remaining_s``, ``durable_estimate_s``,
    ``stage_s``, ``commit_s``, ``pending_s``: seconds or None where unknown,
    ``deadline_from``); empty when not preempted (or by a door without a deadline);
    ``staging`` the last budgeted snapshot's figures (``staging_budget``, see
    :class:`~snapkeep._core.save.budget.BudgetStats`: ``budget_bytes``, ``state_bytes``,
    ``predicted_stall_s``, ``staged_s``, ``copy_Bps``, ``write_Bps``), empty without one."""

    state: str
    step: int
    time_unix_s: float
    reason: str = ""
    snapshots: tuple[str, ...] = ()
    world_size: int = 1
    pid: int = 0
    host: str = ""
    start_token: str = ""
    preemption: Mapping[str, Any] = field(default_factory=dict)
    staging: Mapping[str, Any] = field(default_factory=dict)

    @property
    def durable(self) -> bool:
        """Whether the step of a ``preempted`` status is in storage (True for the other
        states and for statuses written before the preemption record existed)."""
        return self.preemption.get("committed_to", "storage") == "storage"

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, **asdict(self), "snapshots": list(self.snapshots),
                           "preemption": dict(self.preemption),
                           "staging": dict(self.staging)}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RunStatus:
        """Parse a status file (untrusted: bounded JSON, see
        :mod:`snapkeep._core.format.json_records`, every field's type and range checked).

        Raises:
            ValueError: not a status file of a known format, or a field out of its range (the
                message names the field and what is accepted).
        """
        try:
            raw: Any = parse_json(data, max_bytes=MAX_STATUS_BYTES)
        except RecordError as e:
            raise ValueError(str(e)) from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"not a snapkeep status of format {FORMAT}")
        state = str_field(raw, "state", max_chars=16)
        if state not in STATES:
            raise ValueError(f"field 'state' must be one of {STATES}, got {state[:20]!r}")
        snapshots = raw.get("snapshots", [])
        if not isinstance(snapshots, list) or len(snapshots) > MAX_SNAPSHOTS \
                or not all(isinstance(s, str) and len(s) <= 4096 for s in snapshots):
            raise ValueError(f"field 'snapshots' must be a list of at most {MAX_SNAPSHOTS} "
                             "names")
        preemption = raw.get("preemption") or {}
        if not isinstance(preemption, dict) or len(preemption) > 64:
            raise ValueError("field 'preemption' must be an object of at most 64 fields")
        staging = raw.get("staging") or {}
        if not isinstance(staging, dict) or len(staging) > 64:
            raise ValueError("field 'staging' must be an object of at most 64 fields")
        return cls(preemption=preemption, staging=staging, state=state,
                   step=int_field(raw, "step"),
                   time_unix_s=number_field(raw, "time_unix_s"),
                   reason=str_field(raw, "reason", max_chars=MAX_REASON_CHARS, default=""),
                   snapshots=tuple(snapshots),
                   world_size=int_field(raw, "world_size", low=1, high=1 << 31, default=1),
                   pid=int_field(raw, "pid", high=1 << 31, default=0),
                   host=str_field(raw, "host", max_chars=1024, default=""),
                   start_token=str_field(raw, "start_token", max_chars=1024, default=""))


def status_path(storage: Storage, directory: str) -> str:
    return storage.join(directory, MANIFEST_DIR, STATUS_NAME)


def write_status(storage: Storage, directory: str, *, state: str, step: int, reason: str = "",
                 snapshots: tuple[str, ...] = (), world_size: int = 1,
                 preemption: Mapping[str, Any] | None = None,
                 staging: Mapping[str, Any] | None = None,
                 clock: Any = time.time) -> RunStatus:
    """Record ``state`` for the run in ``directory`` (replaces the previous status atomically).

    Raises:
        OSError: the status could not be written.
    """
    pid = os.getpid()
    status = RunStatus(state=state, step=int(step), time_unix_s=float(clock()), reason=reason,
                       snapshots=tuple(snapshots), world_size=world_size, pid=pid,
                       host=socket.gethostname(), start_token=_start_token(pid) or "",
                       preemption=dict(preemption or {}), staging=dict(staging or {}))
    storage.makedirs(storage.join(directory, MANIFEST_DIR))
    storage.write_bytes(status_path(storage, directory), status.to_bytes(), tag="status")
    return status


def failure_reason(error: BaseException | str) -> str:
    """The ``reason`` of a ``failed`` status: the error's type and first line (at most 500
    characters); a :class:`~snapkeep._core.distributed.errors.RankFailedError` (an error on
    another rank, or on several) gives each failing rank's error instead."""
    from snapkeep._core.distributed.errors import RankFailedError

    if isinstance(error, RankFailedError):
        text = "; ".join(f"rank {r}: {m}" for r, m in sorted(error.failed.items()))
    elif isinstance(error, BaseException):
        text = f"{type(error).__name__}: {error}"
    else:
        text = error
    return text.splitlines()[0][:500] if text else ""


class StatusLog:
    """The status a door records for its run (rank 0 only; the states are agreed before they
    are recorded): ``running`` when it starts, then ``preempted``, ``failed`` or ``finished``,
    once. A status that cannot be written is logged, never raised: the snapshots are what
    matter.

    Args:
        storage, directory: the output directory (``.snapkeep/status.json`` in it).
        rank: this rank (only rank 0 writes).
        world_size: the number of ranks, recorded.
    """

    def __init__(self, storage: Storage, directory: str, *, rank: int = 0,
                 world_size: int = 1) -> None:
        self.storage = storage
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.final: str | None = None
        self.staging: dict[str, Any] = {}  # recorded with every state from now on
        self._running_step: int | None = None

    def note_staging(self, staging: Mapping[str, Any]) -> None:
        """The last budgeted snapshot's figures, recorded with the next state; the first ones
        also rewrite a ``running`` status at once (same step), so ``snapkeep status`` shows
        the prediction while the run goes on."""
        first = not self.staging
        self.staging = dict(staging)
        if first and self.final is None and self._running_step is not None:
            self.record("running", self._running_step)

    def record(self, state: str, step: int, **fields: Any) -> None:
        """Record ``state`` at ``step`` (``reason``, ``snapshots``); nothing after a final
        state (``preempted``, ``failed``, ``finished``) was recorded."""
        if self.final is not None:
            return
        if state == "running":
            self._running_step = step
        if self.staging:
            fields.setdefault("staging", self.staging)
        if state != "running":
            self.final = state
        if self.rank != 0:
            return
        try:
            write_status(self.storage, self.directory, state=state, step=step,
                         world_size=self.world_size, **fields)
        except OSError as e:
            logger.warning("rank 0: could not record the run's status %r in %s: %s", state,
                           self.directory, e)


def read_status(storage: Storage, directory: str) -> RunStatus | None:
    """The status recorded in ``directory``; None when there is none.

    Raises:
        ValueError: the file exists but is not a valid status (also: larger than
            :data:`MAX_STATUS_BYTES`, or not a regular file).
        OSError: it could not be read.
    """
    path = status_path(storage, directory)
    try:
        data = storage.read_bytes(path, max_bytes=MAX_STATUS_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.EFBIG, errno.EINVAL) and not isinstance(e, SnapshotStorageError):
            raise ValueError(str(e)) from None  # what is there is no status file
        raise
    return RunStatus.from_bytes(data)


def is_alive(status: RunStatus) -> bool | None:
    """Whether the process that wrote ``status`` still runs: checked only on the host that wrote
    it (``socket.gethostname()``), by its pid (``os.kill(pid, 0)``) and, where ``/proc`` exists,
    its start token (a pid reused by another process is not the run; a zombie has exited).
    None when this cannot be told: another host (a multi-node job's rank 0 node), or no pid
    recorded."""
    if status.pid <= 0 or not status.host or status.host != socket.gethostname():
        return None
    try:
        os.kill(status.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process with that pid: it exists
    token = _start_token(status.pid, live_only=True)
    if token is None and os.path.isdir("/proc"):
        return False  # gone meanwhile, or a zombie
    if status.start_token and token is not None and token != status.start_token:
        return False  # the pid was reused
    return True


def _start_token(pid: int, *, live_only: bool = False) -> str | None:
    """Boot id and start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat``
    field 22); None where ``/proc`` is not there (macOS), the process is gone, or (with
    ``live_only``) it is a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().decode(errors="replace").strip()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the name in parentheses may hold spaces
    if len(fields) <= 19 or live_only and fields[0] in ("Z", "X"):
        return None
    return f"{boot}:{fields[19]}"
