"""Sharded loads read each whole saved chunk straight into its target (issue 34: load no slower
than DCP's): bit for bit for every dtype and shape, into the target's own memory; every other
item (a transposed tensor, a non-contiguous or differently typed target, ``bytes``, a blob of
the other byte order) goes through DCP's own path and is as exact; a shard file cut short is
refused as corrupt, never loaded half. Single process (DCP without a process group); the
multi-rank loads run in ``test_sharded.py`` and ``test_sharded_overlap.py``."""

from __future__ import annotations

import io
import os
import types
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from snapkeep._core.distributed import dcp_safe
from snapkeep._core.distributed.dcp_safe import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    _read_into,
    _Slice,
    dcp_errors,
)
from snapkeep._core.distributed.sharded import ShardedJob, ShardedSaver, load_sharded
from snapkeep._core.distributed.sharded_store import ShardedStore
from snapkeep._core.errors import SnapshotCorruptError
from snapkeep._core.storage import resolve_storage


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"models": {"main": {
        "w": torch.randn(256, 512, generator=g),  # 512 KiB
        "half": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-1 << 40, 1 << 40, (1000,), generator=g),
        "mask": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(40, 30, generator=g).t(),  # saved with its strides
    }}, "objects": {"note": b"\x00bytes\xff"}}


def _zeros_like(state: dict) -> dict:
    return {k: _zeros_like(v) if isinstance(v, dict) else
            torch.zeros_like(v) if isinstance(v, torch.Tensor) else b"" for k, v in state.items()}


def _saved(tmp_path, state: dict) -> tuple[ShardedStore, object]:
    storage, directory = resolve_storage(str(tmp_path / "out"))
    store = ShardedStore(storage, directory, "snap_{step}")
    saver = ShardedSaver(store, None)
    try:
        saver.save(state, ShardedJob(name="snap_1", step=1)).committed.result(timeout=120)
    finally:
        saver.close()
    return store, store.entries()[-1]


def _counting_direct_reads(monkeypatch) -> list[bool]:
    outcomes: list[bool] = []
    read_into = dcp_safe._read_into

    def counting(*args):
        outcomes.append(read_into(*args))
        return outcomes[-1]

    monkeypatch.setattr(dcp_safe, "_read_into", counting)
    return outcomes


def _assert_equal(loaded: dict, state: dict) -> None:
    for key, value in state.items():
        if isinstance(value, dict):
            _assert_equal(loaded[key], value)
        elif isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def test_whole_chunks_land_straight_in_their_targets_bit_for_bit(tmp_path, monkeypatch):
    state = _state()
    store, entry = _saved(tmp_path, state)
    outcomes = _counting_direct_reads(monkeypatch)
    opened: list[tuple[str, bool]] = []
    open_read = store.storage.open_read

    def recording(path: str, *, whole: bool = False):
        opened.append((os.path.basename(path), whole))
        return open_read(path, whole=whole)

    monkeypatch.setattr(store.storage, "open_read", recording)
    target = _zeros_like(state)
    target["models"]["main"]["transposed"] = torch.zeros(40, 30).t()  # non-contiguous target
    addresses = {k: t.data_ptr() for k, t in target["models"]["main"].items()}
    load_sharded(store, entry, target, groups=None)
    _assert_equal(target, state)
    assert {k: t.data_ptr() for k, t in target["models"]["main"].items()} == addresses
    # w, half, ids, scalar read straight (DCP plans no read of an empty tensor); the transposed
    # target and the bool mask (DCP's copy_ normalizes its bytes) go through DCP
    assert outcomes == [True] * 4
    # this rank's data file was read ahead (fadvise WILLNEED) before DCP's planning
    assert ("__0_0.distcp", True) in opened


def _stock(path: str, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, one process assumed
        dcp.save(state, checkpoint_id=path)


def _read_stock(path: str, target: dict) -> None:
    with dcp_errors(path), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=SafeFileSystemReader(path),
                 planner=SafeLoadPlanner(True), no_dist=True)


def test_what_cannot_land_whole_goes_through_dcp_and_is_as_exact(tmp_path, monkeypatch):
    state = _state()["models"]["main"]
    path = str(tmp_path / "stock")
    _stock(path, state)  # DCP keeps the transposed tensor's strides (snapkeep stages it whole)
    outcomes = _counting_direct_reads(monkeypatch)
    target = _zeros_like(state)
    target["w"] = torch.zeros(512, 256).t()  # the saved layout is contiguous, the target's not
    target["ids"] = torch.zeros(1000, dtype=torch.int32)  # another dtype: DCP's copy_ casts
    target["transposed"] = torch.zeros(30, 40)  # contiguous, the saved one is not
    _read_stock(path, target)
    assert torch.equal(target["w"], state["w"])
    assert torch.equal(target["ids"], state["ids"].to(torch.int32))
    assert torch.equal(target["transposed"], state["transposed"])
    assert torch.equal(target["half"], state["half"]) and torch.equal(target["mask"], state["mask"])
    # half, scalar straight; ids (dtype) and transposed (saved strides) refused by the layout
    # check; w's target (non-contiguous) and mask (bool) are not even tried
    assert outcomes.count(False) == 2 and outcomes.count(True) == 2


def test_a_blob_of_the_other_byte_order_is_left_to_dcp(tmp_path, monkeypatch):
    state = _state()
    store, entry = _saved(tmp_path, state)
    outcomes = _counting_direct_reads(monkeypatch)
    other = "big" if os.sys.byteorder == "little" else "little"
    monkeypatch.setattr(dcp_safe, "sys", types.SimpleNamespace(byteorder=other))
    target = _zeros_like(state)
    target["models"]["main"]["transposed"] = torch.zeros(40, 30).t()
    load_sharded(store, entry, target, groups=None)
    _assert_equal(target, state)  # DCP's own path read every chunk (and would swap)
    assert outcomes == [False] * 4


def test_a_stock_dcp_shard_cut_short_is_refused_as_corrupt(tmp_path):
    path = str(tmp_path / "stock")
    state = {"w": torch.randn(256, 512), "b": torch.randn(7)}
    _stock(path, state)
    [shard] = [n for n in os.listdir(path) if n.endswith(".distcp")]
    with open(os.path.join(path, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, shard)) // 2)
    with pytest.raises(SnapshotCorruptError, match="could not read it"):
        _read_stock(path, {k: torch.zeros_like(v) for k, v in state.items()})


def _rewritten(blob: bytes, data: bytes | None = None, *, deflate: bool = False) -> bytes:
    """``blob`` (a ``torch.save`` archive) with its storage record's bytes replaced by
    ``data`` and/or stored deflated, every other record kept."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, zipfile.ZipFile(out, "w") as dst:
        for record in src.infolist():
            content = src.read(record)
            if record.filename.endswith("/data/0"):
                content = content if data is None else data
                dst.writestr(record.filename, content,
                             zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
            else:
                dst.writestr(record.filename, content)
    return out.getvalue()


@pytest.mark.parametrize("case", ["stored", "deflated", "record-short", "record-long"])
def test_a_chunk_is_read_straight_only_from_an_uncompressed_record_of_its_exact_size(
        tmp_path, case):
    """A hostile or foreign archive whose storage record is compressed or of another size than
    its pickle claims is never read straight (its bytes would be the zip's own or compressed
    ones): DCP's path reads (deflated: exactly) or refuses it (a short record)."""
    value = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    saved = io.BytesIO()
    torch.save(value, saved)
    raw = value.numpy().tobytes()
    blob = {"stored": _rewritten(saved.getvalue()),
            "deflated": _rewritten(saved.getvalue(), deflate=True),
            "record-short": _rewritten(saved.getvalue(), raw[:40]),
            "record-long": _rewritten(saved.getvalue(), raw + b"\x00" * 8)}[case]
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 13 + blob + b"y" * 7)  # a chunk inside a larger file, as DCP's
    target = torch.full((4, 5), -1.0)
    info = types.SimpleNamespace(offset=13, length=len(blob))
    with open(path, "rb") as stream:
        read = _read_into(stream, _Slice(stream, 13, len(blob)), info, target, path)
    assert read == (case == "stored")
    if read:
        assert torch.equal(target, value)
    else:
        assert torch.equal(target, torch.full((4, 5), -1.0))  # nothing was read
