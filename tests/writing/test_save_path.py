"""One save path: ppe's synchronous ``Writer.save()`` goes through the saver (staging,
back-pressure, post-commit hooks) and is refused after ``finalize()``."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from snapkeep import writing
from support.writer_gates import EventGate


def test_save_after_finalize_is_refused_and_writes_nothing(tmp_path):
    writer = writing.SimpleWriter(out_dir=str(tmp_path))
    writer.save("a", str(tmp_path), {"x": torch.ones(2)}, torch.save, False)
    writer.finalize()
    with pytest.raises(RuntimeError, match="finalized"):
        writer.save("b", str(tmp_path), {"x": torch.ones(2)}, torch.save, False)
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "a"]


def test_save_waits_for_a_slot_like_a_call(tmp_path):
    """With one snapshot in flight and on_full='skip', save() is refused by the same
    back-pressure as __call__ (the old save() wrote past the limit, unstaged)."""
    gate = EventGate()
    writer = writing.ThreadWriter(gate.savefun, out_dir=str(tmp_path), on_full="skip")
    try:
        writer("first", str(tmp_path), {"x": torch.zeros(4)})
        gate.wait_entered()
        with pytest.raises(Exception, match="skipped"):
            writer.save("second", str(tmp_path), {"x": torch.ones(4)}, torch.save, False)
    finally:
        gate.open()
        writer.finalize()
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "first"]


def test_save_stages_the_state_and_runs_cleanup_hooks(tmp_path):
    """A background writer's save() writes the staged copy and calls ppe's cleanup hooks."""
    writer = writing.ThreadWriter(out_dir=str(tmp_path))
    calls = []
    writer._add_cleanup_hook(lambda: calls.append("hook"))
    state = {"x": torch.arange(4.0)}
    record = writer.save("s", str(tmp_path), state, torch.save, False)
    writer.finalize()
    assert calls == ["hook"] and record.size_bytes == os.path.getsize(tmp_path / "s")
    assert writer._saver.last_stage_stats is not None
    assert writer._saver.last_stage_stats.tensor_bytes == 16
    assert torch.equal(torch.load(tmp_path / "s", weights_only=True)["x"], torch.arange(4.0))


class _PpeStyleWriter(writing.StandardWriter):
    """A writer subclass written for ppe: its worker calls ``self.save`` (as ppe's own
    ThreadWriter does) and never takes the staged ticket."""

    def create_worker(self, filename, out_dir, target, *, savefun=None, append=False, **kwargs):
        return threading.Thread(target=self.save,
                                args=(filename, out_dir, target, savefun, append),
                                kwargs=kwargs, daemon=True)


def test_a_ppe_style_subclass_whose_worker_calls_save_never_deadlocks(tmp_path):
    """save() takes a slot like every save: the call's own unused ticket gives its slot back
    first, so max_pending=1 cannot block the worker behind it."""
    writer = _PpeStyleWriter(out_dir=str(tmp_path), timeout_s=30)
    for i in range(3):
        writer(f"snap_{i}", str(tmp_path), {"x": torch.full((4,), float(i))})
    writer.finalize()
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snap_0", "snap_1", "snap_2"]
    for i in range(3):
        saved = torch.load(tmp_path / f"snap_{i}", weights_only=True)["x"]
        assert torch.equal(saved, torch.full((4,), float(i)))
