"""The ``snapkeep`` command line: ``demo``, ``ls``, ``verify`` and ``inspect``.

Run ``snapkeep --help`` (or ``python -m snapkeep.cli --help``) for the options.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import click
import torch

from snapkeep._core.catalog import Catalog, Entry
from snapkeep._core.errors import SnapshotCorruptError, SnapshotError, UnsafeSnapshotError
from snapkeep._core.loading import load_file
from snapkeep._core.storage import Storage, resolve_storage

DEFAULT_TEMPLATE = "snapshot_iter_{.iteration}"


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="snapkeep")
@click.option("-v", "--verbose", is_flag=True, help="Log snapkeep's INFO messages to stderr.")
def cli(verbose: bool) -> None:
    """snapkeep: safe, cheap PyTorch training snapshots (ppe-compatible API)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


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
              help="Hidden width preset (small=128, medium=1024 ~13 MB, large=3072 ~116 MB of "
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

    config = DemoConfig(
        out_dir=out_dir, iterations=iterations, snapshot_interval=snapshot_interval,
        n_retains=n_retains, writer=writer, hidden_size=model_size, seed=seed,
        log_interval=log_interval, threads=threads)
    try:
        result = run_demo(config, echo=lambda line: click.echo(line))
    except (SnapshotError, ValueError, OSError, ImportError) as e:
        raise click.ClickException(f"{type(e).__name__}: {e}") from e
    it_per_s = f"{result.it_per_s:.1f} it/s" if result.it_per_s else "no training"
    click.echo(f"final: iteration {result.iteration}  loss {result.loss:.6f}  "
               f"accuracy {result.accuracy:.4f}  ({result.iterations_run} iterations in "
               f"{result.elapsed_s:.1f} s, {it_per_s}; {result.snapshots} snapshots, "
               f"kept {', '.join(result.retained) or 'none'})")
    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))


# -- inspection commands ----------------------------------------------------------------------


def _parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
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
def _storage_errors(location: str) -> Iterator[None]:
    """Storage failures (unreachable endpoint, credentials, a bad storage option) as one clear
    error line instead of a traceback."""
    try:
        yield
    except (click.ClickException, SystemExit):
        raise
    except (SnapshotError, OSError, TypeError, ValueError) as e:
        hint = ("check the URL, that the endpoint is reachable and the -o storage options "
                "(credentials, endpoint_url)" if "://" in location else "check the path")
        raise click.ClickException(
            f"cannot read {location}: {type(e).__name__}: {e}; {hint}") from e


storage_option = click.option(
    "--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE",
    help="fsspec storage option for a URL (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000"
         " -o anon=true; dotted keys nest (config_kwargs.connect_timeout=5).")


def _catalog(directory: str, template: str, storage_options: tuple[str, ...] = ()) -> Catalog:
    options = _parse_storage_options(storage_options)
    if "://" not in directory:
        import os

        if not os.path.isdir(directory):
            raise click.BadParameter(f"{directory!r} is not a directory", param_hint="'DIR'")
    storage, path = resolve_storage(directory, storage_options=options or None)
    try:
        return Catalog(storage, path, template)
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="'--template'") from e


def _status(catalog: Catalog, entry: Entry) -> tuple[str, str]:
    """``(status, detail)``: ok / corrupt / no manifest (loads) / no manifest (unreadable)."""
    try:
        manifest = catalog.verify(entry)
    except SnapshotCorruptError as e:
        return "corrupt", str(e)
    if manifest is not None:
        return "ok", f"{manifest.algorithm} {manifest.checksum}"
    return "no manifest", ""


def _load_check(storage: Storage, entry: Entry) -> str | None:
    """``None`` when the file loads completely (weights_only), else the reason it does not."""
    try:
        load_file(storage, entry.path)
    except UnsafeSnapshotError:
        return None  # complete, but needs arbitrary unpickling: not corrupt
    except Exception as e:  # any decode failure means the file is unusable
        return f"{type(e).__name__}: {e}"
    return None


template_option = click.option(
    "--template", "-t", default=DEFAULT_TEMPLATE, show_default=True,
    help="Filename template the snapshots were written with.")


@cli.command("ls")
@click.argument("directory", metavar="DIR")
@template_option
@storage_option
def ls_command(directory: str, template: str, storage_options: tuple[str, ...]) -> None:
    """List the snapshots in DIR (a path or an fsspec URL) by step, with size and checksum
    status."""
    with _storage_errors(directory):
        _ls(directory, template, storage_options)


def _ls(directory: str, template: str, storage_options: tuple[str, ...]) -> None:
    catalog = _catalog(directory, template, storage_options)
    entries = catalog.entries()
    if not entries:
        click.echo(f"no snapshots matching {template!r} in {directory}")
        return
    click.echo(f"{'step':>10}  {'size':>12}  {'status':<12}  name")
    for entry in entries:
        status, _ = _status(catalog, entry)
        size = catalog.storage.size(entry.path)
        click.echo(f"{entry.step if entry.step is not None else '-':>10}  "
                   f"{_bytes(size):>12}  {status:<12}  {entry.name}")


@cli.command()
@click.argument("directory", metavar="DIR")
@template_option
@storage_option
def verify(directory: str, template: str, storage_options: tuple[str, ...]) -> None:
    """Verify every snapshot in DIR against its checksum; exit 1 if any is corrupt.

    A snapshot without a manifest (written by ppe, or interrupted between the two commits) counts
    as valid when it loads completely. A DIR without snapshots also exits 1.
    """
    with _storage_errors(directory):
        _verify(directory, template, storage_options)


def _verify(directory: str, template: str, storage_options: tuple[str, ...]) -> None:
    catalog = _catalog(directory, template, storage_options)
    entries = catalog.entries()
    if not entries:
        click.echo(f"no snapshots matching {template!r} in {directory}", err=True)
        sys.exit(1)
    bad = 0
    for entry in entries:
        status, detail = _status(catalog, entry)
        if status == "no manifest":
            reason = _load_check(catalog.storage, entry)
            status, detail = ("corrupt", reason) if reason else (
                "unverified", "no checksum manifest; loads completely")
        bad += status == "corrupt"
        click.echo(f"{status.upper():<10} {entry.name}  (step {entry.step})  {detail}")
    click.echo(f"{len(entries)} snapshot(s), {bad} corrupt")
    if bad:
        sys.exit(1)


@cli.command()
@click.argument("file", metavar="FILE")
@click.option("--unsafe", is_flag=True,
              help="Allow arbitrary unpickling (weights_only=False); only for trusted files.")
@storage_option
def inspect(file: str, unsafe: bool, storage_options: tuple[str, ...]) -> None:
    """Show the top-level keys, tensor counts and bytes of a snapshot FILE, and whether it
    matches its checksum manifest (exit 1 if it does not).

    The file is loaded with torch.load(weights_only=True) unless --unsafe is given.
    """
    import os

    if "://" not in file and not os.path.isfile(file):
        raise click.BadParameter(f"{file!r} is not a file", param_hint="'FILE'")
    options = _parse_storage_options(storage_options)
    with _storage_errors(file):
        storage, path = resolve_storage(file, storage_options=options or None)
        size = storage.size(path)
        checksum = _checksum_status(storage, path)
    try:
        state = load_file(storage, path, weights_only=not unsafe)
    except UnsafeSnapshotError as e:
        raise click.ClickException(
            f"{file} holds objects that need arbitrary unpickling (code could run while "
            f"loading): {e}. If you trust this file, pass --unsafe.") from e
    except (SnapshotError, OSError) as e:
        raise click.ClickException(f"cannot read {file}: {type(e).__name__}: {e}") from e
    except Exception as e:  # torch.load fails with many types on a damaged file
        raise click.ClickException(f"{file}: not a readable torch file ({type(e).__name__}: "
                                   f"{e}); checksum: {checksum}") from e
    click.echo(f"{file}: {_bytes(size)} on disk, {type(state).__name__} loaded with "
               f"weights_only={not unsafe}; checksum: {checksum}")
    items = state.items() if isinstance(state, dict) else [("<root>", state)]
    total_n = total_bytes = 0
    click.echo(f"{'key':<28} {'tensors':>8} {'bytes':>12}")
    for key, value in items:
        n, size = _tensor_stats(value)
        total_n, total_bytes = total_n + n, total_bytes + size
        click.echo(f"{str(key):<28} {n:>8} {_bytes(size):>12}")
    click.echo(f"{'total':<28} {total_n:>8} {_bytes(total_bytes):>12}")
    if isinstance(state, dict) and "_start_iteration" in state:
        version = state.get("_snapkeep_version") or state.get("ppe_version", "?")
        click.echo(f"manager state at iteration {state['_start_iteration']} (version {version})")
    if checksum.startswith("CORRUPT"):
        click.echo(f"{file} does not match its checksum manifest: it loaded, but its values "
                   "are not those that were saved", err=True)
        sys.exit(1)


def _checksum_status(storage: Storage, path: str) -> str:
    """``'ok (xxh3_128 ...)'``, ``'no manifest'`` or ``'CORRUPT: ...'`` for one file."""
    directory, name = storage.dirname(path), storage.basename(path)
    catalog = Catalog(storage, directory, name.replace("{", "{{").replace("}", "}}"))
    entry = Entry(name=name, path=path, key=(), step=None)
    try:
        manifest = catalog.verify(entry)
    except SnapshotCorruptError as e:
        return f"CORRUPT: {e}"
    if manifest is None:
        return "no manifest (unverified)"
    return f"ok ({manifest.algorithm} {manifest.checksum})"


def _tensor_stats(value: Any) -> tuple[int, int]:
    """(number of tensors, their bytes) inside nested dicts/lists/tuples."""
    if isinstance(value, torch.Tensor):
        return 1, value.numel() * value.element_size()
    children: Any = ()
    if isinstance(value, dict):
        children = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    n = size = 0
    for child in children:
        cn, cs = _tensor_stats(child)
        n, size = n + cn, size + cs
    return n, size


def _bytes(n: int) -> str:
    """``n`` bytes in B / KiB / MiB / GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``snapkeep``)."""
    cli.main(args=argv, prog_name="snapkeep")


if __name__ == "__main__":
    main()
