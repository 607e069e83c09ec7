"""The run around a store (public names for the doors): the :class:`Session` every door opens,
saves, resumes and closes through (:mod:`snapkeep._core.session.session`); the one background
lane under every save (:class:`SaveEngine`, :mod:`snapkeep._core.save.engine`); the one run control
(preemption with its deadline, run status); the run lineage; what a door says to the user; and
the cadence of ``every="auto"`` with the goodput of the runs in a directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from snapkeep._core.load.resume_notice import check_quiet, say
from snapkeep._core.save.engine import SaveEngine
from snapkeep._core.save.ticket import SaveHandle
from snapkeep._core.session.cadence import (
    AutoInterval,
    Cadence,
    Choice,
    check_every,
    checkfreq_interval_s,
    choose,
    daly_interval_s,
    estimate_mtbf_s,
    young_interval_s,
)
from snapkeep._core.session.deadline import (
    Estimate,
    Grace,
    Plan,
    SaveTimes,
    check_grace_s,
    grace_from,
)
from snapkeep._core.session.goodput import Goodput, RunHistory, read_runs, summarize
from snapkeep._core.session.run_control import RunControl, preemption_signals
from snapkeep._core.session.run_status import RunStatus
from snapkeep._core.session.run_status import is_alive as run_is_alive
from snapkeep._core.session.run_status import read_status as read_run_status
from snapkeep._core.session.run_status import write_status as write_run_status
from snapkeep._core.session.session import Session
from snapkeep._core.storage import resolve_storage
from snapkeep._core.store.lineage import RunLineage, warn_about_existing
from snapkeep._core.user_warnings import user_stacklevel, warn_user


def run_status(out_dir: str, *, fs: Any = None,
               storage_options: Mapping[str, Any] | None = None) -> RunStatus | None:
    """How the last run with ``extensions.preemption`` in ``out_dir`` ended (its
    ``.snapkeep/status.json``; see :mod:`snapkeep._core.session.run_status`), or None without one.

    Raises:
        ValueError: the status file is not valid.
        OSError, SnapshotStorageError: it could not be read.
    """
    storage, path = resolve_storage(out_dir, fs, dict(storage_options or {}))
    return read_run_status(storage, path)


def run_goodput(out_dir: str, *, fs: Any = None,
                storage_options: Mapping[str, Any] | None = None) -> Goodput | None:
    """The goodput of the runs recorded in ``out_dir`` (its ``.snapkeep/goodput.json``, written
    by a door with ``every="auto"``; see :mod:`snapkeep._core.session.goodput`), or None
    without a history.

    Raises:
        ValueError: the history is not valid.
        OSError, SnapshotStorageError: it could not be read.
    """
    storage, path = resolve_storage(out_dir, fs, dict(storage_options or {}))
    runs = read_runs(storage, path)
    return summarize(runs) if runs else None


__all__ = [
    "AutoInterval", "Cadence", "Choice", "Estimate", "Goodput", "Grace", "Plan", "RunControl",
    "RunHistory", "RunLineage", "RunStatus", "SaveEngine", "SaveHandle", "SaveTimes", "Session",
    "check_every", "check_grace_s", "check_quiet", "checkfreq_interval_s", "choose",
    "daly_interval_s", "estimate_mtbf_s", "grace_from", "preemption_signals", "run_goodput",
    "run_is_alive", "run_status", "say", "user_stacklevel", "warn_about_existing", "warn_user",
    "write_run_status", "young_interval_s",
]
