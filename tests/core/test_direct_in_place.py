"""Direct writes from the caller's memory (``DirectFile`` in place): a large write at an aligned
file offset from an aligned address goes to the disk with no copy, hashed piece by piece on the
way; everything else is gathered as before. Same bytes and checksum either way, the caller's
memory is free again when ``write`` returns, and the staging buffers and ``torch_save`` records
line up so a staged snapshot is written in place."""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import re
from typing import Any

import pytest
import torch

from snapkeep import writing
from snapkeep._core.format import codec
from snapkeep._core.format.checksum import digest_file
from snapkeep._core.save.host_memory import PAGE_ALIGNED_FROM_BYTES, HeapAllocator, _host_buffer
from snapkeep._core.save.shm import SharedArena
from snapkeep._core.save.staging import BufferSet
from snapkeep._core.storage import _direct, new_hasher
from snapkeep._core.storage._direct import ALIGN_BYTES, IN_PLACE_MIN_BYTES, DirectFile
from snapkeep._core.storage._direct_resources import CHUNK_BYTES, open_for_write
from support.fd_faults import fd_under

PAGE = 4096


def _aligned(nbytes: int, seed: int = 0) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` random bytes at a page-aligned address."""
    t = torch.empty(0, dtype=torch.uint8).set_(_host_buffer(nbytes))
    assert t.data_ptr() % PAGE == 0
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return t


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def _write(path: Any, pieces: list[Any], streams: int = _direct.WRITE_STREAMS
           ) -> tuple[DirectFile, str]:
    fd, direct = open_for_write(str(path))
    hasher = new_hasher()
    with DirectFile(fd, direct, streams=streams, hasher=hasher) as f:
        for piece in pieces:
            assert f.write(piece) == len(memoryview(piece).cast("B"))
        f.finish()
        os.fsync(f.fileno())
    return f, str(hasher.hexdigest())


def _require_direct(tmp_path: Any) -> None:
    fd, direct = open_for_write(str(tmp_path / "probe"))
    os.close(fd)
    os.unlink(tmp_path / "probe")
    if not direct:
        pytest.skip("this filesystem refuses O_DIRECT")


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("size", [IN_PLACE_MIN_BYTES, 3 * CHUNK_BYTES + 3 * ALIGN_BYTES + 77])
def test_an_aligned_large_write_goes_in_place_with_the_same_bytes_and_checksum(
        tmp_path: Any, streams: int, size: int) -> None:
    _require_direct(tmp_path)
    head = bytes(range(256)) * 16  # 4096 bytes gathered first: the big write starts aligned
    src = _aligned(size)
    f, digest = _write(tmp_path / "f", [head, _mv(src), b"tail"], streams)
    expected = head + src.numpy().tobytes() + b"tail"
    assert (tmp_path / "f").read_bytes() == expected
    assert f.direct
    assert f.in_place_bytes == size // ALIGN_BYTES * ALIGN_BYTES
    assert digest == digest_file(tmp_path / "f")[0]
    assert f.size_bytes == len(expected)


@pytest.mark.parametrize("case", ["address", "offset", "small"])
def test_unaligned_or_small_writes_are_gathered(tmp_path: Any, case: str) -> None:
    _require_direct(tmp_path)
    src = _aligned(2 * CHUNK_BYTES + PAGE)
    if case == "address":
        pieces: list[Any] = [_mv(src)[1:]]
    elif case == "offset":
        pieces = [b"x" * 100, _mv(src)]
    else:
        pieces = [_mv(src)[:IN_PLACE_MIN_BYTES - PAGE]]
    f, digest = _write(tmp_path / "f", pieces)
    assert f.in_place_bytes == 0
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(p) for p in pieces)
    assert digest == digest_file(tmp_path / "f")[0]


def test_the_callers_memory_is_free_when_write_returns(tmp_path: Any) -> None:
    """``write`` must not return while the disk may still read the caller's memory."""
    _require_direct(tmp_path)
    src = _aligned(4 * CHUNK_BYTES)
    before = src.numpy().tobytes()
    fd, direct = open_for_write(str(tmp_path / "f"))
    with DirectFile(fd, direct, streams=4) as f:
        f.write(_mv(src))
        src.fill_(0)  # the caller reuses its buffer at once (the next snapshot's staging)
        f.finish()
    assert f.in_place_bytes == len(before)
    assert (tmp_path / "f").read_bytes() == before


def test_einval_on_the_first_in_place_write_continues_buffered(tmp_path: Any,
                                                               monkeypatch: Any) -> None:
    """A filesystem that accepts the flag but refuses direct writes (some FUSE mounts)."""
    _require_direct(tmp_path)
    real = os.pwrite
    refused = []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if fd_under(fd, tmp_path) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data, offset)

    monkeypatch.setattr(_direct.os, "pwrite", pwrite)
    src = _aligned(3 * CHUNK_BYTES)
    f, digest = _write(tmp_path / "f", [_mv(src)])
    assert refused == [0]
    assert not f.direct
    assert (tmp_path / "f").read_bytes() == src.numpy().tobytes()
    assert digest == digest_file(tmp_path / "f")[0]


def test_a_full_disk_during_an_in_place_write_raises_enospc(tmp_path: Any,
                                                          monkeypatch: Any) -> None:
    _require_direct(tmp_path)
    real = os.pwrite
    calls = []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if not fd_under(fd, tmp_path):  # another thread's write (patched process-wide)
            return real(fd, data, offset)
        calls.append(offset)
        if offset >= 2 * CHUNK_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(_direct.os, "pwrite", pwrite)
    with pytest.raises(OSError) as info:
        _write(tmp_path / "f", [_mv(_aligned(4 * CHUNK_BYTES))], streams=2)
    assert info.value.errno == errno.ENOSPC
    assert 2 * CHUNK_BYTES in calls


def test_staging_buffers_of_large_storages_are_page_aligned() -> None:
    state = {"big": torch.randn(PAGE_ALIGNED_FROM_BYTES // 4 + 3), "small": torch.randn(10),
             "big2": torch.randn(PAGE_ALIGNED_FROM_BYTES // 2)}
    for allocator in (HeapAllocator(), SharedArena()):
        buffers = BufferSet(allocator)
        try:
            staged, _ = buffers.stage(state)
            assert staged["big"].data_ptr() % PAGE == 0
            assert staged["big2"].data_ptr() % PAGE == 0
            assert all(torch.equal(staged[k], state[k]) for k in state)
            del staged
        finally:
            if isinstance(allocator, SharedArena):
                allocator.close()


@pytest.mark.parametrize("base, tensors, expected", [
    (64, [1 << 20] * 4, PAGE),  # large tensors: page-aligned records
    (64, [4096] * 40, 64),  # small tensors: 4 KiB of padding each would be too much
    (128, [1 << 20] * 4, PAGE),
    (100, [1 << 20] * 4, 100),  # a user's alignment that does not divide a page is kept
    (8192, [1 << 20] * 4, 8192),
])
def test_record_alignment(base: int, tensors: list[int], expected: int) -> None:
    state = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(tensors)}
    assert codec.record_alignment(state, base) == expected


@pytest.mark.parametrize("odd", ["sparse_coo", "sparse_csr", "nested"])
def test_torch_save_still_saves_tensors_without_one_storage(odd: str) -> None:
    """Sparse and nested tensors (which ``SimpleWriter`` saves unstaged) do not break the
    alignment choice: it counts dense storages only."""
    dense = torch.randn(4, 5)
    t = {"sparse_coo": dense.to_sparse(), "sparse_csr": dense.to_sparse_csr(),
         "nested": torch.nested.as_nested_tensor([dense, dense[:2]])}[odd]
    state = {"odd": t, "w": torch.randn(1 << 20)}
    assert codec.record_alignment(state, 64) == PAGE
    buf = io.BytesIO()
    codec.torch_save(state, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert torch.equal(loaded["w"], state["w"])
    got = loaded["odd"]
    assert torch.equal(got.to_dense() if odd != "nested" else got.to_padded_tensor(0.0),
                       t.to_dense() if odd != "nested" else t.to_padded_tensor(0.0))


def test_torch_save_aligns_large_records_to_a_page_and_loads_back(tmp_path: Any) -> None:
    state = {"w": torch.randn(1 << 20), "b": torch.randn(7), "ema": torch.randn(1 << 20)}
    buf = io.BytesIO()
    codec.torch_save(state, buf)
    reader = torch._C.PyTorchFileReader(io.BytesIO(buf.getvalue()))
    offsets = [reader.get_record_offset(name) for name in reader.get_all_records()
               if name.startswith("data/")]
    assert len(offsets) == 3 and all(o % PAGE == 0 for o in offsets)
    (tmp_path / "s.pt").write_bytes(buf.getvalue())
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "s.pt", weights_only=True, mmap=mmap)
        assert all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize("writer_cls", [writing.ThreadWriter, writing.ThreadQueueWriter])
def test_a_staged_snapshot_is_written_in_place(tmp_path: Any, caplog: Any,
                                               writer_cls: type[writing.Writer]) -> None:
    """End to end in this process: staging buffers, ``torch_save``'s records and the direct
    commit line up, so the tensor bytes go to disk from the staging buffers."""
    _require_direct(tmp_path)
    state = {"w": torch.randn(1 << 20), "m": torch.randn(1 << 20), "step": 3}
    writer = writer_cls()
    with caplog.at_level(logging.DEBUG, logger="snapkeep._core.storage._commit"):
        writer("snap", str(tmp_path), state)
        writer.finalize()
    lines = [r.getMessage() for r in caplog.records
             if "in place" in r.getMessage() and ".json" not in r.getMessage()]  # not the manifest
    assert len(lines) == 1
    match = re.search(r"(\d+) bytes written \(O_DIRECT\), (\d+) of them in place", lines[0])
    assert match, lines[0]
    written, in_place = int(match[1]), int(match[2])
    assert in_place >= 2 * (4 << 20) - 2 * PAGE and in_place <= written
    loaded = torch.load(tmp_path / "snap", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["m"], state["m"])


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("1", True),
                                             ("", True), ("maybe", True)])
def test_the_environment_switch(monkeypatch: Any, caplog: Any, value: str,
                                expected: bool) -> None:
    monkeypatch.setenv(_direct.IN_PLACE_ENV, value)
    with caplog.at_level(logging.WARNING, logger=_direct.__name__):
        assert _direct._in_place_from_env() is expected
    assert ("is not one of" in caplog.text) is (value == "maybe")


def test_in_place_off_copies_every_byte(tmp_path: Any, monkeypatch: Any) -> None:
    _require_direct(tmp_path)
    monkeypatch.setattr(_direct, "IN_PLACE", False)
    src = _aligned(2 * CHUNK_BYTES)
    f, digest = _write(tmp_path / "f", [_mv(src)])
    assert f.in_place_bytes == 0 and f.direct
    assert (tmp_path / "f").read_bytes() == src.numpy().tobytes()
    assert digest == digest_file(tmp_path / "f")[0]
