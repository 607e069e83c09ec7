"""What one save carries to wherever it runs (:class:`SaveJob`) and what comes back
(:class:`CommitRecord`).

The commit itself is :func:`snapkeep._core.store.files.commit_job`; it runs wherever an executor
puts
it (the caller's thread, a writer thread or the persistent worker process), so everything it
needs travels in a picklable :class:`SaveJob`. Retention runs afterwards in the trainer process
(see ``saver``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from snapkeep._core.storage import Storage

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveJob:
    """Everything a worker needs to write one snapshot.

    Attributes:
        storage: where to write.
        path: final path of the snapshot on ``storage``.
        savefun: ``savefun(obj, file, **savefun_kwargs)``, torch.save's argument order.
        savefun_kwargs: extra keyword arguments for ``savefun``.
        append: open in append mode without atomic commit or manifest (ppe's ``append=True``).
        tag: short string unique to the writer, used in temporary names.
        step: training iteration, recorded in the manifest.
        run_id: run lineage recorded in the manifest.
        metrics: observation values recorded in the manifest.
        version: snapkeep version recorded in the manifest.
        incremental: an incremental snapshot's blob area and settings
            (:class:`~snapkeep._core.tiers.incremental.IncrementalJob`); None writes a plain file.
        door: the door whose state layout it is, recorded in the manifest (see
            ``Manifest.door``); empty: not recorded.
    """

    storage: Storage
    path: str
    savefun: Callable[..., Any]
    savefun_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    append: bool = False
    tag: str = "w"
    step: int | None = None
    run_id: str | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    version: str = ""
    incremental: Any = None
    door: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommitRecord:
    """A committed snapshot.

    Attributes:
        path: final path.
        size_bytes: bytes written.
        checksum: content checksum (``None`` for append-mode writes).
        write_s: seconds spent encoding and committing (in the worker).
        step: training iteration when known.
        blob_bytes: bytes of blobs written by an incremental snapshot (``size_bytes`` counts
            its skeleton file only).
        blob_digests: an incremental snapshot's blob storages written or found by the commit:
            ``(first tree path, digest)`` each.
    """

    path: str
    size_bytes: int
    checksum: str | None
    write_s: float
    step: int | None = None
    blob_bytes: int = 0
    blob_digests: tuple[tuple[tuple[Any, ...], str], ...] = ()
