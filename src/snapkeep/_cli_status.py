"""``snapkeep status OUT_DIR``: how the last run in OUT_DIR ended, for job scripts (requeue after
a preemption, stop after a finished run). Reads ``.snapkeep/status.json`` (written by
``extensions.preemption``) through :func:`snapkeep.session.run_status`."""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping
from typing import Any

import click

from snapkeep._cli_common import storage_errors
from snapkeep.session import Goodput, run_goodput, run_is_alive, run_status

EXIT_FINISHED = 0
EXIT_PREEMPTED = 75
"""Exit code of ``snapkeep status`` for a preempted run: ``EX_TEMPFAIL`` of sysexits.h
("temporary failure, retry"): the job should run the same command again."""
EXIT_PREEMPTED_NOT_DURABLE = 79
"""Exit code of ``snapkeep status`` for a run preempted with a deadline its durable write did
not fit: the step is in the memory tier only (node RAM and peers) or nowhere (the status's
``preemption.committed_to`` says which); the same code the trainer exited with
(``snapkeep.distributed.EXIT_CODE_PREEMPTED_NOT_DURABLE``). Requeue as for 75: the rerun
resumes from RAM on the same nodes, else from storage's newest snapshot."""
EXIT_NOT_DONE = 1
"""Failed, still running, died without a word (still ``running``), no status, or an unreadable
one."""

STATUS_EPILOG = """\b
Exit codes:
  0   finished: the manager was finalized without error or preemption
  75  preempted: the preemption snapshot is committed to storage; run
      the same command again (requeue) to resume
  79  preempted, but the grace period was too short for the durable
      write: the step is in the memory tier only (RAM, peers) or
      nowhere; requeue: the rerun resumes from RAM on the same nodes,
      else from storage's newest snapshot
  1   failed, or 'running': still running (checked by pid on the host
      that wrote the status) or died without a word (killed, out of
      memory, node lost), or no status file, or an invalid one
  2   usage error
  3   storage error: unreachable endpoint, credentials, permissions
"""


def shown(text: str) -> str:
    """``text`` as one printable line: control characters (a terminal escape sequence in a
    status anyone could write) are shown escaped, never sent to the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@click.command("status", epilog=STATUS_EPILOG)
@click.argument("out_dir")
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
def status(out_dir: str, as_json: bool) -> None:
    """How the last run with extensions.preemption() in OUT_DIR ended (its exit code says it)."""
    with storage_errors(out_dir):
        try:
            found = run_status(out_dir)
        except ValueError as e:
            click.echo(f"{out_dir}: invalid status file (.snapkeep/status.json, not as "
                       f"snapkeep wrote it): {e}; the run's outcome is unknown: 'snapkeep ls "
                       f"{out_dir}' lists its snapshots, and the same command resumes from the "
                       "newest", err=True)
            raise click.exceptions.Exit(EXIT_NOT_DONE) from None
    if found is None:
        click.echo(f"{out_dir}: no run status (no run with extensions.preemption() wrote "
                   "there)", err=True)
        goodput = _read_goodput(out_dir)
        if goodput is not None:
            click.echo(_describe_goodput(goodput))
        raise click.exceptions.Exit(EXIT_NOT_DONE)
    when = datetime.datetime.fromtimestamp(found.time_unix_s, datetime.timezone.utc)
    goodput = _read_goodput(out_dir)
    alive = run_is_alive(found) if found.state == "running" else None
    if as_json:
        click.echo(json.dumps({"schema": "snapkeep.status/1", "state": found.state,
                               "step": found.step,
                               "time_unix_s": found.time_unix_s, "reason": found.reason,
                               "snapshots": list(found.snapshots),
                               "world_size": found.world_size, "pid": found.pid,
                               "host": found.host, "alive": alive,
                               "preemption": dict(found.preemption),
                               "staging": dict(found.staging),
                               "goodput": goodput.as_dict() if goodput is not None else None},
                              sort_keys=True))
    else:
        text = found.state
        if found.state == "running":
            where = f"pid {found.pid} on {shown(found.host)}" if found.pid else "no pid recorded"
            if alive is True:
                text = f"running ({where})"
            elif alive is False:
                text = (f"died (not running: {where} is gone) without recording an outcome "
                        "(killed, out of memory, node lost)")
            else:
                text = (f"running, or died without recording an outcome (killed, out of memory, "
                        f"node lost; {where}, cannot be checked from this host)")
        # a running state is recorded once, at start: its step is where the run started (the
        # newest snapshot, shown by `snapkeep ls`, is where it got to)
        at = "started at step" if found.state == "running" else "at step"
        line = (f"{text} {at} {found.step} ({when:%Y-%m-%dT%H:%M:%SZ}, "
                f"{found.world_size} rank(s))")
        if found.reason:
            line += f": {shown(found.reason)}"
        if found.snapshots:
            line += f"; snapshot {', '.join(map(shown, found.snapshots))}"
        if found.preemption:
            line += "; " + _describe_plan(found.preemption)
        if found.staging:
            line += "; " + _describe_staging(found.staging)
        click.echo(line)
        if goodput is not None:
            click.echo(_describe_goodput(goodput))
    code = {"finished": EXIT_FINISHED, "preempted": EXIT_PREEMPTED}.get(found.state,
                                                                         EXIT_NOT_DONE)
    if found.state == "preempted" and not found.durable:
        code = EXIT_PREEMPTED_NOT_DURABLE
    raise click.exceptions.Exit(code)


def _describe_staging(staging: Mapping[str, Any]) -> str:
    """One clause for the last budgeted snapshot (untrusted record: numbers or 'unknown')."""

    def number(key: str, scale: float, spec: str) -> str:
        value = staging.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "unknown"
        return format(value / scale, spec)

    return (f"staging budget {number('budget_bytes', 1 << 20, '.0f')} MiB for "
            f"{number('state_bytes', 1 << 20, '.0f')} MiB of tensors: predicted stall "
            f"{number('predicted_stall_s', 1, '.2f')} s, measured "
            f"{number('staged_s', 1, '.2f')} s (copy {number('copy_Bps', 1 << 30, '.2f')} GiB/s, "
            f"write {number('write_Bps', 1 << 30, '.2f')} GiB/s)")


def _describe_plan(plan: Mapping[str, Any]) -> str:
    """A preemption record as one phrase: where the step went, the time left and the
    estimate."""
    where = {"storage": "committed to storage",
             "ram": "committed to the memory tier only (durable write skipped)",
             "none": "not committed (no time for the durable write, no memory tier)"}.get(
                 str(plan.get("committed_to")),
                 f"committed to {str(plan.get('committed_to'))[:40]}")

    def seconds(key: str) -> str:  # the record is untrusted: a number or 'unknown'
        value = plan.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or abs(value) > 1e9:
            return "unknown"
        return f"{value:.1f} s"

    return (f"{where}: {seconds('remaining_s')} left (deadline from "
            f"{str(plan.get('deadline_from') or 'none')[:40]}), durable write estimated at "
            f"{seconds('durable_estimate_s')}")


def _read_goodput(out_dir: str) -> Goodput | None:
    """The goodput of the runs recorded in ``out_dir`` (None without a history, or with an
    invalid one: said on stderr; the exit code is the status's)."""
    with storage_errors(out_dir):
        try:
            return run_goodput(out_dir)
        except ValueError as e:
            click.echo(f"{out_dir}: invalid run history (.snapkeep/goodput.json, not as "
                       f"snapkeep wrote it): {e}; no goodput shown", err=True)
            return None


def _describe_goodput(g: Goodput) -> str:
    """The goodput line: the share of the wall time that trained, and where the rest went."""
    def span(seconds: float) -> str:
        if seconds >= 3600:
            return f"{seconds / 3600:.2f} h"
        return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"

    def part(seconds: float) -> str:
        return f"{span(seconds)} ({100 * seconds / g.wall_s:.1f} %)" if g.wall_s > 0 \
            else span(seconds)

    line = (f"goodput {100 * g.ratio:.1f} % of {span(g.wall_s)} over {g.runs} run(s): trained "
            f"{part(g.trained_s)}, saves {part(g.save_s)}, restarts {part(g.restart_s)} "
            f"({len(g.restarts)}, {g.failures} after a failure), replay {part(g.replay_s)}")
    if g.interval_steps is not None:
        line += f"; every='auto' chose {g.interval_steps} steps"
    return line
