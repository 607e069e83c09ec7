"""Hashing on the way to storage: every byte a commit writes is hashed as it passes.

The storage layer owns this stream because the checksum it returns in
:class:`~._commit.WriteResult` must cover exactly the bytes it made durable; what the checksum
means to a reader (manifests, verification, fallback) is :mod:`snapkeep._core.format.checksum`'s.
"""

from __future__ import annotations

from typing import Any, BinaryIO

import xxhash

#: The checksum algorithm of every manifest and marker (recorded in each as ``algorithm``).
CHECKSUM_ALGORITHM = "xxh3_128"


def new_hasher() -> Any:
    """A fresh streaming hasher with ``update(bytes)`` and ``hexdigest()``."""
    return xxhash.xxh3_128()


class HashingWriter:
    """A write-only binary file wrapper that hashes and counts every byte written through it.

    ``torch.save`` and most ``savefun`` implementations only call ``write``/``flush``/``tell``;
    ``seek`` is refused because a checksum over rewritten bytes would be wrong.

    Args:
        raw: the file written to.
        hashed_by: a hasher (from :func:`new_hasher`) that ``raw`` itself feeds with every byte
            written to it, in order (:class:`~snapkeep._core.storage._direct.DirectFile` does,
            hashing each piece while it is in the CPU cache); this wrapper then only counts.
    """

    def __init__(self, raw: BinaryIO, *, hashed_by: Any = None) -> None:
        self._raw = raw
        self._hash_here = hashed_by is None
        self._hasher = new_hasher() if hashed_by is None else hashed_by
        self.size_bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._hash_here:
            self._hasher.update(view)
        written = self._raw.write(view)
        n = len(view) if written is None else written
        self.size_bytes += n
        return n

    def flush(self) -> None:
        self._raw.flush()

    def tell(self) -> int:
        return self.size_bytes

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return bool(getattr(self._raw, "closed", False))

    def hexdigest(self) -> str:
        return str(self._hasher.hexdigest())
