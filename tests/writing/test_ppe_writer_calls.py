"""ppe's own writer tests call ``writer(os.path.join(tmpdir, 'myfile.dat'), '', target)``: an
absolute filename with an empty out_dir, which ppe writes there (``os.path.join('', name)``).
The seven calls of ppe's ``test_snapshot_writers.py``, on real files, plus the protection that
stays: with a directory, names never leave it (issue 17 item 6)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from snapkeep import writing

TARGET = {"w": torch.arange(4.0)}


def _saved(path: str) -> Any:
    return torch.load(path, weights_only=True)


def _call(writer: Any, path: str, target: Any) -> None:
    writer(path, "", target)


def _create_worker(writer: Any, path: str, target: Any) -> None:
    # ppe's test only checks the worker's type; started, it needs a savefun (None fails in the
    # save in ppe too)
    worker = writer.create_worker(path, "", target, savefun=torch.save, append=False)
    worker.start()
    worker.join()


CALLS: list[tuple[str, Callable[[], Any], Callable[[Any, str, Any], None]]] = [
    ("SimpleWriter", writing.SimpleWriter, _call),
    ("ThreadWriter", writing.ThreadWriter, _call),
    ("ThreadWriter.create_worker", writing.ThreadWriter, _create_worker),
    ("ProcessWriter", writing.ProcessWriter, _call),
    ("ProcessWriter.create_worker", writing.ProcessWriter, _create_worker),
    ("ThreadQueueWriter", writing.ThreadQueueWriter, _call),
    ("ProcessQueueWriter", writing.ProcessQueueWriter, _call),
]


@pytest.mark.parametrize(("make", "call"), [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])
def test_an_absolute_filename_with_an_empty_out_dir_is_written_there(tmp_path, make, call):
    run = tmp_path / "run"
    run.mkdir()
    writer = make()
    try:
        call(writer, os.path.join(str(run), "myfile.dat"), TARGET)
        call(writer, os.path.join(str(run), "myfile2.dat"), "test")  # ppe saves a str too
    finally:
        writer.finalize()
    assert sorted(os.listdir(run)) == [".snapkeep", "myfile.dat", "myfile2.dat"]
    assert sorted(os.listdir(run / ".snapkeep")) == ["myfile.dat.json", "myfile2.dat.json"]
    assert torch.equal(_saved(str(run / "myfile.dat"))["w"], TARGET["w"])
    assert _saved(str(run / "myfile2.dat")) == "test"
    assert sorted(os.listdir(tmp_path)) == ["run"]


@pytest.mark.parametrize("where", ["call", "writer"])
def test_with_a_directory_an_absolute_filename_is_still_refused(tmp_path, where):
    out, other = tmp_path / "out", tmp_path / "other"
    out.mkdir()
    other.mkdir()
    writer = writing.SimpleWriter(out_dir=str(out) if where == "writer" else "")
    try:
        with pytest.raises(ValueError, match="is an absolute path; accepted: a relative path"):
            writer(os.path.join(str(other), "myfile.dat"), str(out) if where == "call" else "",
                   TARGET)
    finally:
        writer.finalize()
    assert os.listdir(other) == []
    assert [n for n in os.listdir(out) if n != ".snapkeep"] == []


@pytest.mark.parametrize("name", ["../escaped", "sub/../../escaped", "myfile.dat/"])
def test_without_a_directory_a_relative_name_still_cannot_escape(tmp_path, monkeypatch, name):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    writer = writing.SimpleWriter()
    try:
        with pytest.raises(ValueError, match="accepted: a relative path"):
            writer(name, "", TARGET)
        with pytest.raises(ValueError, match="filename must be a non-empty str"):
            writer(str(cwd) + "/", "", TARGET)  # no file name after the directory
    finally:
        writer.finalize()
    assert sorted(os.listdir(tmp_path)) == ["cwd"]
    assert [n for n in os.listdir(cwd) if n != ".snapkeep"] == []
