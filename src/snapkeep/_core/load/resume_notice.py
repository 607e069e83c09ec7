"""What autoload tells the user: which snapshot it resumed from (or that it starts fresh) and
each snapshot it skipped, one line each on stderr, once per job.

A resume used to be an INFO log record (invisible by default) and a skipped snapshot a Python
warning on every rank (or a log record per rank, or nothing for an incomplete sharded
directory). Here every kind of snapshot extension builds one :class:`ResumeNotice` in
``initialize`` and :func:`announce` writes it on stderr, from rank 0 only under
``torch.distributed`` (every rank chose the same snapshot, so one copy says it all), unless the
extension was created with ``quiet=True``. The lines look like::

    snapkeep: resuming from snapshot_iter_200 (step 200) in /runs/a
    snapkeep: skipped snapshot_iter_300 (step 300): <reason>
    snapkeep: no snapshot of 'snapshot_iter_{.iteration}' in /runs/a, starting fresh

The same text goes to this module's logger at INFO (with the rank), so a job that routes
logging into files keeps it too.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TextIO

from snapkeep._core.distributed.groups import job_rank

logger = logging.getLogger(__name__)

PREFIX = "snapkeep: "
"""Start of every line :func:`announce` writes (so a job log can be grepped for it)."""

INCOMPLETE_SHARDED = "incomplete sharded directory (no marker: a save was interrupted); removed"
#: Why a torch.distributed.checkpoint directory snapkeep did not write is not resumed from.
FOREIGN_SHARDED = ("a torch.distributed.checkpoint directory snapkeep did not write (no commit "
                   "marker, so no checksums): not resumed from, never deleted; to continue from "
                   "it, load it once with torch.distributed.checkpoint.load, or move it away")
"""Reason given for a sharded snapshot directory without its marker, swept by rank 0."""


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """A snapshot autoload did not resume from, and why (one line of the notice)."""

    name: str
    step: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class ResumeNotice:
    """What one autoload did: ``loaded`` (a snapshot name) at ``step``, or nothing (a fresh
    start), in ``directory`` for ``template``, and the snapshots it ``skipped``."""

    directory: str
    template: str
    loaded: str | None = None
    step: int | None = None
    skipped: tuple[Skipped, ...] = ()

    def lines(self) -> list[str]:
        """The lines to print, without newlines: the outcome first, then each skipped snapshot,
        newest first."""
        if self.loaded is None:
            head = (f"{PREFIX}no snapshot of {self.template!r} in {self.directory}, "
                    "starting fresh")
        else:
            head = f"{PREFIX}resuming from {self.loaded} (step {self.step}) in {self.directory}"
        return [head, *(f"{PREFIX}skipped {s.name} (step {s.step}): {s.reason}"
                        for s in self.skipped)]


def announce(notice: ResumeNotice, *, quiet: bool, rank: int | None = None,
             stream: TextIO | None = None) -> None:
    """Write ``notice`` on ``stream`` (default ``sys.stderr``, flushed) when ``rank`` (default
    :func:`job_rank`) is 0 and not ``quiet``; log it at INFO on every rank."""
    rank = job_rank() if rank is None else rank
    lines = notice.lines()
    for line in lines:
        logger.info("rank %d: %s", rank, line[len(PREFIX):])
    if quiet or rank != 0:
        return
    out = sys.stderr if stream is None else stream
    out.write("".join(line + "\n" for line in lines))
    out.flush()


def skipped_on_ranks(name: str, step: int | None, reasons: dict[int, str]) -> Skipped:
    """A snapshot some ranks could not read (``reasons`` by rank), as one :class:`Skipped`."""
    text = "; ".join(f"rank {r}: {m}" for r, m in sorted(reasons.items())[:8])
    return Skipped(name=name, step=step, reason=text)


def check_quiet(quiet: object) -> bool:
    """``quiet`` as given, or ``TypeError`` naming the argument unless it is a bool."""
    if not isinstance(quiet, bool):
        raise TypeError(f"quiet must be True or False, got {quiet!r}")
    return quiet



def say(text: str, *, quiet: bool = False, rank: int | None = None,
        stream: TextIO | None = None) -> None:
    """Write one line ``snapkeep: <text>`` on ``stream`` (default ``sys.stderr``, flushed) when
    ``rank`` (default :func:`job_rank`) is 0 and not ``quiet``, as :func:`announce`; log it at
    INFO on every rank (the memory tier's resume and fallback lines)."""
    rank = job_rank() if rank is None else rank
    logger.info("rank %d: %s", rank, text)
    if quiet or rank != 0:
        return
    out = sys.stderr if stream is None else stream
    out.write(f"{PREFIX}{text}\n")
    out.flush()
