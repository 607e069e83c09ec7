"""``snapkeep flush OUT_DIR``: ask the live trainer writing OUT_DIR to commit its step now and
exit, and wait for it, bounded: a Kubernetes ``preStop`` hook, or any script that must stop a
run cleanly.

How it finds the trainer: the run status (``.snapkeep/status.json``, recorded by every door at
its first step) names the writing process (rank 0): its pid, host and start token. ``flush``
acts only on a process of this host whose start token matches (a reused pid is not the run)
and that this user may signal; it sends it one of the door's preemption signals (default
SIGTERM, which ``preemption=True`` catches), so the trainer does what a preemption does: every
rank agrees at the next step, commits it (to storage, or within a deadline to the memory tier,
see ``docs/cluster.md``), records ``preempted`` and exits. ``flush`` then polls the status
until it is final and the process is gone, or ``--timeout-s`` passes.
"""

from __future__ import annotations

import os
import signal
import time

import click

from snapkeep._cli_common import storage_errors
from snapkeep._cli_status import (
    EXIT_FINISHED,
    EXIT_NOT_DONE,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_NOT_DURABLE,
)
from snapkeep.session import RunStatus, run_is_alive, run_status

EXIT_NO_TRAINER = 4
"""No live trainer of this host writes OUT_DIR (no status, not running, another host)."""
EXIT_TIMED_OUT = 5
"""The trainer did not record its outcome within ``--timeout-s``."""

FLUSH_EPILOG = """\b
Exit codes:
  0   the run had finished (nothing to flush)
  75  the trainer committed its step to storage and exited (preempted)
  79  the trainer committed its step to the memory tier only (the
      deadline left no time for the durable write) or nowhere
  1   the run failed
  4   no live trainer of this host writes OUT_DIR (no status; it died;
      another host): nothing was signalled
  5   the trainer did not record an outcome within --timeout-s
  2   usage error
  3   storage error: unreachable endpoint, credentials, permissions
"""


def _code(found: RunStatus) -> int:
    if found.state == "finished":
        return EXIT_FINISHED
    if found.state == "preempted":
        return EXIT_PREEMPTED if found.durable else EXIT_PREEMPTED_NOT_DURABLE
    return EXIT_NOT_DONE


@click.command("flush", epilog=FLUSH_EPILOG)
@click.argument("out_dir")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), default=25.0,
              show_default=True,
              help="Seconds to wait for the trainer's outcome (keep it under the pod's "
                   "terminationGracePeriodSeconds).")
@click.option("--signal", "signal_name", type=click.Choice(["TERM", "USR1", "USR2", "INT"]),
              default="TERM", show_default=True,
              help="The signal sent: one the trainer's preemption= catches.")
def flush(out_dir: str, timeout_s: float, signal_name: str) -> None:
    """Ask the live trainer writing OUT_DIR (a door with preemption on) to commit its step now
    and exit, and wait for it, at most --timeout-s seconds (a Kubernetes preStop hook)."""
    with storage_errors(out_dir):
        try:
            found = run_status(out_dir)
        except ValueError as e:
            click.echo(f"{out_dir}: invalid status file: {e}; nothing signalled", err=True)
            raise click.exceptions.Exit(EXIT_NO_TRAINER) from None
    if found is None:
        click.echo(f"{out_dir}: no run status (no trainer has started a step there); nothing "
                   "signalled", err=True)
        raise click.exceptions.Exit(EXIT_NO_TRAINER)
    if found.state != "running":
        click.echo(f"{out_dir}: the run is not running ({found.state} at step {found.step}); "
                   "nothing signalled")
        raise click.exceptions.Exit(_code(found))
    alive = run_is_alive(found)
    if alive is not True:
        where = "on another host" if alive is None else "gone"
        click.echo(f"{out_dir}: the trainer (pid {found.pid} on {found.host or '?'}) is "
                   f"{where}; nothing signalled (run flush where the trainer runs)", err=True)
        raise click.exceptions.Exit(EXIT_NO_TRAINER)
    sig = signal.Signals[f"SIG{signal_name}"]
    try:
        os.kill(found.pid, sig)
    except (ProcessLookupError, PermissionError) as e:
        click.echo(f"{out_dir}: cannot signal the trainer (pid {found.pid}): {e}", err=True)
        raise click.exceptions.Exit(EXIT_NO_TRAINER) from None
    click.echo(f"{out_dir}: sent {sig.name} to the trainer (pid {found.pid}); waiting up to "
               f"{timeout_s:g} s for it to commit and exit", err=True)
    deadline = time.monotonic() + timeout_s
    while True:
        with storage_errors(out_dir):
            try:
                now = run_status(out_dir)
            except ValueError:
                now = None  # replaced meanwhile: read again
        if now is not None and now.state != "running" and run_is_alive(found) is not True:
            click.echo(f"{out_dir}: {now.state} at step {now.step}"
                       + (f" ({now.preemption.get('committed_to')})" if now.preemption
                          else ""))
            raise click.exceptions.Exit(_code(now))
        if time.monotonic() >= deadline:
            click.echo(f"{out_dir}: no outcome recorded within {timeout_s:g} s (the trainer "
                       f"may still be committing; pid {found.pid})", err=True)
            raise click.exceptions.Exit(EXIT_TIMED_OUT)
        time.sleep(0.1)
