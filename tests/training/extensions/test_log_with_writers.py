"""LogReport writes its files through every snapkeep writer (the manager's), beside the
snapshots: rewritten JSON and appended YAML, each committed with a manifest (JSON only)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import snapkeep
from snapkeep.training import ExtensionsManager, extensions

WRITERS = ["SimpleWriter", "ThreadWriter", "ProcessWriter", "ThreadQueueWriter",
           "ProcessQueueWriter"]


@pytest.mark.parametrize("writer_name", WRITERS)
def test_log_files_through_each_writer(tmp_path, writer_name):
    writer = getattr(snapkeep.writing, writer_name)(out_dir=str(tmp_path))
    model = torch.nn.Linear(1, 1)
    manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), 0.1), 2,
                                iters_per_epoch=3, writer=writer)
    manager.extend(extensions.LogReport(trigger=(1, "iteration")))
    manager.extend(extensions.LogReport(filename="log.yaml", append=True))
    manager.extend(extensions.snapshot(n_retains=1))
    while not manager.stop_trigger:
        with manager.run_iteration():
            snapkeep.report({"x": float(manager.iteration)})
    # the last iteration finalized the manager, hence the writer: everything is committed
    assert [e["x"] for e in json.loads((tmp_path / "log").read_text())] == [0, 1, 2, 3, 4, 5]
    appended = yaml.safe_load((tmp_path / "log.yaml").read_text())
    assert [(e["epoch"], e["x"]) for e in appended] == [(1, 1.0), (2, 4.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".snapkeep", "log", "log.yaml", "snapshot_iter_6"]
    assert sorted(p.name for p in (tmp_path / ".snapkeep").iterdir()
                  if p.suffix != ".lock") == [
        "log.json", "snapshot_iter_6.json"]  # appended files have no checksum manifest
