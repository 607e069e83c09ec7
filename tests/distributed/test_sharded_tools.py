"""The tools see sharded (DCP) snapshot directories: ``snapkeep ls`` and ``verify`` list and
check them against their markers, ``snapkeep.load_latest`` gathers the newest valid one into one
state dict (one process, no process group: plain DCP files with the same commit protocol)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import snapkeep
from snapkeep import writing
from snapkeep.cli import cli
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def _train(out_dir: str, iterations: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=100, out_dir=out_dir,
                                writer=writing.SimpleWriter(out_dir=out_dir))
    manager.extend(ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED), trigger=(1, "iteration"))
    manager.start_extensions()
    while manager.iteration < iterations:
        with manager.run_iteration(step_optimizers=["main"]):
            model(torch.ones(2, 4)).sum().backward()
    manager.finalize()
    return model


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def test_ls_and_verify_list_sharded_snapshots_and_catch_a_corrupt_shard(tmp_path):
    _train(str(tmp_path), 2)
    runner = CliRunner()
    listed = runner.invoke(cli, ["ls", str(tmp_path), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)["snapshots"]
    assert [(r["name"], r["step"], r["status"]) for r in rows] == [
        ("snapshot_iter_1", 1, "ok"), ("snapshot_iter_2", 2, "ok")]
    assert all(r["size_bytes"] > 0 for r in rows)
    assert runner.invoke(cli, ["verify", str(tmp_path)]).exit_code == 0
    _corrupt(tmp_path / "snapshot_iter_2" / "__0_0.distcp")
    checked = runner.invoke(cli, ["verify", str(tmp_path), "--json"])
    assert checked.exit_code == 1
    report = json.loads(checked.output)
    assert [s["status"] for s in report["snapshots"]] == ["ok", "corrupt"]
    assert report["newest_loadable"] == "snapshot_iter_1"


def test_load_latest_gathers_the_newest_valid_sharded_snapshot(tmp_path):
    model = _train(str(tmp_path), 2)
    state = snapkeep.load_latest(tmp_path)
    assert torch.equal(state["models"]["main"]["weight"], model.weight.detach())
    _corrupt(tmp_path / "snapshot_iter_2" / "__0_0.distcp")
    with pytest.warns(RuntimeWarning, match="skipping sharded snapshot snapshot_iter_2"):
        older = snapkeep.load_latest(tmp_path)
    assert not torch.equal(older["models"]["main"]["weight"], model.weight.detach())
    _corrupt(tmp_path / "snapshot_iter_1" / "__0_0.distcp")
    with pytest.warns(RuntimeWarning), pytest.raises(snapkeep.NoValidSnapshotError,
                                                     match="none valid"):
        snapkeep.load_latest(tmp_path)
