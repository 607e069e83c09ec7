"""The ``snapkeep`` command line: ``demo``, ``ls``, ``verify``, ``inspect``, ``diff``, ``prune``,
``convert``, ``status`` and ``flush``.

Run ``snapkeep --help`` (or ``python -m snapkeep.cli --help``) for the options; exit codes and
JSON shapes are in ``docs/cli.md`` and each command's ``--help``.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

import click

from snapkeep._cli_common import DEFAULT_TEMPLATE, EXIT_CODES_EPILOG, plural
from snapkeep._cli_flush import flush
from snapkeep._cli_inspect import diff, inspect, ls_command, verify
from snapkeep._cli_maintain import convert, prune
from snapkeep._cli_status import status
from snapkeep.errors import SnapshotError

__all__ = ["DEFAULT_TEMPLATE", "cli", "main"]

#: Exit code after Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


class ModelSizeType(click.ParamType):
    """``small`` | ``medium`` | ``large`` or a positive int (the hidden width)."""

    name = "{small|medium|large|INT}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from snapkeep.demo import MODEL_SIZES

        if isinstance(value, int) and not isinstance(value, bool):
            size = value
        else:
            text = str(value).strip().lower()
            if text in MODEL_SIZES:
                return MODEL_SIZES[text]
            try:
                size = int(text)
            except ValueError:
                self.fail(f"{value!r} is not one of small, medium, large or a positive integer "
                          "(the hidden layer width)", param, ctx)
        if size < 1:
            self.fail(f"{value!r} must be >= 1", param, ctx)
        return size


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_CODES_EPILOG)
@click.version_option(package_name="snapkeep")
@click.option("-v", "--verbose", is_flag=True, help="Log snapkeep's INFO messages to stderr.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """snapkeep: safe, cheap PyTorch training snapshots (ppe-compatible API)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if ctx.invoked_subcommand != "demo":  # the demo's warnings name the demo's own lines
        ctx.with_resource(warnings.catch_warnings())  # restored when the command ends
        warnings.showwarning = _show_tool_warning


def _show_tool_warning(message: Warning | str, category: type[Warning], filename: str,
                       lineno: int, file: Any = None, line: str | None = None) -> None:
    """A warning of ``ls``/``verify``/... as one ``Warning: ...`` line on stderr: there is no
    user code to attribute it to (Python's format would name a line of click's)."""
    click.echo(f"Warning: {message} ({category.__name__})", err=True)


@cli.command()
@click.option("--out", "out_dir", default="result/demo", show_default=True,
              help="Directory for snapshots; a rerun with the same --out resumes.")
@click.option("--iterations", type=click.IntRange(min=1), default=300, show_default=True,
              help="Train until this iteration.")
@click.option("--snapshot-interval", type=click.IntRange(min=1), default=50, show_default=True,
              help="Iterations between snapshots (one is also taken at the last iteration).")
@click.option("--n-retains", type=click.IntRange(min=0), default=3, show_default=True,
              help="Snapshots kept, newest by step; 0 keeps all.")
@click.option("--writer", type=click.Choice(
    ["simple", "thread", "process", "thread-queue", "process-queue"]),
    default="thread-queue", show_default=True, help="snapkeep.writing writer that saves.")
@click.option("--model-size", type=ModelSizeType(), default="small", show_default=True,
              help="hidden width preset (small=128, medium=1024 ~13 MB, large=3072 ~116 MB of "
                   "params + Adam state) or an int.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds init, dropout, augmentation and data order.")
@click.option("--log-interval", type=click.IntRange(min=1), default=None,
              help="Iterations between progress lines [default: --snapshot-interval].")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch intra-op threads; results are bit-identical for a fixed count.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the final metrics as a JSON object on the last line.")
def demo(out_dir: str, iterations: int, snapshot_interval: int, n_retains: int, writer: str,
         model_size: int, seed: int, log_interval: int | None, threads: int,
         as_json: bool) -> None:
    """Train an MLP on scikit-learn's bundled digits with snapshots; kill it and rerun to resume.

    Killed at any moment (even SIGKILL) and started again with the same command, it resumes from
    the newest valid snapshot and ends with the same metrics as an uninterrupted run.
    """
    from snapkeep.demo import DemoConfig, run_demo

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise click.BadParameter(f"{out_dir!r} exists and is not a directory; pass a directory "
                                 "for the snapshots (a new one is created)", param_hint="'--out'")
    config = DemoConfig(
        out_dir=out_dir, iterations=iterations, snapshot_interval=snapshot_interval,
        n_retains=n_retains, writer=writer, hidden_size=model_size, seed=seed,
        log_interval=log_interval, threads=threads)
    try:
        result = run_demo(config, echo=lambda line: click.echo(line))
    except KeyboardInterrupt:
        click.echo(f"interrupted; the snapshots committed so far are kept in {out_dir}. Run the "
                   "same command again to resume from the newest one (snapkeep ls "
                   f"{out_dir} lists them).", err=True)
        raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
    except (SnapshotError, ValueError, OSError, ImportError) as e:
        raise click.ClickException(f"{type(e).__name__}: {e}") from e
    it_per_s = f"{result.it_per_s:.1f} it/s" if result.it_per_s else "no training"
    click.echo(f"final: iteration {result.iteration}  loss {result.loss:.6f}  "
               f"accuracy {result.accuracy:.4f}  ({result.iterations_run} iterations in "
               f"{result.elapsed_s:.1f} s, {it_per_s}; {plural(result.snapshots, 'snapshot')}, "
               f"kept {', '.join(result.retained) or 'none'})")
    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))



for _command in (ls_command, verify, inspect, diff, prune, convert, status, flush):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``snapkeep``)."""
    cli.main(args=argv, prog_name="snapkeep")


if __name__ == "__main__":
    main()
