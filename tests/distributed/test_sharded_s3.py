"""SHARDED snapshots on S3 (moto's server) in one process: DCP's fsspec writer uploads the
files, the marker is one PUT written last, autoload verifies and loads them back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))
from storage_backends import s3_options, start_moto_server  # noqa: E402

pytestmark = [pytest.mark.s3, pytest.mark.slow]
pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3():
    server = start_moto_server()
    try:
        import s3fs

        options = s3_options(server.endpoint)
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("sharded-bucket")
        yield options, fs
    finally:
        server.stop()


def _manager(seed: int, options: dict) -> tuple[ExtensionsManager, torch.nn.Module, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    url = "s3://sharded-bucket/run"
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=10, out_dir=url,
                                writer=writing.SimpleWriter(out_dir=url, storage_options=options))
    snapshot = ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, n_retains=2, autoload=True)
    manager.extend(snapshot, trigger=(1, "iteration"))
    return manager, model, snapshot


def test_sharded_snapshots_round_trip_through_s3(s3):
    options, fs = s3
    manager, model, _ = _manager(0, options)
    for _ in range(3):
        with manager.run_iteration(step_optimizers=["main"]):
            model(torch.ones(2, 4)).sum().backward()
    manager.finalize()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    listed = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("sharded-bucket/run", refresh=True))
    assert listed == ["snapshot_iter_2", "snapshot_iter_3"]  # n_retains=2: whole directories
    files = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("sharded-bucket/run/snapshot_iter_3",
                                                       refresh=True))
    assert files == [".metadata", ".snapkeep-commit.json", "__0_0.distcp"]

    manager2, model2, snapshot2 = _manager(1, options)
    assert not torch.equal(model2.weight, saved["weight"])
    manager2.start_extensions()
    assert snapshot2.loaded_entry.name == "snapshot_iter_3" and manager2.iteration == 3
    for key, value in model2.state_dict().items():
        assert torch.equal(value, saved[key]), key
    manager2.finalize()
