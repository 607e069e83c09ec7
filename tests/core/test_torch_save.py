"""snapkeep's default save: torch.save's bytes without the zip CRC-32 (issue 3: CPU per GiB)."""

from __future__ import annotations

import io
import os
import pickle
import zipfile

import pytest
import torch

from snapkeep import codecs, writing


def _state() -> dict[str, object]:
    weight = torch.randn(64, 32)
    return {"model": {"w": weight, "tied": weight, "view": weight[3:7]},
            "opt": {"step": 7, "lr": 0.1,
                    "bufs": [torch.arange(10), torch.ones(3, dtype=torch.half)]}}


def _torch_save_bytes(obj: object, crc: bool) -> bytes:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()
    finally:
        torch.serialization.set_crc32_options(before)


def test_bytes_equal_torch_save_without_crc() -> None:
    obj = _state()
    buf = io.BytesIO()
    codecs.torch_save(obj, buf)
    assert buf.getvalue() == _torch_save_bytes(obj, crc=False)
    assert buf.getvalue() != _torch_save_bytes(obj, crc=True)  # the CRC fields differ
    # the process-wide option is left as it was
    assert torch.serialization.get_crc32_options() is True


def test_loads_with_weights_only_and_keeps_sharing() -> None:
    obj = _state()
    buf = io.BytesIO()
    codecs.torch_save(obj, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert torch.equal(loaded["model"]["w"], obj["model"]["w"])  # type: ignore[index]
    assert loaded["model"]["tied"] is loaded["model"]["w"]
    assert loaded["model"]["view"].untyped_storage().data_ptr() == \
        loaded["model"]["w"].untyped_storage().data_ptr()
    assert loaded["opt"]["step"] == 7
    assert loaded["opt"]["bufs"][1].dtype == torch.half


def test_keyword_arguments_fall_back_to_torch_save() -> None:
    obj = {"x": torch.arange(5)}
    buf = io.BytesIO()
    codecs.torch_save(obj, buf, pickle_module=pickle)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()))["x"], obj["x"])
    zipfile.ZipFile(io.BytesIO(buf.getvalue())).testzip()  # torch.save's own CRCs: valid


@pytest.mark.parametrize("cls", [writing.SimpleWriter, writing.ThreadWriter,
                                 writing.ThreadQueueWriter])
@pytest.mark.parametrize("zip_crc32", [False, True])
def test_writers_default_and_zip_crc32(tmp_path, cls, zip_crc32: bool) -> None:
    w = cls(zip_crc32=zip_crc32)
    try:
        w("snap.pt", str(tmp_path), {"a": torch.randn(1000), "b": 3})
    finally:
        w.finalize()
    path = os.path.join(tmp_path, "snap.pt")
    assert torch.load(path, weights_only=True)["b"] == 3
    bad = zipfile.ZipFile(path).testzip()  # name of the first record whose CRC does not match
    assert (bad is None) is zip_crc32


def test_custom_savefun_is_untouched(tmp_path) -> None:
    calls = []

    def savefun(obj, f):
        calls.append(obj)
        torch.save(obj, f)

    w = writing.SimpleWriter(savefun=savefun)
    w("snap.pt", str(tmp_path), {"a": 1})
    assert calls == [{"a": 1}]
    assert zipfile.ZipFile(os.path.join(tmp_path, "snap.pt")).testzip() is None


def test_zip_crc32_must_be_bool() -> None:
    with pytest.raises(TypeError, match="zip_crc32 must be True or False"):
        writing.ThreadWriter(zip_crc32="yes")  # type: ignore[arg-type]


def test_an_unpicklable_object_fails_cleanly_and_the_process_lives_on(tmp_path) -> None:
    """A save that fails inside torch's writer must not leave it unfinished: its destructor
    would finish the file later (on a closed file) and abort the process."""
    import subprocess
    import sys

    code = f"""
import gc, torch
from snapkeep import writing
w = writing.ThreadWriter()
w("bad", {str(tmp_path)!r}, {{"f": lambda: 1}})
try:
    w.finalize()
except Exception as e:
    print("raised", type(e).__name__)
gc.collect()
w2 = writing.SimpleWriter()
w2("good", {str(tmp_path)!r}, {{"x": torch.arange(3)}})
print("alive")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised SnapshotSaveError" in done.stdout and "alive" in done.stdout
    assert torch.equal(torch.load(os.path.join(tmp_path, "good"))["x"], torch.arange(3))
