"""``snapkeep ls``, ``verify``, ``inspect`` and ``diff``: read-only commands.

JSON shapes (``--json``; every object has ``"schema"``, whose number changes only when a field
is removed or changes meaning) are documented in ``docs/cli.md``.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import sys
from typing import Any

import click

from snapkeep._cli_common import (
    DEFAULT_TEMPLATE,
    EXIT_CODES_EPILOG,
    emit_json,
    human_bytes,
    json_option,
    parse_storage_options,
    plural,
    progress,
    storage_errors,
    storage_option,
    template_option,
)
from snapkeep._cli_files import (
    EXIT_FAILED,
    LOAD_ERRORS,
    CheckFailed,
    Status,
    StorageTrouble,
    autoload_choice,
    checksum_status,
    file_checksum_status,
    load_status,
    manifest_of,
    open_store,
    recorded_snapshots,
    recorded_templates,
    require_directory,
    require_file,
    resolve,
    same_template,
    sharded_rows,
)
from snapkeep._cli_tree import TreeTooDeepError, compare, select, stats_by_key
from snapkeep.codecs import HEADER_PROBE_BYTES, is_safetensors_header
from snapkeep.errors import SnapshotCorruptError, SnapshotStorageError, UnsafeSnapshotError
from snapkeep.store import Manifest, SnapshotStore, Storage, load_file
from snapkeep.wrapping import canonical_names

#: Manifest fields ``diff`` shows side by side (size, checksum and time always differ).
METADATA_FIELDS = ("step", "run_id", "metrics", "snapkeep_version")


def store_for(directory: str, template: str | None,
              storage_options: tuple[str, ...]) -> SnapshotStore:
    """The store of ``template`` in ``directory`` (a path or URL); usage errors name the option.

    Without ``template`` (no ``-t``), the template the directory's manifests record: a
    Checkpointer's ``ckpt_{step}`` directory needs no ``-t``. With none recorded, ppe's
    default (``snapshot_iter_{step}``, ppe's ``snapshot_iter_{.iteration}``); with several,
    that default when it is among them, else a usage error naming them.
    """
    storage, path = resolve(directory, parse_storage_options(storage_options))
    require_directory(directory, storage, path)
    if template is not None and GLOB.search(template):
        template = _template_of_glob(directory, storage, path, template)
    if template is None:
        found = recorded_templates(storage, path)
        if len(found) == 1:
            template = found[0]
        elif not found or DEFAULT_TEMPLATE in found:
            template = DEFAULT_TEMPLATE
        else:
            raise click.UsageError(
                f"{directory} holds snapshots of {len(found)} templates "
                f"({', '.join(repr(t) for t in found[:5])}): pass one with --template")
    try:
        return open_store(storage, path, template)
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="'--template'") from e


#: A ``-t`` holding one of these is a shell-style pattern of names (``'*.ckpt'``, as the
#: Lightning door's resume line shows), not a template.
GLOB = re.compile(r"[*?\[]")


def _template_of_glob(directory: str, storage: Storage, path: str, pattern: str) -> str:
    """The one recorded template (:func:`recorded_snapshots`) of the snapshots whose names
    match ``pattern``; usage error when none or several do."""
    matching = [t for t, names in recorded_snapshots(storage, path).items()
                if any(fnmatch.fnmatchcase(n, pattern) for n in names)]
    if len(matching) == 1:
        return matching[0]
    if not matching:
        raise click.BadParameter(
            f"no snapshot in {directory} recorded by snapkeep is named like {pattern!r}; "
            "pass a template with a {step} field, e.g. 'ckpt_{step}'",
            param_hint="'--template'")
    raise click.BadParameter(
        f"snapshots of {len(matching)} templates in {directory} are named like {pattern!r} "
        f"({', '.join(repr(t) for t in matching[:5])}): pass one of them",
        param_hint="'--template'")


def none_found(store: SnapshotStore, directory: str, template: str) -> str:
    """'no snapshots matching ...', naming the templates the directory's manifests record."""
    message = f"no snapshots matching {template!r} in {directory}"
    others = [t for t in recorded_templates(store.storage, store.directory)
              if not same_template(t, template)]
    if others:
        shown = ", ".join(repr(t) for t in others[:5])
        message += (f"; its manifests record snapshots named like {shown}: pass "
                    f"--template {others[0]!r}")
    return message


# -- ls ----------------------------------------------------------------------------------------


@click.command("ls", epilog=EXIT_CODES_EPILOG)
@click.argument("directory", metavar="DIR")
@template_option
@storage_option
@json_option
@click.option("--memory", is_flag=True,
              help="DIR is a memory tier root (e.g. /dev/shm): list each job's tier, its owners "
                   "and the step each rank holds (own copy and peer copies).")
def ls_command(directory: str, template: str | None, storage_options: tuple[str, ...],
               as_json: bool, memory: bool) -> None:
    """List the snapshots in DIR (a path or an fsspec URL) by step, with size and checksum
    status (ok, corrupt, no manifest); with --memory, the memory tiers under DIR. Exits 0 even
    when there are none."""
    if memory:
        if not os.path.isdir(directory):  # a tmpfs root is a local directory
            raise click.BadParameter(f"{directory!r} is not a directory (--memory takes the "
                                     "memory tier's root, e.g. /dev/shm)", param_hint="'DIR'")
        _ls_memory(directory, as_json)
        return
    with storage_errors(directory):
        store = store_for(directory, template, storage_options)
        template = store.template.text
        entries = store.entries()
        total = sum(store.storage.size(e.path) for e in entries)
        rows = []
        with progress(total, "checking") as bar:
            for entry in entries:
                size = store.storage.size(entry.path)
                found = checksum_status(store, entry)
                bar.update(size)
                rows.append((entry, size, found))
        if not rows:  # sharded (DCP) snapshot directories of the template, if any
            rows = sharded_rows(store)
        others = [] if rows else recorded_templates(store.storage, store.directory)
    if as_json:
        emit_json({
            "schema": "snapkeep.ls/1", "directory": directory, "template": template,
            "snapshots": [_entry_json(e, size, found) for e, size, found in rows],
            "other_templates": [t for t in others if not same_template(t, template)],
        })
        return
    if not rows:
        click.echo(none_found(store, directory, template))
        return
    click.echo(f"{'step':>10}  {'size':>12}  {'status':<12}  name")
    for entry, size, found in rows:
        click.echo(f"{entry.step if entry.step is not None else '-':>10}  "
                   f"{human_bytes(size):>12}  {found.status:<12}  {entry.name}")


def _ls_memory(root: str, as_json: bool) -> None:
    from snapkeep.tiers import describe_tiers

    tiers = describe_tiers(root)
    if as_json:
        emit_json({"schema": "snapkeep.ls-memory/1", "root": root, "tiers": tiers})
        return
    if not tiers:
        click.echo(f"no memory tiers in {root}")
        return
    for tier in tiers:
        owners = ", ".join(f"rank {o.get('rank')}: pid {o.get('pid')} on {o.get('host')}"
                           for o in tier["owners"]) or "no owner record"
        click.echo(f"{tier['dir']}  ({owners})")
        click.echo(f"  {'rank':>6}  {'copy of':>8}  {'step':>10}  {'size':>12}  name")
        for held in tier["held"]:
            click.echo(f"  {held['rank']:>6}  {held['source']:>8}  {held['step']:>10}  "
                       f"{human_bytes(held['bytes']):>12}  ram_iter_{held['step']}")


def _entry_json(entry: Any, size: int, found: Status) -> dict[str, Any]:
    manifest = found.manifest
    return {
        "name": entry.name, "step": entry.step, "size_bytes": size, "status": found.status,
        "detail": found.detail, "checksum": manifest.checksum if manifest else None,
        "run_id": manifest.run_id if manifest else None,
        "metrics": dict(manifest.metrics) if manifest else {},
    }


# -- verify ------------------------------------------------------------------------------------


@click.command(epilog=EXIT_CODES_EPILOG)
@click.argument("directory", metavar="DIR")
@template_option
@storage_option
@json_option
def verify(directory: str, template: str | None, storage_options: tuple[str, ...],
           as_json: bool) -> None:
    """Verify every snapshot in DIR against its checksum; exit 1 if any is corrupt or would be
    refused by autoload.

    A snapshot without a manifest (written by ppe, or interrupted between the two commits) is
    checked as autoload checks it: a complete load with torch.load(weights_only=True). It counts
    as 'unverified' when it loads, 'unsafe' when it needs arbitrary unpickling (autoload refuses
    it) and 'corrupt' otherwise. A DIR without snapshots also exits 1.
    """
    with storage_errors(directory):
        store = store_for(directory, template, storage_options)
        template = store.template.text
        entries = store.entries()
        sharded = [] if entries else sharded_rows(store)
        if not entries and not sharded:
            message = none_found(store, directory, template)
            if as_json:
                emit_json({"schema": "snapkeep.verify/1", "directory": directory,
                           "template": template, "snapshots": [], "bad": 0,
                           "newest_loadable": None, "bad_blobs": [],
                           "exit_code": EXIT_FAILED})
            else:
                click.echo(message, err=True)
            sys.exit(EXIT_FAILED)
        total = sum(store.storage.size(e.path) for e in entries)
        results = [(entry, found) for entry, _, found in sharded]
        with progress(total, "verifying") as bar:
            for entry in entries:
                found = load_status(store, entry)
                bar.update(store.storage.size(entry.path))
                results.append((entry, found))
        blobs = bad_blobs(store, entries)
    bad = sum(found.status in ("corrupt", "unsafe") for _, found in results)
    loadable = resumable(results)
    code = EXIT_FAILED if bad or blobs else 0
    if as_json:
        emit_json({
            "schema": "snapkeep.verify/1", "directory": directory, "template": template,
            "snapshots": [{"name": e.name, "step": e.step, "status": found.status,
                           "detail": found.detail} for e, found in results],
            "bad": bad, "newest_loadable": loadable[-1] if loadable else None,
            "bad_blobs": blobs, "exit_code": code,
        })
    else:
        for entry, found in results:
            click.echo(f"{found.status.upper():<10} {entry.name}  (step {entry.step})  "
                       f"{found.detail}")
        for blob in blobs:
            click.echo(f"BAD BLOB   {blob['blob']}: {blob['detail']}; referred to by "
                       f"{plural(len(blob['snapshots']), 'snapshot')}: "
                       f"{', '.join(blob['snapshots'])} (restore the blob from a good copy, or "
                       "resume from a snapshot that does not refer to it)")
        click.echo(f"{plural(len(results), 'snapshot')}, {bad} corrupt or refused; autoload "
                   f"would resume from {loadable[-1] if loadable else 'none'}")
    if code:
        sys.exit(code)


def bad_blobs(store: SnapshotStore, entries: list[Any]) -> list[dict[str, Any]]:
    """The blobs of incremental snapshots (listed by their manifests) that are missing or
    damaged, each once, with the names of the snapshots that refer to it, oldest first:
    ``[{"blob": path, "digest": hex, "detail": why, "snapshots": [names]}]``. A blob read and
    verified a moment ago by :func:`load_status` in this process is not read again (see
    ``BlobArea.check``)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    good: set[tuple[str, str]] = set()
    for entry in entries:
        manifest = store.manifest(entry)
        if manifest is None or not manifest.blobs:
            continue
        area = store.blob_area_of(entry, manifest)
        for digest, nbytes in sorted(manifest.blobs.items()):
            key = (area.directory, digest)
            if key in good:
                continue
            if key not in found:
                try:
                    area.check(digest, nbytes)
                    good.add(key)
                    continue
                except (SnapshotCorruptError, ValueError) as e:
                    found[key] = {"blob": store.storage.url(store.storage.join(area.directory,
                                                                             digest)),
                                  "digest": digest, "detail": _blob_detail(str(e)),
                                  "snapshots": []}
            found[key]["snapshots"].append(entry.name)
    return list(found.values())


def _blob_detail(message: str) -> str:
    """The reason in a blob error (``'blob PATH: why'`` -> ``'why'``)."""
    head, sep, rest = message.partition(": ")
    return rest if sep and head.startswith("blob ") else message


def resumable(results: list[tuple[Any, Status]]) -> list[str]:
    """Names autoload could resume from (:func:`autoload_choice`, the store's
    newest-valid-with-fallback): the one it resumes from, or none (none valid, or an unsafe
    one stops it: autoload refuses it and never falls back past it)."""
    status = {entry.name: found for entry, found in results}
    chosen = autoload_choice([e for e, _ in results], lambda e: status[e.name]).resume_from
    return [chosen.name] if chosen is not None else []


# -- inspect -----------------------------------------------------------------------------------


def load_state(location: str, storage: Storage, path: str, *, unsafe: bool) -> Any:
    """Load one file for inspect/diff/convert; every failure is one clear line (exit 1 or 3)."""
    try:
        return load_file(storage, path, weights_only=not unsafe)
    except UnsafeSnapshotError as e:
        calls = re.search(r"GLOBAL ([\w.]+)", str(e.__cause__ or ""))
        raise CheckFailed(
            f"{location}: unsafe, not corrupt: a well-formed snapshot that needs objects outside "
            f"the weights_only allow-list{f' ({calls.group(1)})' if calls else ''}, so nothing "
            "in it was executed; if you trust this file, pass --unsafe (weights_only=False).") \
            from e
    except SnapshotStorageError as e:
        raise StorageTrouble(f"cannot read {location}: {e}") from e
    except LOAD_ERRORS as e:
        if isinstance(e, SnapshotCorruptError):
            found = re.search(r"\(corrupt: (.*)\)$", str(e), re.S)
            detail = found.group(1) if found else str(e)
        else:
            detail = f"{type(e).__name__}: {e}" if str(e) else "empty or truncated file"
        detail = (detail.splitlines() or [""])[0].rstrip(".")
        raise CheckFailed(f"{location}: corrupt: not a readable torch or safetensors file "
                          f"({detail}).") from e


def file_format(storage: Storage, path: str) -> str:
    """``'safetensors'`` or ``'torch'`` from the file's first bytes."""
    with storage.open_read(path) as f:
        head = f.read(HEADER_PROBE_BYTES)
    return "safetensors" if is_safetensors_header(head) else "torch"


@click.command(epilog=EXIT_CODES_EPILOG)
@click.argument("file", metavar="FILE")
@click.option("--unsafe", is_flag=True,
              help="Allow arbitrary unpickling (weights_only=False); only for trusted files.")
@storage_option
@json_option
def inspect(file: str, unsafe: bool, storage_options: tuple[str, ...], as_json: bool) -> None:
    """Show the top-level keys, tensor counts and bytes of a snapshot FILE, and whether it
    matches its checksum manifest (exit 1 if it does not).

    The file is loaded with torch.load(weights_only=True) unless --unsafe is given.
    """
    with storage_errors(file):
        storage, path = resolve(file, parse_storage_options(storage_options))
        size = require_file(file, storage, path)
        checksum = file_checksum_status(storage, path)
        fmt = file_format(storage, path)
        state = canonical_names(load_state(file, storage, path, unsafe=unsafe))
        rows = stats_by_key(state)
    iteration = state.get("_start_iteration") if isinstance(state, dict) else None
    version = (state.get("_snapkeep_version") or state.get("ppe_version")) \
        if isinstance(state, dict) else None
    corrupt = checksum.status == "corrupt"
    if as_json:
        emit_json({
            "schema": "snapkeep.inspect/1", "file": file, "size_bytes": size, "format": fmt,
            "type": type(state).__name__, "weights_only": not unsafe,
            "checksum": {"status": checksum.status, "detail": checksum.detail},
            "keys": [{"key": r.key, "tensors": r.tensors, "bytes": r.bytes} for r in rows],
            "total": {"tensors": sum(r.tensors for r in rows),
                      "bytes": sum(r.bytes for r in rows)},
            "iteration": iteration if isinstance(iteration, int) else None,
            "snapkeep_version": version if isinstance(version, str) else None,
        })
    else:
        shown = {"ok": f"ok ({checksum.detail})", "no manifest": "no manifest (unverified)",
                 "corrupt": f"CORRUPT: {checksum.detail}"}[checksum.status]
        click.echo(f"{file}: {human_bytes(size)} on disk, {fmt} format, {type(state).__name__} "
                   f"loaded with weights_only={not unsafe}; checksum: {shown}")
        click.echo(f"{'key':<28} {'tensors':>8} {'bytes':>12}")
        for r in rows:
            click.echo(f"{r.key:<28} {r.tensors:>8} {human_bytes(r.bytes):>12}")
        click.echo(f"{'total':<28} {sum(r.tensors for r in rows):>8} "
                   f"{human_bytes(sum(r.bytes for r in rows)):>12}")
        if iteration is not None:
            click.echo(f"manager state at iteration {iteration} (snapkeep {version or '?'})")
    if corrupt:
        click.echo(f"{file} does not match its checksum manifest: it loaded, but its values "
                   "are not those that were saved", err=True)
        sys.exit(EXIT_FAILED)


# -- diff --------------------------------------------------------------------------------------


def _metadata(manifest: Manifest | None) -> dict[str, Any] | None:
    if manifest is None:
        return None
    return {name: getattr(manifest, name) for name in METADATA_FIELDS}


def _finite_atol(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """``--atol`` must be a finite number (click's range lets ``nan`` and ``inf`` through, and
    the JSON output cannot hold them)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number >= 0", ctx=ctx, param=param)
    return value


@click.command(epilog=EXIT_CODES_EPILOG)
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--key", "key", metavar="PATH", default=None,
              help="Compare only the sub-tree at PATH, e.g. models/main.")
@click.option("--key-b", "key_b", metavar="PATH", default=None,
              help="The sub-tree of B to compare with A's --key (default: the same PATH; '' "
                   "for B's whole state, e.g. an exported model against a snapshot's "
                   "models/main).")
@click.option("--atol", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              callback=lambda ctx, param, value: _finite_atol(ctx, param, value),
              help="Tensors whose max absolute difference is at most this count as equal.")
@click.option("--unsafe", is_flag=True,
              help="Allow arbitrary unpickling (weights_only=False); only for trusted files.")
@storage_option
@json_option
def diff(a: str, b: str, key: str | None, key_b: str | None, atol: float, unsafe: bool,
         storage_options: tuple[str, ...], as_json: bool) -> None:
    """Compare two snapshot files A and B: keys, shapes, dtypes, the max absolute difference of
    each tensor, other values, and the metadata their manifests record (step, run id, metrics,
    version; shown, not compared). Exit 0 when the states are equal, 1 when they differ.

    Model keys are compared by canonical name: the wrapper atoms of torch.compile
    (_orig_mod.) and DDP (module.) of older snapshots are removed first.
    """
    options = parse_storage_options(storage_options)
    states, metadata = [], []
    for location, hint in ((a, "'A'"), (b, "'B'")):
        with storage_errors(location):
            storage, path = resolve(location, options)
            require_file(location, storage, path, hint=hint)
            states.append(canonical_names(load_state(location, storage, path, unsafe=unsafe)))
            metadata.append(_metadata(manifest_of(storage, path)))
    for i, (path_in, hint) in enumerate(((key, "'--key'"),
                                         (key if key_b is None else key_b, "'--key-b'"))):
        if path_in:  # None or '': the whole state
            try:
                states[i] = select(states[i], path_in)
            except KeyError as e:
                raise click.BadParameter(str(e.args[0]), param_hint=hint) from e
    try:
        result = compare(states[0], states[1], atol=atol)
    except TreeTooDeepError as e:
        raise CheckFailed(str(e)) from e
    code = 0 if result.equal else EXIT_FAILED
    if as_json:
        emit_json({"schema": "snapkeep.diff/1", "a": a, "b": b, "atol": atol,
                   "equal": result.equal, **result.as_json(),
                   "metadata": {"a": metadata[0], "b": metadata[1]}})
    else:
        for key in result.only_in_a:
            click.echo(f"only in A: {key}")
        for key in result.only_in_b:
            click.echo(f"only in B: {key}")
        for row in result.tensors:
            if row["equal"]:
                continue
            sa, sb = row["a"], row["b"]
            what = [f"shape {sa['shape']} != {sb['shape']}" if sa["shape"] != sb["shape"] else "",
                    f"dtype {sa['dtype']} != {sb['dtype']}" if sa["dtype"] != sb["dtype"] else "",
                    f"max abs diff {row['max_abs_diff']:.6g}"
                    if row["max_abs_diff"] is not None else "",
                    f"{row['nan_mismatches']} NaN mismatches" if row["nan_mismatches"] else ""]
            click.echo(f"tensor {row['key']}: {', '.join(w for w in what if w)}")
        for row in result.values:
            click.echo(f"value {row['key']}: {row['a']} != {row['b']}")
        if metadata[0] != metadata[1]:
            click.echo(f"metadata: A {metadata[0]}  B {metadata[1]}")
        n_equal = sum(row["equal"] for row in result.tensors)
        click.echo(f"{'equal' if result.equal else 'different'}: {n_equal} of "
                   f"{plural(len(result.tensors), 'common tensor')} equal, "
                   f"{len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B, "
                   f"{len(result.values)} other values differ")
    if code:
        sys.exit(code)
