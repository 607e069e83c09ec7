"""Files and snapshot stores for the CLI: where a command's arguments point, whether they are
regular files (never opening a FIFO or a directory as a file), each snapshot's status, and the
one adapter to the store that owns a template's files.

Exit codes (the table of ``snapkeep --help``):

====  ===========================================================================================
0     success: everything checked is valid, the snapshots are equal, the command did its work
1     a check failed: a snapshot is corrupt, unloadable or refused as unsafe; no snapshot in
      DIR (verify); the two snapshots differ (diff); a delete failed (prune); a state cannot be
      converted
2     usage error: unknown option, bad value, a path that is not a file/directory, DST exists
3     the storage could not be read or written (unreachable endpoint, credentials, permissions)
====  ===========================================================================================
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from collections.abc import Callable, Sequence
from typing import Any

import click

from snapkeep.errors import (
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotStorageError,
    UnsafeSnapshotError,
)
from snapkeep.store import (
    DECODE_ERRORS,
    MANIFEST_DIR,
    ON_ERROR_SUFFIX,
    CheckpointDirs,
    CheckpointMarker,
    Entry,
    Manifest,
    ManifestError,
    SnapshotStore,
    Storage,
    is_marker,
    load_file,
    manifest_path,
    marker_of_file,
    misnamed_reason,
    newest_valid,
    ppe_template,
    read_manifest,
    resolve_storage,
    verify_marked_file,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STORAGE = 0, 1, 2, 3
#: What loading an untrusted file can raise (a hostile pickle nested very deep included).
LOAD_ERRORS: tuple[type[BaseException], ...] = (*DECODE_ERRORS, RecursionError, MemoryError)
#: Manifests larger than this are not read while looking for other templates.
MAX_MANIFEST_BYTES = 1 << 20


class CheckFailed(click.ClickException):
    """A check failed (exit code 1)."""

    exit_code = EXIT_FAILED


class StorageTrouble(click.ClickException):
    """The storage could not be read or written (exit code 3)."""

    exit_code = EXIT_STORAGE


def open_store(storage: Storage, directory: str, template: str) -> SnapshotStore:
    """The one place the CLI builds the object that owns a template's files (entries, manifest,
    verify; :func:`delete_entry` deletes). ``template`` is spelled as ``-t`` takes it: ppe's
    ``'snapshot_iter_{.iteration}'`` or the store's ``'ckpt_{step}'``."""
    return SnapshotStore(storage, directory, ppe_template(template))


def delete_entry(store: SnapshotStore, entry: Entry) -> list[str]:
    """Delete a snapshot and then its manifest through the store's one delete; return the
    snapshot's path. Raises the storage's error when the snapshot cannot be deleted (its
    manifest is then kept)."""
    store.delete(entry, by="prune", strict=True)
    return [entry.path]


def resolve(location: str, options: dict[str, Any]) -> tuple[Storage, str]:
    """``(storage, path)`` of a path or fsspec URL."""
    return resolve_storage(location, storage_options=options or None)


def require_directory(location: str, storage: Storage, path: str, hint: str = "'DIR'") -> None:
    """A local ``location`` must be a directory (usage error otherwise); URLs are not checked
    (object stores have no directories)."""
    if storage.is_local and not os.path.isdir(path):
        raise click.BadParameter(f"{location!r} is not a directory", param_hint=hint)


def file_kind(storage: Storage, path: str) -> str:
    """``'file'``, ``'directory'``, ``'missing'`` or ``'special'`` (FIFO, socket, device), found
    without opening the path (a FIFO would block)."""
    if storage.is_local:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return "missing"
        if stat.S_ISREG(mode):
            return "file"
        return "directory" if stat.S_ISDIR(mode) else "special"
    try:
        info = storage.info(path)
    except FileNotFoundError:
        return "missing"
    return "directory" if info.get("type") == "directory" else "file"


def require_file(location: str, storage: Storage, path: str, hint: str = "'FILE'") -> int:
    """Check that ``location`` is a non-empty regular file and return its size in bytes.

    Raises:
        click.BadParameter: missing, a directory, a FIFO/socket/device (usage error).
        CheckFailed: a 0-byte file.
    """
    kind = file_kind(storage, path)
    if kind == "missing":
        raise click.BadParameter(f"{location!r} is not a file (no such file)", param_hint=hint)
    if kind == "directory":
        dcp = storage.is_local and os.path.isfile(os.path.join(path, ".metadata"))
        raise click.BadParameter(
            f"{location!r} is not a file but a directory; " + (
                "it holds a DCP checkpoint: 'snapkeep convert DIR FILE.pt' consolidates it into "
                "one file" if dcp else "pass one snapshot file (snapkeep ls lists a "
                "directory's snapshots)"), param_hint=hint)
    if kind == "special":
        raise click.BadParameter(
            f"{location!r} is not a file but a FIFO, socket or device; pass a regular snapshot "
            "file", param_hint=hint)
    size = storage.size(path)
    if size == 0:
        raise CheckFailed(f"{location} is empty (0 bytes): not a snapshot (an interrupted copy "
                          "or a file truncated to nothing)")
    return size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Status:
    """What ``ls``/``verify`` found about one snapshot.

    ``status`` is ``'ok'`` (matches its manifest), ``'corrupt'`` (does not, or does not load),
    ``'unverified'`` (no manifest, loads completely), ``'unsafe'`` (no manifest, needs arbitrary
    unpickling: autoload refuses it) or ``'no manifest'`` (not checked further, ``ls``).
    """

    status: str
    detail: str = ""
    manifest: Manifest | None = None


def checksum_status(store: SnapshotStore, entry: Entry) -> Status:
    """The snapshot against its manifest; ``'no manifest'`` when it has none."""
    try:
        manifest = store.verify(entry)
    except SnapshotCorruptError as e:
        return Status(status="corrupt", detail=str(e), manifest=store.manifest(entry))
    if manifest is None:
        return Status(status="no manifest", detail=_invalid_manifest(store, entry))
    return Status(status="ok", detail=f"{manifest.algorithm} {manifest.checksum}",
                  manifest=manifest)


def _invalid_manifest(store: SnapshotStore, entry: Entry) -> str:
    """Why the manifest of ``entry`` is unusable (``'invalid checksum manifest: ...'``), or ''
    when there is none: ``--json`` output has no warnings, so the reason goes in the detail."""
    try:
        read_manifest(store.storage, manifest_path(store.storage, entry.path))
    except ManifestError as e:
        return f"invalid checksum manifest: {e}"
    except OSError:
        return ""
    return ""


def load_status(store: SnapshotStore, entry: Entry) -> Status:
    """:func:`checksum_status`, and for a manifest-less file a complete load with
    ``weights_only=True``, as autoload does: ``'unverified'``, ``'unsafe'`` or ``'corrupt'``."""
    found = checksum_status(store, entry)
    if found.status != "no manifest":
        return found
    try:
        if file_kind(store.storage, entry.path) != "file":
            return Status(status="corrupt", detail=f"{entry.path} is not a regular file")
        state = load_file(store.storage, entry.path, weights_only=True)
    except UnsafeSnapshotError as e:
        return Status(status="unsafe", detail=str(e))
    except SnapshotStorageError:
        raise
    except LOAD_ERRORS as e:
        return Status(status="corrupt", detail=f"{type(e).__name__}: {e}" if str(e)
                      else f"{type(e).__name__} (empty or truncated file)")
    reason = misnamed_reason(entry.name, entry.step, str(store.template.template), state)
    if reason is not None:  # autoload skips it too
        return Status(status="corrupt", detail=reason)
    return Status(status="unverified",
                  detail=f"{found.detail or 'no checksum manifest'}; loads completely")


@dataclasses.dataclass(frozen=True)
class AutoloadChoice:
    """What autoload would do with a template's snapshots, as the CLI's statuses show it:
    ``resume_from`` (None: none valid, or ``refused`` stopped the walk), ``refused`` (an unsafe
    snapshot autoload refuses and never falls back past), ``checked`` (status of each entry
    checked on the way, by name)."""

    resume_from: Entry | None
    refused: Entry | None
    checked: dict[str, Status]


def autoload_choice(entries: Sequence[Entry],
                    status_of: Callable[[Entry], Status]) -> AutoloadChoice:
    """The store's newest-valid-with-fallback (:func:`snapkeep.store.newest_valid`, as autoload
    walks them) over ``entries`` (oldest first) with the CLI's ``status_of`` as the check:
    ``'ok'``/``'unverified'`` is valid, ``'unsafe'`` stops the walk, anything else is skipped as
    corrupt. Raises only what ``status_of`` raises (``SnapshotStorageError``)."""
    checked: dict[str, Status] = {}
    last: list[Entry] = []

    def check(entry: Entry) -> Status:
        found = checked[entry.name] = status_of(entry)
        last[:] = [entry]
        if found.status == "unsafe":
            raise UnsafeSnapshotError(found.detail)
        if found.status not in ("ok", "unverified"):
            raise SnapshotCorruptError(found.detail)
        return found

    try:
        chosen = newest_valid(entries, check, what="the CLI's listing",
                              skipped=lambda entry, error: None)  # each status is shown
    except UnsafeSnapshotError:
        return AutoloadChoice(resume_from=None, refused=last[0], checked=checked)
    except NoValidSnapshotError:
        chosen = None
    return AutoloadChoice(resume_from=chosen[0] if chosen else None, refused=None,
                          checked=checked)


def sharded_rows(store: SnapshotStore) -> list[tuple[Entry, int, Status]]:
    """``(entry, size in bytes, status)`` of the committed sharded (DCP) snapshot directories of
    the store's template, oldest first: each is verified whole against its marker (every file's
    size and checksum). Imports ``torch.distributed.checkpoint`` (seconds): called only when a
    directory holds no single-file snapshots."""
    from snapkeep.distributed import ShardedStore

    try:
        sharded = ShardedStore(store.storage, store.directory, store.template)
    except ValueError:  # fields in the template's directory part: no sharded snapshot has it
        return []
    rows = []
    marked = CheckpointDirs(store.storage, store.directory)
    for entry in sharded.entries():
        if _is_marked(store.storage, entry.path):  # the Hugging Face door's checkpoint-N
            rows.append(_marked_row(marked, entry))
            continue
        manifest = sharded.manifest(entry)
        size = sum(r.size_bytes for r in manifest.files.values()) if manifest else 0
        try:  # the store's check, as autoload's: every file, then the metadata's allow-list
            sharded.validate_part(entry, 0, 1)
        except UnsafeSnapshotError as e:
            rows.append((entry, size, Status(status="unsafe", detail=str(e))))
            continue
        except SnapshotCorruptError as e:
            rows.append((entry, size, Status(status="corrupt", detail=str(e))))
            continue
        files = len(manifest.files) if manifest else 0
        world = manifest.world_size if manifest else "?"
        rows.append((entry, size, Status(
            status="ok", detail=f"sharded (DCP): {files} files from {world} rank(s)")))
    return rows


def _is_marked(storage: Storage, path: str) -> bool:
    """Whether the directory ``path`` is committed by a marked directory's marker (bounded
    read of a regular file only)."""
    from snapkeep.distributed import MARKER_NAME

    try:
        return is_marker(storage.read_bytes(storage.join(path, MARKER_NAME),
                                            max_bytes=MAX_MANIFEST_BYTES))
    except (OSError, ValueError):
        return False


def _marked_row(marked: CheckpointDirs, entry: Entry) -> tuple[Entry, int, Status]:
    """``(entry, size in bytes, status)`` of one marked directory, every file verified."""
    try:
        marker = marked.verify(entry)
    except SnapshotCorruptError as e:
        return entry, 0, Status(status="corrupt", detail=str(e))
    size = sum(r.size_bytes for r in marker.files.values())
    return entry, size, Status(status="ok", detail=f"directory: {len(marker.files)} files "
                               "committed by their marker")


def manifest_of(storage: Storage, path: str) -> Manifest | None:
    """The manifest of the snapshot file ``path`` (None when it has none or it is unreadable)."""
    directory, name = storage.dirname(path), storage.basename(path)
    store = open_store(storage, directory, name.replace("{", "{{").replace("}", "}}"))
    return store.manifest(Entry(name=name, path=path, key=(), step=None))


def file_checksum_status(storage: Storage, path: str) -> Status:
    """:func:`checksum_status` of one file outside any template; a file without a manifest
    inside a marked directory (a Hugging Face ``checkpoint-N``) is checked against the record
    of its directory's commit marker instead."""
    directory, name = storage.dirname(path), storage.basename(path)
    store = open_store(storage, directory, name.replace("{", "{{").replace("}", "}}"))
    found = checksum_status(store, Entry(name=name, path=path, key=(), step=None))
    if found.status != "no manifest":
        return found
    try:
        marked = marker_of_file(storage, path)
        if marked is None:
            return found
        marked_dir, relative, marker = marked
        if relative not in marker.files:
            return Status(status="no manifest", detail=f"not listed by the commit marker of "
                          f"{marked_dir}")
        checksum = verify_marked_file(storage, marked_dir, relative, marker)
    except SnapshotCorruptError as e:
        return Status(status="corrupt", detail=str(e))
    return Status(status="ok", detail=f"{marker.algorithm} {checksum}, recorded by the commit "
                  f"marker of {marked_dir}")


#: The last run of ASCII digits in a name.
_LAST_NUMBER = re.compile(r"[0-9]+(?=[^0-9]*\Z)")


def _as_template(stem: str, step: int | None) -> str:
    """``stem`` with its ``step`` replaced by ``{step}`` (``ckpt-40`` at step 40 ->
    ``ckpt-{step}``), or without a step its last number (``iter_7`` -> ``iter_{step}``)."""
    if step is not None and str(step) in stem:
        head, _, tail = stem.rpartition(str(step))
        return f"{_escaped(head)}{{step}}{_escaped(tail)}"
    number = _LAST_NUMBER.search(stem)
    return _escaped(stem) if number is None else \
        f"{_escaped(stem[:number.start()])}{{step}}{_escaped(stem[number.end():])}"


def _escaped(literal: str) -> str:
    return literal.replace("{", "{{").replace("}", "}}")


def same_template(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same files, whatever their spelling (ppe's
    ``snapshot_iter_{.iteration}`` is the store's ``snapshot_iter_{step}``)."""
    if a == b:
        return True
    try:
        return ppe_template(a).template == ppe_template(b).template
    except (TypeError, ValueError):
        return False


def _sharded_templates(storage: Storage, directory: str,
                       found: dict[str, list[str]]) -> None:
    """Add the templates of sharded snapshot directories of ``directory`` (their commit markers,
    regular files read bounded) to ``found`` (template -> the names it was made from)."""
    from snapkeep.distributed import MARKER_NAME, ShardedManifest

    try:
        children = storage.list_dirs(directory)
    except (OSError, ValueError):
        return
    for name in children[:1000]:
        if name.endswith(ON_ERROR_SUFFIX):  # kept for inspection: not a template of its own
            continue
        child = storage.join(directory, name)
        marker = storage.join(child, MARKER_NAME)
        try:
            if file_kind(storage, child) != "directory" or file_kind(storage, marker) != "file":
                continue
            # bounded as it is read: a marker that grows after a size check is never read whole
            data = storage.read_bytes(marker, max_bytes=MAX_MANIFEST_BYTES)
            # a marked directory's (the Hugging Face door's checkpoint-N), or a sharded one's
            manifest: Any = CheckpointMarker.from_bytes(data) if is_marker(data) \
                else ShardedManifest.from_bytes(data)
        except (OSError, ValueError, UnicodeDecodeError, TypeError, KeyError,
                SnapshotCorruptError):
            continue
        # a checkpoint-N is of its kind's template whatever step its marker records (a copy,
        # checkpoint-40 of step 4, is listed and reported bad, not a template of its own)
        kind = CheckpointDirs.template
        template = str(kind.template) if is_marker(data) and kind.parse(name) is not None \
            else _as_template(name, manifest.step)
        found.setdefault(template, []).append(name)


#: A run of ASCII digits in a template's literal text (outside its fields).
_DIGITS_OR_FIELD = re.compile(r"(\{[^{}]*\})|[0-9]+")


def _merge_numbered(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """Templates that differ only in the other numbers of their names (Lightning's
    ``epoch=0-step={step}.ckpt`` and ``epoch=1-step={step}.ckpt``) as one, those numbers a
    second field (``epoch={epoch}-step={step}.ckpt``: the step still sorts first); a template
    alone is kept as it is."""
    def shape(template: str, field: str) -> str:
        return _DIGITS_OR_FIELD.sub(lambda m: m.group(1) or field, template)

    groups: dict[str, list[str]] = {}
    for template in found:
        groups.setdefault(shape(template, "#"), []).append(template)
    merged: dict[str, list[str]] = {}
    for members in groups.values():
        key = members[0] if len(members) == 1 else shape(members[0], "{epoch}")
        for template in members:
            merged.setdefault(key, []).extend(found[template])
    return merged


def recorded_snapshots(storage: Storage, directory: str) -> dict[str, list[str]]:
    """The templates the manifests in ``directory`` record (and the commit markers of its
    sharded snapshot directories), each with the names of the snapshots it was made from: for
    ``ls`` on a directory of another template, the CLI's default template and ``-t GLOB``.
    A template, in the store's spelling, is a manifest's name with its recorded step replaced by
    ``{step}`` (``ckpt-40`` at step 40 -> ``ckpt-{step}``), or, without a recorded step, its
    last number (``iter_7`` -> ``iter_{step}``); templates differing only in another number of
    the names are one, that number an ``{epoch}`` field (Lightning's default
    ``epoch=E-step=S.ckpt``: ``epoch={epoch}-step={step}.ckpt``). On-error snapshots
    (``<name>.on-error``, kept for inspection) are not a template of their own: a Checkpointer
    directory holding one still needs no ``-t``."""
    manifest_dir = storage.join(directory, MANIFEST_DIR)
    found: dict[str, list[str]] = {}
    try:
        names = storage.list_names(manifest_dir)
    except (OSError, ValueError):
        names = []
    for name in names[:1000]:
        path = storage.join(manifest_dir, name)
        if not name.endswith(".json") or file_kind(storage, path) != "file":
            continue
        try:  # bounded as it is read (read_manifest): never a whole file that grew meanwhile
            manifest = read_manifest(storage, path)
        except (ManifestError, OSError, ValueError, UnicodeDecodeError, TypeError):
            continue
        if manifest is None:
            continue
        if manifest.name.endswith(ON_ERROR_SUFFIX):
            continue
        template = _as_template(manifest.name, manifest.step)
        found.setdefault(template, []).append(manifest.name)
    _sharded_templates(storage, directory, found)
    return _merge_numbered(found)


def recorded_templates(storage: Storage, directory: str) -> list[str]:
    """The templates of :func:`recorded_snapshots`."""
    return list(recorded_snapshots(storage, directory))
