"""Local files written with O_DIRECT (``_core.storage._direct``): same bytes, every size, and the
fallbacks to buffered writes when the filesystem or a write refuses."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys

import pytest

from snapkeep._core.storage import _direct, _direct_resources
from snapkeep._core.storage._direct import ALIGN_BYTES, DirectFile
from snapkeep._core.storage._direct_resources import CHUNK_BYTES, open_for_write
from support.fd_faults import fd_under

SIZES = [0, 1, ALIGN_BYTES - 1, ALIGN_BYTES, ALIGN_BYTES + 1, CHUNK_BYTES - 1, CHUNK_BYTES,
         CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 12345]


def _payload(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


def _write(path, pieces: list[bytes]) -> bool:
    fd, direct = open_for_write(str(path))
    with DirectFile(fd, direct) as f:
        for piece in pieces:
            assert f.write(piece) == len(piece)
        f.flush()
        f.finish()
        os.fsync(f.fileno())
        return f.direct


def _direct_supported(tmp_path) -> bool:
    fd, direct = open_for_write(str(tmp_path / "probe"))
    os.close(fd)
    return direct


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_one_write_and_many_small_writes(tmp_path, size: int) -> None:
    data = _payload(size)
    _write(tmp_path / "one", [data])
    pieces = [data[i:i + 7777] for i in range(0, size, 7777)]
    _write(tmp_path / "many", pieces)
    assert (tmp_path / "one").read_bytes() == data
    assert (tmp_path / "many").read_bytes() == data


def test_direct_is_used_where_the_filesystem_accepts_it(tmp_path) -> None:
    _require_direct(tmp_path)
    assert _write(tmp_path / "f", [_payload(CHUNK_BYTES + 5)]) is True


def _require_direct(tmp_path) -> None:
    if not _direct_resources.SUPPORTED or not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")


def _fault_on_write(monkeypatch, nth: int, fault, directory) -> None:
    """Make the ``nth`` ``os.write`` to a file under ``directory`` run ``fault(fd, data,
    real_write)``. ``os.write`` is patched process-wide (``_direct.os`` is ``os``): writes of
    other threads (a pool thread of an earlier test still finishing, multiprocessing's resource
    tracker, more likely on a loaded machine) go through unchanged and are not counted (see
    ``support/fd_faults.py``; before, the fault could hit another thread's write and the test
    failed under load)."""
    real_write = os.write
    calls = []

    def write(fd, data):
        if not fd_under(fd, directory):
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == nth:
            return fault(fd, data, real_write)
        return real_write(fd, data)

    monkeypatch.setattr(_direct.os, "write", write)


def test_einval_on_the_first_direct_write_falls_back_to_buffered(tmp_path, monkeypatch) -> None:
    _require_direct(tmp_path)

    def refuse(fd, data, real_write):
        raise OSError(errno.EINVAL, "Invalid argument")

    _fault_on_write(monkeypatch, 1, refuse, tmp_path)
    data = _payload(2 * CHUNK_BYTES + 999)
    assert _write(tmp_path / "f", [data]) is False
    assert (tmp_path / "f").read_bytes() == data


def test_short_unaligned_direct_write_continues_buffered(tmp_path, monkeypatch) -> None:
    _require_direct(tmp_path)

    def short(fd, data, real_write):  # the second chunk: only part of it lands, unaligned
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        n = real_write(fd, bytes(memoryview(data)[:1000]))
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return n

    _fault_on_write(monkeypatch, 2, short, tmp_path)
    data = _payload(3 * CHUNK_BYTES + 77)
    _write(tmp_path / "f", [data])
    assert (tmp_path / "f").read_bytes() == data


def test_full_disk_raises_enospc(tmp_path, monkeypatch) -> None:
    real_write = os.write

    def full(fd, data):  # this test's files only (os.write is patched process-wide)
        if not fd_under(fd, tmp_path):
            return real_write(fd, data)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_direct.os, "write", full)
    with pytest.raises(OSError) as info:
        _write(tmp_path / "f", [_payload(CHUNK_BYTES + 1)])
    assert info.value.errno == errno.ENOSPC


def test_two_files_open_at_once_in_one_thread(tmp_path) -> None:
    a, b = _payload(CHUNK_BYTES + 10), _payload(5000)[::-1]
    fda, da = open_for_write(str(tmp_path / "a"))
    fdb, db = open_for_write(str(tmp_path / "b"))
    with DirectFile(fda, da) as fa, DirectFile(fdb, db) as fb:
        for i in range(0, len(a), 4000):
            fa.write(a[i:i + 4000])
            if i < len(b):
                fb.write(b[i:i + 4000])
        fa.finish()
        fb.finish()
    assert (tmp_path / "a").read_bytes() == a
    assert (tmp_path / "b").read_bytes() == b


def test_direct_io_off_writes_through_the_page_cache(tmp_path) -> None:
    fd, direct = open_for_write(str(tmp_path / "f"), direct=False)
    assert direct is False
    with DirectFile(fd, direct) as f:
        f.write(b"abc")
        f.finish()
    assert (tmp_path / "f").read_bytes() == b"abc"


def test_a_filesystem_refusing_o_direct_gets_buffered_writes(tmp_path, monkeypatch) -> None:
    """Where setting O_DIRECT fails with EINVAL (ramfs, old tmpfs), the file is still created
    once and written through the page cache (an open(2) with O_DIRECT would have failed after
    creating the file, and an O_EXCL retry with EEXIST)."""
    real_fcntl = fcntl.fcntl

    def refusing_fcntl(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refusing_fcntl)
    data = _payload(CHUNK_BYTES + 3)
    assert _write(tmp_path / "f", [data]) is False
    assert (tmp_path / "f").read_bytes() == data


def test_writes_after_close_raise_value_error(tmp_path) -> None:
    fd, direct = open_for_write(str(tmp_path / "f"))
    f = DirectFile(fd, direct)
    f.close()
    f.close()  # idempotent
    with pytest.raises(ValueError, match="closed file"):
        f.write(b"x")


def test_buffers_are_reused_across_threads(tmp_path) -> None:
    import threading

    seen = []

    def save(i: int) -> None:
        fd, direct = open_for_write(str(tmp_path / f"f{i}"))
        with DirectFile(fd, direct) as f:
            seen.append(id(f._buf))
            f.write(_payload(100))
            f.finish()

    for i in range(3):  # a thread per snapshot, as ThreadWriter
        t = threading.Thread(target=save, args=(i,))
        t.start()
        t.join()
    assert len(set(seen)) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_share_the_buffers(tmp_path) -> None:
    code = f"""
import os, sys
from snapkeep._core.storage._direct import DirectFile
from snapkeep._core.storage._direct_resources import open_for_write
def write(name, byte):
    fd, direct = open_for_write(os.path.join({str(tmp_path)!r}, name))
    with DirectFile(fd, direct) as f:
        f.write(bytes([byte]) * 5000)
        f.finish()
write("parent0", 1)  # the parent's buffer is now pooled
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    fd, direct = open_for_write(os.path.join({str(tmp_path)!r}, "child"))
    f = DirectFile(fd, direct)
    f.write(bytes([2]) * 5000)  # gathered, not yet written
    os.write(w, b"x")
    import time; time.sleep(0.5)
    f.finish(); f.close()
    os._exit(0)
os.read(r, 1)
write("parent1", 3)  # meanwhile the parent gathers into its own buffer
os.waitpid(pid, 0)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (tmp_path / "child").read_bytes() == bytes([2]) * 5000
    assert (tmp_path / "parent1").read_bytes() == bytes([3]) * 5000


def test_a_fault_hits_this_tests_file_while_another_thread_writes(tmp_path, monkeypatch) -> None:
    """The faults above must not depend on a quiet process: with another thread calling
    ``os.write`` all along (as a lingering pool thread or multiprocessing's resource tracker
    does, more often on a loaded machine), the EINVAL still hits the first direct write of this
    test's file and the file falls back to buffered writes. (Before: the fault counted every
    ``os.write`` of the process: it hit the other thread's write in 20 of 20 tries.)"""
    import threading

    stop = threading.Event()
    r, w = os.pipe()

    def noise() -> None:
        while not stop.is_set():
            os.write(w, b"x")
            os.read(r, 1)

    thread = threading.Thread(target=noise, daemon=True)
    thread.start()
    try:
        for i in range(5):
            with monkeypatch.context() as patch:
                directory = tmp_path / str(i)
                directory.mkdir()
                test_einval_on_the_first_direct_write_falls_back_to_buffered(directory, patch)
    finally:
        stop.set()
        thread.join(timeout=60)
        os.close(r)
        os.close(w)
