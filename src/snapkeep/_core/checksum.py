"""Content checksums recorded at commit and verified on resume.

xxHash's XXH3-128 (the ``xxhash`` package) runs at ~8 GiB/s on one core here, against ~1.3 GiB/s
for SHA-256, so hashing while writing costs ~0.13 CPU-s per GiB. It detects truncation, bit flips
and torn writes; it is not a defence against a forger (use object-store signatures for that).
"""

from __future__ import annotations

from typing import IO, Any, BinaryIO

import xxhash

ALGORITHM = "xxh3_128"
_READ_CHUNK_BYTES = 8 << 20


def new_hasher() -> Any:
    """A fresh streaming hasher with ``update(bytes)`` and ``hexdigest()``."""
    return xxhash.xxh3_128()


class HashingWriter:
    """A write-only binary file wrapper that hashes and counts every byte written through it.

    ``torch.save`` and most ``savefun`` implementations only call ``write``/``flush``/``tell``;
    ``seek`` is refused because a checksum over rewritten bytes would be wrong.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._hasher = new_hasher()
        self.size_bytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
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


def digest_stream(f: IO[bytes]) -> tuple[str, int]:
    """Hash a readable binary stream to its end; return ``(hexdigest, size_bytes)``."""
    hasher = new_hasher()
    size = 0
    while True:
        chunk = f.read(_READ_CHUNK_BYTES)
        if not chunk:
            break
        hasher.update(chunk)
        size += len(chunk)
    return str(hasher.hexdigest()), size
