"""``snapkeep prune`` and ``snapkeep convert``: the commands that write or delete.

JSON shapes are documented in ``docs/cli.md``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from typing import Any

import click

from snapkeep._cli_common import (
    EXIT_CODES_EPILOG,
    emit_json,
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
    CheckFailed,
    autoload_choice,
    delete_entry,
    file_checksum_status,
    file_kind,
    load_status,
    require_file,
    resolve,
)
from snapkeep._cli_inspect import load_state, none_found, store_for
from snapkeep._cli_tree import TreeTooDeepError, compare, leaves, select
from snapkeep.errors import StoreLockedError
from snapkeep.retention import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepLatest,
    SnapshotInfo,
    check_metrics,
    plan_deletions,
)
from snapkeep.store import Entry, SnapshotStore, manifest_path

# -- prune -------------------------------------------------------------------------------------


def _policy(keep_latest: int | None, keep_every: int | None, keep_best: int | None,
            metric: str | None, mode: str) -> Any:
    policies: list[Any] = []
    if keep_latest is not None:
        policies.append(KeepLatest(keep_latest))
    if keep_every is not None:
        policies.append(KeepEvery(keep_every))
    if keep_best is not None:
        if not metric:
            raise click.BadParameter("--keep-best needs --metric NAME (a value the manifests "
                                     "record, e.g. val/loss)", param_hint="'--metric'")
        policies.append(KeepBest(keep_best, metric, mode))
    elif metric:
        raise click.BadParameter("--metric is only used with --keep-best N",
                                 param_hint="'--metric'")
    if not policies:
        raise click.UsageError("give at least one policy: --keep-latest N, --keep-every K or "
                               "--keep-best N --metric NAME")
    return policies[0] if len(policies) == 1 else AnyOf(*policies)


@click.command(epilog=EXIT_CODES_EPILOG)
@click.argument("directory", metavar="DIR")
@click.option("--keep-latest", type=click.IntRange(min=1), metavar="N",
              help="Keep the newest N snapshots by step (ppe's n_retains).")
@click.option("--keep-every", type=click.IntRange(min=1), metavar="K",
              help="Keep every snapshot whose step is a multiple of K.")
@click.option("--keep-best", type=click.IntRange(min=1), metavar="N",
              help="Keep the N snapshots with the best --metric (recorded in their manifests).")
@click.option("--metric", metavar="NAME", help="Metric for --keep-best, e.g. val/loss.")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True,
              help="Whether the best --metric is the lowest or the highest.")
@click.option("--yes", is_flag=True, help="Delete; without it, only print what would be deleted.")
@template_option
@storage_option
@json_option
def prune(directory: str, keep_latest: int | None, keep_every: int | None,
          keep_best: int | None, metric: str | None, mode: str, yes: bool, template: str | None,
          storage_options: tuple[str, ...], as_json: bool) -> None:
    """Delete the snapshots of DIR that no policy keeps (a snapshot is kept when any policy
    keeps it), with their manifests. A dry run unless --yes is given.

    The newest valid snapshot (the one autoload would resume from) is never deleted, nor an
    unsafe one autoload stops at (it never falls back past it), nor the newest snapshot by
    step. Manifests whose snapshot is gone are deleted too.

    While a live trainer holds the directory's lock for the template (a running snapshot
    extension or Checkpointer), --yes refuses, naming it (exit 1): its retention prunes, and a
    prune beside it could delete what it is about to resume or keep.
    """
    policy = _policy(keep_latest, keep_every, keep_best, metric, mode)
    with storage_errors(directory), contextlib.ExitStack() as held:
        store = store_for(directory, template, storage_options)
        template = store.template.text
        if yes:  # the trainer's lock: no prune under a live trainer
            try:
                lock = store.lock(existing_only=True)
            except StoreLockedError as e:
                holder = e.holder or "holder unknown"
                raise CheckFailed(
                    f"not pruning {directory}: a live trainer holds it ({holder}); its own "
                    "retention keeps the directory pruned. Stop that trainer first, or let its "
                    "keep=/n_retains do the pruning") from e
            if lock is not None:
                held.callback(lock.release)
        entries = store.entries()
        infos = []
        for entry in entries:
            manifest = store.manifest(entry)
            infos.append(SnapshotInfo(name=entry.name, key=entry.key, step=entry.step,
                                      metrics=dict(manifest.metrics) if manifest else {}))
        try:  # a KeepBest metric no manifest records: refused before anything is read or deleted
            check_metrics(policy, infos)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--metric'") from e
        choice = autoload_choice(entries, lambda e: load_status(store, e))
        newest, checked = choice.resume_from, choice.checked
        protect = [e.name for e in (newest, choice.refused) if e is not None]
        doomed = set(plan_deletions(policy, infos, protect=protect))
        orphans = store.orphan_manifests(entries)
        deleted: list[str] = []
        failed: list[dict[str, str]] = []
        if yes:
            freed: dict[str, tuple[Any, set[str]]] = {}  # incremental snapshots' blobs, by area
            for entry in entries:
                if entry.name not in doomed:
                    continue
                manifest = store.manifest(entry)
                try:
                    delete_entry(store, entry)
                    deleted.append(entry.name)
                except OSError as e:
                    failed.append({"name": entry.name, "error": f"{type(e).__name__}: {e}"})
                    continue
                if manifest is not None and manifest.blobs:
                    area = store.blob_area_of(entry, manifest)
                    freed.setdefault(area.directory, (area, set()))[1].update(manifest.blobs)
            for area, digests in freed.values():  # those no snapshot left refers to
                store.collect_blobs(digests, area=area)
            for path in orphans:
                try:
                    store.storage.remove(path)
                except OSError as e:
                    failed.append({"name": path, "error": f"{type(e).__name__}: {e}"})
    code = EXIT_FAILED if failed else 0
    if as_json:
        emit_json({
            "schema": "snapkeep.prune/1", "directory": directory, "template": template,
            "dry_run": not yes,
            "newest_valid": newest.name if newest is not None else None,
            "keep": [e.name for e in entries if e.name not in doomed],
            "delete": [{"name": e.name, "step": e.step,
                        "status": checked[e.name].status if e.name in checked else None}
                       for e in entries if e.name in doomed],
            "orphan_manifests": orphans, "deleted": deleted, "failed": failed,
            "exit_code": code,
        })
    elif not entries:
        click.echo(none_found(store, directory, template))
    else:
        verb = "deleted" if yes else "would delete"
        for entry in entries:
            click.echo(f"{(verb if entry.name in doomed else 'keep'):<13} {entry.name}  "
                       f"(step {entry.step})")
        for path in orphans:
            click.echo(f"{verb:<13} {path}  (manifest without a snapshot)")
        for row in failed:
            click.echo(f"FAILED to delete {row['name']}: {row['error']}", err=True)
        n = len(deleted) if yes else len(doomed)
        click.echo(f"{verb} {plural(n, 'snapshot')}, kept {len(entries) - len(doomed)}"
                   + ("" if yes else "; pass --yes to delete"))
    if code:
        sys.exit(code)


# -- convert -----------------------------------------------------------------------------------


def _is_dcp_directory(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def _load_dcp(src: str, *, unsafe: bool) -> Any:
    """A DCP (torch.distributed.checkpoint) directory gathered into one state in memory, as
    ``dcp_to_torch_save`` would, but read safely: its ``.metadata`` through an allow-list and
    every value with ``torch.load(weights_only=not unsafe)``; no process group needed."""
    from snapkeep.distributed import gather_dcp
    from snapkeep.errors import SnapshotCorruptError, UnsafeSnapshotError
    from snapkeep.store import resolve_storage

    storage, path = resolve_storage(src)
    try:
        return gather_dcp(storage, path, weights_only=not unsafe)
    except UnsafeSnapshotError as e:
        raise CheckFailed(f"{e} (with the CLI: pass --unsafe)") from e
    except SnapshotCorruptError as e:
        raise CheckFailed(f"{src}: the DCP checkpoint cannot be consolidated: {e}") from e


def _format_for(dst: str, to: str | None) -> str:
    if to is not None:
        return to
    return "safetensors" if dst.endswith(".safetensors") else "torch"


@click.command(epilog=EXIT_CODES_EPILOG)
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--to", type=click.Choice(["torch", "safetensors"]), default=None,
              help="Format of DST [default: safetensors when DST ends in .safetensors, else "
                   "torch].")
@click.option("--key", "key", metavar="PATH", default=None,
              help="Convert only the sub-tree at PATH, e.g. models/main (a manager snapshot's "
                   "model, which safetensors can hold).")
@click.option("--force", is_flag=True, help="Replace DST when it exists.")
@click.option("--unsafe", is_flag=True,
              help="Allow arbitrary unpickling of SRC (weights_only=False); trusted files only.")
@storage_option
def convert(src: str, dst: str, to: str | None, key: str | None, force: bool, unsafe: bool,
            storage_options: tuple[str, ...]) -> None:
    """Convert the snapshot SRC to DST: torch.save <-> safetensors, or a DCP checkpoint
    directory (torch.distributed.checkpoint, sharded) to one torch.save file.

    SRC is verified against its checksum manifest first (a corrupt SRC is refused). DST's
    bytes are made in memory, read back as a reader of DST would and compared with SRC's state
    before anything is written; only then are those bytes published through snapkeep's writer
    (atomic, with a checksum manifest) and verified. On any failure nothing is left at DST.
    safetensors holds tensors only: a state with other
    values (optimizer hyper-parameters, iteration counters) is refused with the first such key;
    --key models/main converts the model of a manager snapshot.
    """
    fmt = _format_for(dst, to)
    options = parse_storage_options(storage_options)
    with progress(5, "converting", unit="step") as steps:
        with storage_errors(src):
            if "://" not in src and _is_dcp_directory(src):
                state = _load_dcp(src, unsafe=unsafe)
                steps.update(2)
            else:
                storage, path = resolve(src, options)
                require_file(src, storage, path, hint="'SRC'")
                before = file_checksum_status(storage, path)
                if before.status == "corrupt":
                    raise CheckFailed(f"{src} does not match its checksum manifest, not "
                                      f"converted: {before.detail}")
                steps.update(1)
                state = load_state(src, storage, path, unsafe=unsafe)
                steps.update(1)
        if key is not None:
            try:
                state = select(state, key)
            except KeyError as e:
                raise click.BadParameter(str(e.args[0]), param_hint="'--key'") from e
        try:
            for _ in leaves(state):  # refuse a hostile nesting before anything is written
                pass
        except TreeTooDeepError as e:
            raise CheckFailed(f"{src}: {e}") from e
        if fmt == "safetensors":
            _check_tensors_only(state)
        with storage_errors(dst):
            dst_storage, dst_path = resolve(dst, options)
            kind = file_kind(dst_storage, dst_path)
            if kind == "directory" or (kind != "missing" and not force):
                raise click.BadParameter(
                    f"{dst!r} exists{' and is a directory' if kind == 'directory' else ''}; "
                    "pass --force to replace a file, or choose another DST", param_hint="'DST'")
        data = _encode(state, fmt, dst)
        check_round_trip(state, data, src, dst, unsafe=unsafe)  # before anything is published
        steps.update(1)
        with storage_errors(dst):
            _write(state, data, dst_storage, dst_path, options)
            steps.update(1)
            after = file_checksum_status(dst_storage, dst_path)
            if after.status != "ok" or dst_storage.size(dst_path) != len(data):
                removed = remove_published(dst_storage, dst_path)
                raise CheckFailed(f"{dst} was written but does not verify ({after.status} "
                                  f"{after.detail}); removed {', '.join(removed) or 'nothing'}")
            steps.update(1)
    click.echo(f"converted {src} -> {dst} ({fmt}, {len(data)} bytes, checksum "
               f"{after.detail}; read back equal)")


def _encode(state: Any, fmt: str, dst: str) -> bytes:
    """``state`` encoded as DST's bytes, in memory; a codec's refusal is one clear line."""
    from snapkeep.codecs import save_safetensors, torch_save

    buffer = io.BytesIO()
    try:
        (save_safetensors if fmt == "safetensors" else torch_save)(state, buffer)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckFailed(f"cannot convert to {dst} ({fmt}): {e}; nothing was written") from e
    return buffer.getvalue()


def check_round_trip(state: Any, data: bytes, src: str, dst: str, *, unsafe: bool) -> None:
    """Decode ``data`` as a reader of DST will (format from its first bytes, safe loading
    unless ``unsafe``) and compare it with ``state``; refuse before DST is written."""
    from snapkeep.store import resolve_storage

    with tempfile.TemporaryDirectory(prefix="snapkeep-convert-") as tmp:
        encoded = os.path.join(tmp, "encoded")
        with open(encoded, "wb") as f:
            f.write(data)
        storage, path = resolve_storage(encoded)
        back = load_state(dst, storage, path, unsafe=unsafe)
        try:
            difference = compare(state, back)
        except TreeTooDeepError as e:
            raise CheckFailed(str(e)) from e
    if not difference.equal:
        raise CheckFailed(f"{dst} would read back different from {src}, so it was not "
                          f"written: {difference.as_json()}")


def _write(state: Any, data: bytes, storage: Any, path: str, options: dict[str, Any]) -> None:
    """Publish the checked bytes ``data`` (of ``state``) at ``path`` with a
    :class:`snapkeep.writing.SimpleWriter` (atomic commit and a checksum manifest)."""
    from snapkeep import writing

    def write_checked(obj: Any, f: Any) -> None:
        f.write(data)

    directory, name = storage.dirname(path), storage.basename(path)
    url = storage.url(directory)
    writer = writing.SimpleWriter(out_dir=url, storage_options=options or None)
    try:
        writer(name, url, state, savefun=write_checked)
    finally:
        writer.finalize()


def remove_published(storage: Any, path: str) -> list[str]:
    """Remove a published DST that failed its check, with its manifest, through the store's
    delete; the paths gone."""
    directory, name = storage.dirname(path), storage.basename(path)
    store = SnapshotStore(storage, directory, name.replace("{", "{{").replace("}", "}}"))
    entry = Entry(name=name, path=path, key=(), step=None)
    return [path, manifest_path(storage, path)] if store.delete(entry, by="convert") else []


def _check_tensors_only(state: Any) -> None:
    """safetensors stores nested dicts of tensors only; name the first other value."""
    import torch

    from snapkeep._cli_tree import MAX_DEPTH

    stack: list[tuple[str, Any, int]] = [("", state, 0)]
    while stack:
        where, node, depth = stack.pop()
        if isinstance(node, dict):
            if depth >= MAX_DEPTH:
                raise CheckFailed(f"the state nests dicts deeper than {MAX_DEPTH} levels")
            stack.extend(reversed([(f"{where}/{k}" if where else str(k), v, depth + 1)
                                   for k, v in node.items()]))
        elif not isinstance(node, torch.Tensor):
            found = _tensor_subtree(state)
            hint = (f", or pass --key {found} to convert that part (a dict of tensors only)"
                    if found else "")
            raise CheckFailed(
                f"the value at {where or '<root>'!r} is not a tensor but a {type(node).__name__}; "
                "safetensors stores dicts of tensors only (a snapshot also holds optimizer "
                f"settings and counters): keep torch format{hint}")


def _tensor_subtree(state: Any, max_depth: int = 3) -> str | None:
    """The ``--key`` of the first sub-tree of ``state`` (breadth first, at most ``max_depth``
    levels down) that is a non-empty dict of tensors only (a model's state dict:
    ``models/main`` in a manager snapshot, ``state/model`` in a Checkpointer's); None."""
    import torch

    def tensors_only(node: Any) -> bool:
        if isinstance(node, dict):
            return bool(node) and all(tensors_only(v) for v in node.values())
        return isinstance(node, torch.Tensor)

    level: list[tuple[str, Any]] = [("", state)]
    for _ in range(max_depth + 1):
        below: list[tuple[str, Any]] = []
        for where, node in level:
            if not isinstance(node, dict):
                continue
            if where and tensors_only(node):
                return where
            below += [(f"{where}/{k}" if where else str(k), v) for k, v in node.items()]
        level = below
    return None
