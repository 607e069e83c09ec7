"""The catalog: committed snapshots of one filename template, ordered by step, verified.

"Latest" is the highest key parsed from the filename template (iteration, then epoch) among
snapshots that verify -- never mtime. Verification checks the file against the checksum manifest
recorded at commit; a snapshot without a manifest (ppe-written, or a crash between the two
commits) is accepted only if it loads completely, with a warning.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import struct
import warnings
import zipfile
from collections.abc import Callable
from typing import Any

from snapkeep._core.checksum import digest_stream
from snapkeep._core.errors import (
    NoValidSnapshotError,
    SnapshotCorruptError,
    SnapshotStorageError,
    UnsafeSnapshotError,
)
from snapkeep._core.manifest import MANIFEST_DIR, Manifest, manifest_path, read_manifest
from snapkeep._core.naming import FilenameTemplate
from snapkeep._core.storage import Storage

logger = logging.getLogger(__name__)

#: What a failed verification or decode of untrusted bytes can raise. A file raising one of these
#: is skipped (named in a warning); an :class:`UnsafeSnapshotError` is never swallowed.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    SnapshotCorruptError, RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError,
    KeyError, IndexError, TypeError, AttributeError, struct.error, zipfile.BadZipFile,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One snapshot file found by the catalog.

    Attributes:
        name: file name relative to the output directory (what the template produced).
        path: full path on the storage.
        key: sort key parsed from the name (iteration first).
        step: the first number of the key (the iteration when the template has one).
    """

    name: str
    path: str
    key: tuple[float, ...]
    step: int | None


class Catalog:
    """Snapshots of one template in one directory.

    Args:
        storage: where they live.
        directory: the output directory on ``storage``.
        template: the filename template; a ``str`` template or :class:`FilenameTemplate`.
    """

    def __init__(self, storage: Storage, directory: str, template: FilenameTemplate | str) -> None:
        self.storage = storage
        self.directory = directory
        self.template = template if isinstance(template, FilenameTemplate) \
            else FilenameTemplate(template)

    def entries(self) -> list[Entry]:
        """Committed snapshot files of this template, oldest (lowest key) first.

        Temporary files, manifests and files that do not match the template are never listed.
        Only templates whose directory part is literal (``'snap/iter_{.iteration}'``) are
        listable; others yield [].
        """
        split = self._split()
        if split is None:
            return []
        sub, base = split
        base_template = FilenameTemplate(base)
        directory = self.storage.join(self.directory, sub) if sub else self.directory
        found = []
        for name in self.storage.list_names(directory):
            key = base_template.parse(name)
            if key is None:
                continue
            rel = f"{sub}/{name}" if sub else name
            found.append(Entry(name=rel, path=self.storage.join(directory, name), key=key,
                               step=int(key[0]) if key else None))
        found.sort(key=lambda e: (e.key, e.name))
        return found

    def _split(self) -> tuple[str, str] | None:
        """``(sub-directory, base template)`` of a listable template, else None."""
        if not self.template.parsable:
            return None
        template = str(self.template.template)
        sub, _, base = template.rpartition("/")
        if "{" in sub:
            logger.warning("filename template %r has fields in its directory part; snapshots "
                           "cannot be listed for autoload or retention", template)
            return None
        return sub, base

    def remove_stale_temps(self) -> list[str]:
        """Remove temporary files of crashed writers from the snapshot directory of this
        template and from its manifest directory (see ``Storage.remove_stale_temps``); return
        the removed paths."""
        split = self._split()
        if split is None:
            return []
        sub = split[0]
        directory = self.storage.join(self.directory, sub) if sub else self.directory
        removed = self.storage.remove_stale_temps(directory)
        removed += self.storage.remove_stale_temps(self.storage.join(directory, MANIFEST_DIR))
        return removed

    def orphan_manifests(self, entries: list[Entry] | None = None) -> list[str]:
        """Paths of this template's manifests whose snapshot file is gone (a process killed
        between deleting a snapshot and deleting its manifest); ``entries`` is the current
        listing (default :meth:`entries`). A manifest is always committed after its snapshot,
        so one without a snapshot can only be left over from a deletion."""
        split = self._split()
        if split is None:
            return []
        sub, base = split
        present = {e.name for e in (self.entries() if entries is None else entries)}
        base_template = FilenameTemplate(base)
        directory = self.storage.join(self.directory, sub) if sub else self.directory
        manifest_dir = self.storage.join(directory, MANIFEST_DIR)
        orphans = []
        for name in self.storage.list_names(manifest_dir):
            snapshot, dot, ext = name.rpartition(".")
            if not dot or ext != "json" or base_template.parse(snapshot) is None:
                continue
            if (f"{sub}/{snapshot}" if sub else snapshot) not in present:
                orphans.append(self.storage.join(manifest_dir, name))
        return orphans

    def manifest(self, entry: Entry) -> Manifest | None:
        """The entry's manifest, or ``None`` when it has none (or it is unreadable)."""
        path = manifest_path(self.storage, entry.path)
        try:
            return read_manifest(self.storage, path)  # validated, bounded, regular files only
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, TypeError) as e:
            logger.warning("manifest %s is unreadable (%s); treating %s as unverified", path, e,
                           entry.path)
            return None

    def verify(self, entry: Entry, data: bytes | None = None) -> Manifest | None:
        """Check the entry against its manifest; return the manifest (None if it has none).

        Args:
            entry: the snapshot.
            data: its bytes when already fetched (remote stores), else the file is streamed.

        Raises:
            SnapshotCorruptError: size or checksum differs from the manifest, or the file is
                unreadable.
        """
        manifest = self.manifest(entry)
        if manifest is None:
            return None
        try:
            if data is not None:
                digest, size = digest_stream(io.BytesIO(data))
            else:
                with self.storage.open_read(entry.path) as f:
                    digest, size = digest_stream(f)
        except SnapshotStorageError:
            raise  # the store is unreachable: that says nothing about this snapshot
        except OSError as e:
            raise SnapshotCorruptError(f"{entry.path}: unreadable ({e})") from e
        if size != manifest.size_bytes:
            raise SnapshotCorruptError(
                f"{entry.path}: size {size} bytes, manifest recorded {manifest.size_bytes} "
                "(truncated or overwritten)")
        if digest != manifest.checksum:
            raise SnapshotCorruptError(
                f"{entry.path}: {manifest.algorithm} checksum {digest} does not match the "
                f"recorded {manifest.checksum} (corrupted)")
        return manifest

    def load_newest(
        self, loader: Callable[[Entry, bytes | None], Any], *,
        candidates: list[Entry] | None = None,
    ) -> tuple[Entry, Any] | None:
        """Load the newest snapshot that verifies and loads; warn about each one skipped.

        Args:
            loader: ``loader(entry, data) -> state``, where ``data`` is the file's bytes when the
                store is remote (fetched once, verified, then decoded from memory: one download)
                and ``None`` for local files; a ``SnapshotCorruptError`` or a read/decode error
                (any of :data:`DECODE_ERRORS` other than a refused unsafe load) marks the entry
                invalid.
            candidates: entries to consider (default: :meth:`entries`).

        Returns:
            ``(entry, state)``, or ``None`` when there are no snapshot files at all.

        Raises:
            NoValidSnapshotError: snapshot files exist but none is valid (each reason listed);
                nothing is deleted.
            UnsafeSnapshotError: the newest valid file needs arbitrary unpickling.
            SnapshotStorageError: the store could not be reached (not treated as corruption).
        """
        entries = self.entries() if candidates is None else candidates
        if not entries:
            return None
        reasons = []
        for entry in reversed(entries):
            try:
                data = None if self.storage.is_local else self.storage.read_bytes(entry.path)
                manifest = self.verify(entry, data)
                state = loader(entry, data)
            except (UnsafeSnapshotError, SnapshotStorageError):
                raise  # refused, or the store is unreachable: never fall back to an older one
            except DECODE_ERRORS as e:
                reason = str(e) if isinstance(e, SnapshotCorruptError) \
                    else f"{entry.path}: {type(e).__name__}: {e}"
                warnings.warn(f"skipping snapshot {entry.name} (step {entry.step}): {reason}",
                              RuntimeWarning, stacklevel=2)
                logger.warning("skipping snapshot %s (step %s): %s", entry.name, entry.step,
                               reason)
                reasons.append(reason)
                continue
            if manifest is None:
                warnings.warn(
                    f"snapshot {entry.name} (step {entry.step}) has no checksum manifest (written "
                    "by ppe or interrupted before its manifest was committed); it loaded "
                    "completely but is unverified", RuntimeWarning, stacklevel=2)
            return entry, state
        raise NoValidSnapshotError(
            f"{len(entries)} snapshot file(s) of {self.template.template!r} in "
            f"{self.directory!r}, none valid; refusing to start over silently. Reasons: "
            + "; ".join(reasons[:10])
            + ". Move them away to start fresh, or restore a good copy.")
