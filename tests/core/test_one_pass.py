"""The one-pass verified load (:mod:`snapkeep._core.load.one_pass`): the file is mapped
(``torch.load(mmap=True)``) and hashed once through the pages its tensors view; the result
equals the separate verify-then-``torch.load`` path bit for bit, and a corrupt or truncated
file yields nothing of itself (autoload falls back to the older snapshot with the trainer's
tensors untouched)."""

from __future__ import annotations

import gc
import os
import sys
import zipfile

import pytest
import torch

from snapkeep._core.errors import SnapshotCorruptError
from snapkeep._core.format.checksum import ALGORITHM, digest_file
from snapkeep._core.load.loading import load_file
from snapkeep._core.load.one_pass import load_verified
from snapkeep._core.storage import resolve_storage
from snapkeep.training import ExtensionsManager, extensions
from snapkeep.writing import SimpleWriter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/maps")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          torch.float8_e4m3fn]


def _tree() -> dict:
    gen = torch.Generator().manual_seed(0)
    tensors = {str(d): (torch.randn(33, 17, generator=gen) * 10).to(d) for d in DTYPES}
    base = torch.randn(64, 8, generator=gen)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 8, generator=gen)).sum().backward()
    optimizer.step()
    return {
        "dtypes": tensors,
        "shared": {"base": base, "view": base[3:9], "t": base.t(), "row": base[5],
                   "strided": base[::2, 1::3]},
        "tied": [base, base],
        "param": torch.nn.Parameter(torch.randn(4, 4, generator=gen)),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(7.5),
        "optimizer": optimizer.state_dict(),
        "meta": {"step": 3, "name": "x", "t": (1, 2.5)},
    }


def _save(tmp_path, tree, name="snap") -> tuple[str, str, int]:
    path = str(tmp_path / name)
    torch.save(tree, path)
    digest, size = digest_file(path)
    return path, digest, size


def _load(path, digest, size, **kwargs):
    return load_verified(path, checksum=digest, size_bytes=size, algorithm=ALGORITHM, **kwargs)


def _assert_identical(a, b) -> None:
    """Same structure, and every tensor the same dtype, shape, stride, offset and bytes."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == \
            (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert a.requires_grad == b.requires_grad
        sa, sb = a.untyped_storage(), b.untyped_storage()
        assert sa.nbytes() == sb.nbytes()
        assert bytes(sa) == bytes(sb)  # bit-identical, NaN payloads and -0.0 included
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_identical(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_identical(x, y)
    else:
        assert a == b


def _mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


@linux_only
def test_bit_identical_to_the_separate_path_and_a_view_of_the_mapped_file(tmp_path):
    tree = _tree()
    path, digest, size = _save(tmp_path, tree)
    storage, _ = resolve_storage(str(tmp_path))
    reference = load_file(storage, path)
    one_pass = _load(path, digest, size)
    _assert_identical(one_pass, reference)
    _assert_identical(one_pass, tree)
    del reference
    assert path in _mapped_paths()  # the tensors view the hashed pages: nothing copied
    shared = one_pass["shared"]
    ptr = shared["base"].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == ptr for t in shared.values())
    assert one_pass["tied"][0] is one_pass["tied"][1]
    assert isinstance(one_pass["param"], torch.nn.Parameter)
    shared["base"][5, 0] = 1234.0  # views still share their storage after the load
    assert shared["row"][0] == 1234.0 and shared["t"][0, 5] == 1234.0
    with open(path, "rb") as f:  # copy-on-write: the file itself is never written
        assert torch.load(f, weights_only=True)["shared"]["base"][5, 0] != 1234.0
    del one_pass, shared
    gc.collect()
    assert path not in _mapped_paths()  # the mapping goes with the last tensor


def _read_chars() -> int:
    """Bytes this process has read through read() and its kin (``rchar`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@linux_only
def test_the_tensor_bytes_are_hashed_where_they_are_mapped_not_read_again(tmp_path):
    """One read of the file: its tensor records (here 8 MiB of 8 MiB + a few KiB) are hashed in
    the mapped pages the load uses, so read() sees only the small records around them."""
    tree = {f"w{i}": torch.randn(256, 1024) for i in range(8)}
    path, digest, size = _save(tmp_path, tree)
    before = _read_chars()
    loaded = _load(path, digest, size)
    read = _read_chars() - before
    assert list(loaded) == list(tree)
    assert all(torch.equal(loaded[k], tree[k]) for k in tree)
    assert read < size // 8, f"{read} of {size} bytes read through read()"


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _offsets(path: str) -> dict[str, int]:
    """Byte offsets in each part of a torch.save zip file."""
    with zipfile.ZipFile(path) as z:
        infos = sorted(z.infolist(), key=lambda r: r.header_offset)
        pkl = next(r for r in infos if r.filename.endswith("data.pkl"))
        data = [r for r in infos if "/data/" in r.filename and r.file_size > 64]
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(data[-1].header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return {
        "local header": data[0].header_offset + 2,
        "header padding": data[-1].header_offset + 30 + n + m - 1,
        "pickle": pkl.header_offset + 60,
        "tensor record": data[-1].header_offset + 30 + n + m + 5,
        "central directory": size - 60,
        "last byte": size - 1,
    }


@pytest.mark.parametrize("where", ["local header", "header padding", "pickle", "tensor record",
                                   "central directory", "last byte"])
def test_a_flipped_byte_anywhere_yields_nothing(tmp_path, where):
    path, digest, size = _save(tmp_path, _tree())
    _flip(path, _offsets(path)[where])
    try:
        result = _load(path, digest, size)
    except SnapshotCorruptError as e:
        assert "checksum" in str(e)
    else:  # the file no longer parses as this pass expects: the caller verifies separately
        assert result is None


def test_a_truncated_file_is_refused_before_it_is_read(tmp_path):
    path, digest, size = _save(tmp_path, _tree())
    os.truncate(path, size - 100)
    with pytest.raises(SnapshotCorruptError, match="truncated"):
        _load(path, digest, size)


def test_files_it_does_not_take_return_none(tmp_path):
    import snapkeep.codecs

    state = {"w": torch.arange(10.0)}
    path = str(tmp_path / "st")
    with open(path, "wb") as f:
        snapkeep.codecs.save_safetensors(state, f)
    assert _load(path, *digest_file(path)) is None
    legacy = str(tmp_path / "legacy")
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert _load(legacy, *digest_file(legacy)) is None
    modern, digest, size = _save(tmp_path, state, "modern")
    assert _load(modern, digest, size, map_location="meta") is None


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_weights_only_holds(tmp_path):
    marker = str(tmp_path / "MARKER")
    path, digest, size = _save(tmp_path, {"x": _RunsCode(marker), "w": torch.ones(2)})
    assert _load(path, digest, size) is None  # refused here; the separate path says why
    assert not os.path.exists(marker)


# -- through autoload -------------------------------------------------------------------------
def _manager(out, seed: int, *, autoload: bool):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    model[1].weight = torch.nn.Parameter(model[1].weight.to(torch.float64))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=4,
                                writer=SimpleWriter(out_dir=str(out)))
    manager.extend(extensions.snapshot(autoload=autoload), trigger=(2, "iteration"))
    return manager, model, optimizer


def _train(out) -> None:
    manager, model, _ = _manager(out, 0, autoload=False)
    while not manager.stop_trigger:
        with manager.run_iteration(step_optimizers=["main"]):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
    manager.finalize()


@pytest.mark.parametrize("where", [None, "pickle", "tensor record", "central directory",
                                   "last byte"])
def test_autoload_falls_back_past_a_corrupt_newest_and_applies_nothing_of_it(tmp_path, where,
                                                                              capfd):
    _train(tmp_path)
    newest, older = tmp_path / "snapshot_iter_4", tmp_path / "snapshot_iter_2"
    expected = torch.load(older if where else newest, weights_only=True)
    if where is not None:
        _flip(str(newest), _offsets(str(newest))[where])
    manager, model, optimizer = _manager(tmp_path, 1, autoload=True)
    capfd.readouterr()
    manager.start_extensions()
    skipped = [line for line in capfd.readouterr().err.splitlines()
               if line.startswith("snapkeep: skipped snapshot_iter_4 ")]  # the resume notice
    assert manager.iteration == (2 if where else 4)
    assert len(skipped) == (1 if where else 0)
    _assert_identical(model.state_dict(), expected["models"]["main"])
    _assert_identical(optimizer.state_dict(), expected["optimizers"]["main"])
    if sys.platform.startswith("linux"):  # the corrupt newest's mapping was dropped
        gc.collect()
        assert (str(newest) in _mapped_paths()) == (where is None)
    manager.finalize()


def test_autoload_of_a_truncated_newest_resumes_the_older(tmp_path, capfd):
    _train(tmp_path)
    newest = tmp_path / "snapshot_iter_4"
    os.truncate(newest, os.path.getsize(newest) // 2)
    manager, model, _ = _manager(tmp_path, 1, autoload=True)
    capfd.readouterr()
    manager.start_extensions()
    notice = capfd.readouterr().err
    assert "snapkeep: skipped snapshot_iter_4 (step 4)" in notice and "truncated" in notice
    assert manager.iteration == 2
    expected = torch.load(tmp_path / "snapshot_iter_2", weights_only=True)
    _assert_identical(model.state_dict(), expected["models"]["main"])
    manager.finalize()
