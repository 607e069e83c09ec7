"""Several O_DIRECT writes in flight per file (``DirectFile(streams=N)``): each full chunk after
the first is written by ``pwrite`` at its offset in the background while the next is gathered;
the bytes on disk are those of one sequential write, and a failed background write surfaces."""

from __future__ import annotations

import errno
import os

import pytest

from snapkeep._core.storage import _direct
from snapkeep._core.storage._direct import DirectFile
from snapkeep._core.storage._direct_resources import CHUNK_BYTES, open_for_write
from support.fd_faults import fd_under


def _payload(n: int) -> bytes:
    return (bytes(range(253)) * (n // 253 + 1))[:n]


def _write(path, pieces: list[bytes], streams: int) -> bool:
    fd, direct = open_for_write(str(path))
    with DirectFile(fd, direct, streams=streams) as f:
        for piece in pieces:
            assert f.write(piece) == len(piece)
        f.finish()
        os.fsync(f.fileno())
        return f.direct


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("size", [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, 3 * CHUNK_BYTES + 77,
                                  5 * CHUNK_BYTES])
def test_round_trip(tmp_path, streams, size):
    data = _payload(size)
    _write(tmp_path / "one", [data], streams)
    assert (tmp_path / "one").read_bytes() == data
    pieces = [data[i:i + 3_000_001] for i in range(0, size, 3_000_001)]
    _write(tmp_path / "many", pieces, streams)
    assert (tmp_path / "many").read_bytes() == data


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_streams_rejected(tmp_path, bad):
    fd, _ = open_for_write(str(tmp_path / "f"))
    try:
        with pytest.raises(ValueError, match="streams must be an int >= 1"):
            DirectFile(fd, False, streams=bad)
    finally:
        os.close(fd)


def _require_direct(tmp_path) -> None:
    fd, direct = open_for_write(str(tmp_path / "probe"))
    os.close(fd)
    if not direct:
        pytest.skip("this filesystem refuses O_DIRECT")


def test_a_failed_background_write_surfaces(tmp_path, monkeypatch):
    _require_direct(tmp_path)
    calls = []
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        if not fd_under(fd, tmp_path):  # another thread's write (patched process-wide)
            return real_pwrite(fd, data, offset)
        calls.append(offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_direct.os, "pwrite", full)
    with pytest.raises(OSError) as info:
        _write(tmp_path / "f", [_payload(4 * CHUNK_BYTES + 5)], streams=2)
    assert info.value.errno == errno.ENOSPC
    # the first chunk was written synchronously (never by pwrite); the background writes in
    # flight may reach pwrite in any order (before: calls[0] == CHUNK_BYTES, which a loaded
    # machine broke: [16 MiB, 8 MiB])
    assert calls and min(calls) == CHUNK_BYTES


def test_a_short_unaligned_background_write_continues_buffered(tmp_path, monkeypatch):
    _require_direct(tmp_path)
    real_pwrite = os.pwrite
    calls = []

    def short(fd, data, offset):
        if not fd_under(fd, tmp_path):  # another thread's write (patched process-wide)
            return real_pwrite(fd, data, offset)
        calls.append(offset)
        if len(calls) == 1:  # only 1000 bytes of the second chunk land
            import fcntl

            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            n = real_pwrite(fd, bytes(memoryview(data)[:1000]), offset)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            return n
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(_direct.os, "pwrite", short)
    data = _payload(3 * CHUNK_BYTES + 77)
    assert _write(tmp_path / "f", [data], streams=2) is False
    assert len(calls) >= 2
    assert (tmp_path / "f").read_bytes() == data
