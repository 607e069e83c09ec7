"""Options and helpers shared by the CLI's commands: storage options, JSON output, progress bars,
error mapping to exit codes (see :mod:`snapkeep._cli_files` for the table)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import click
from tqdm import tqdm

from snapkeep._cli_files import CheckFailed, StorageTrouble
from snapkeep._cli_tree import TreeTooDeepError
from snapkeep.errors import SnapshotError, SnapshotStorageError

#: The CLI's template when ``-t`` is not given and the directory records none: ppe's default
#: ``snapshot_iter_{.iteration}``, in the store's spelling.
DEFAULT_TEMPLATE = "snapshot_iter_{step}"
#: Work on fewer bytes than this shows no progress bar.
PROGRESS_MIN_BYTES = 64 << 20

EXIT_CODES_EPILOG = """\b
Exit codes:
  0  success: all valid / equal / done
  1  a check failed: corrupt, unloadable or unsafe snapshot; no snapshot
     (verify); snapshots differ (diff); a delete failed (prune); a state
     that cannot be converted (convert)
  2  usage error: bad option or value, a path that is not a file or
     directory, DST exists without --force
  3  storage error: unreachable endpoint, credentials, permissions
"""


def parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``('key=abc', 'config_kwargs.connect_timeout=5')`` -> nested storage_options; a value is
    read as JSON when it parses (numbers, true/false, objects), else kept as a string."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE",
                                     param_hint="'--storage-option'")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        *parents, leaf = key.split(".")
        node = options
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise click.BadParameter(f"{key!r} nests under a non-dict value",
                                         param_hint="'--storage-option'")
        node[leaf] = value
    return options


@contextlib.contextmanager
def storage_errors(location: str) -> Iterator[None]:
    """Storage failures (unreachable endpoint, credentials, a bad storage option) as one clear
    error line with exit code 3 instead of a traceback."""
    try:
        yield
    except (click.ClickException, SystemExit, click.exceptions.Exit):
        raise
    except TreeTooDeepError as e:
        raise CheckFailed(f"{location}: {e}") from e
    except (SnapshotError, OSError, TypeError, ValueError) as e:
        if isinstance(e, SnapshotError) and not isinstance(e, SnapshotStorageError):
            raise CheckFailed(f"{location}: {type(e).__name__}: {e}") from e
        hint = ("check the URL, that the endpoint is reachable and the -o storage options "
                "(credentials, endpoint_url)" if "://" in location
                else "check the path and its permissions")
        raise StorageTrouble(
            f"cannot read {location}: {type(e).__name__}: {e}; {hint}") from e


storage_option = click.option(
    "--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE",
    help="fsspec storage option for a URL (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000"
         " -o anon=true; dotted keys nest (config_kwargs.connect_timeout=5).")

template_option = click.option(
    "--template", "-t", default=None,
    help="Filename template the snapshots were written with: the Checkpointer's spelling "
         "('ckpt_{step}', 'epoch={epoch}-step={step}.ckpt') or ppe's "
         "('snapshot_iter_{.iteration}'); default: the one the directory's manifests record, "
         f"else {DEFAULT_TEMPLATE!r} (ppe's default).")

json_option = click.option(
    "--json", "as_json", is_flag=True,
    help="Print one JSON object on stdout instead of text (shapes: docs/cli.md).")


def emit_json(body: dict[str, Any]) -> None:
    """One JSON object on one line of stdout (keys sorted; never NaN/Infinity)."""
    click.echo(json.dumps(body, sort_keys=True, allow_nan=False))


def progress(total_bytes: int, desc: str, *, unit: str = "B") -> tqdm:
    """A tqdm bar on stderr, shown only on a terminal and only for work on at least
    :data:`PROGRESS_MIN_BYTES` (or any step count when ``unit`` is not bytes)."""
    small = unit == "B" and total_bytes < PROGRESS_MIN_BYTES
    return tqdm(total=total_bytes, desc=desc, unit=unit, unit_scale=unit == "B",
                unit_divisor=1024, leave=False, file=sys.stderr,
                disable=True if small else None)


def human_bytes(n: int) -> str:
    """``n`` bytes in B / KiB / MiB / GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def plural(n: int, word: str) -> str:
    """``1 snapshot``, ``2 snapshots``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
