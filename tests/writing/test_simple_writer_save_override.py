"""ppe's ``SimpleWriter.__call__`` is its ``save()``: a writer whose ``save`` is replaced (a
subclass, or an attribute on the instance, as ppe's own writer tests do) has that ``save``
called for each snapshot, with ppe's arguments, and snapkeep writes nothing itself."""

from __future__ import annotations

import os

import torch

from snapkeep import writing


def test_subclass_save_is_called_with_ppes_arguments(tmp_path):
    calls = []

    class Recording(writing.SimpleWriter):
        def save(self, filename, out_dir, target, savefun, append, **kwds):
            calls.append((filename, out_dir, target, savefun, append, kwds))

    def savefun(obj, f):
        torch.save(obj, f)

    writer = Recording(savefun, compress=True)
    state = {"x": 1}
    assert writer("snap", str(tmp_path), state) is None
    writer.finalize()
    assert calls == [("snap", str(tmp_path), state, savefun, False, {"compress": True})]
    assert "snap" not in os.listdir(tmp_path)


def test_instance_save_replacement_is_called(tmp_path):
    calls = []
    writer = writing.SimpleWriter()
    writer.save = lambda *args, **kwargs: calls.append(args)  # type: ignore[method-assign]
    writer("snap", str(tmp_path), {"x": 1}, append=True)
    writer.finalize()
    assert calls == [("snap", str(tmp_path), {"x": 1}, torch.save, True)]
    assert os.listdir(tmp_path) == []


def test_plain_simple_writer_still_commits_and_returns_a_handle(tmp_path):
    writer = writing.SimpleWriter()
    handle = writer("snap", str(tmp_path), {"x": torch.ones(2)})
    writer.finalize()
    assert handle is not None and handle.committed.done()
    assert torch.equal(torch.load(tmp_path / "snap")["x"], torch.ones(2))
