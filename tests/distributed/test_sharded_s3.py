"""SHARDED snapshots on S3 (moto's server): in one process, DCP's fsspec writer uploads the
files, the marker is one PUT written last, autoload verifies and loads them back; with 2 gloo
ranks (FSDP2), each rank uploads its shard and the job resumes resharded on 1 rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext
from support.ranks import reports, run
from support.storage_backends import s3_options, start_moto_server

WORKER = Path(__file__).with_name("sharded_worker.py")
TIMEOUT_S = 150

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
    assert files == [".metadata", ".snapkeep-commit.json", ".snapkeep-in-progress",
                     "__0_0.distcp"]

    manager2, model2, snapshot2 = _manager(1, options)
    assert not torch.equal(model2.weight, saved["weight"])
    manager2.start_extensions()
    assert snapshot2.loaded_entry.name == "snapshot_iter_3" and manager2.iteration == 3
    for key, value in model2.state_dict().items():
        assert torch.equal(value, saved[key]), key
    manager2.finalize()


def test_two_ranks_save_sharded_to_s3_and_one_rank_resumes_identically(s3, tmp_path):
    options, fs = s3
    url = "s3://sharded-bucket/two-ranks"
    env = {"SNAPKEEP_TEST_STORAGE_OPTIONS": json.dumps(options)}
    rep = tmp_path / "train"
    rep.mkdir()
    run(WORKER, 2, [str(tmp_path / "init_train"), url, str(rep), "train", "3"],
        timeout_s=TIMEOUT_S, env=env)
    assert [r.get("error") for r in reports(rep, "train", 2)] == [None, None]
    listed = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("sharded-bucket/two-ranks",
                                                       refresh=True))
    assert listed == ["snapshot_iter_2", "snapshot_iter_3"]  # n_retains=2
    files = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("sharded-bucket/two-ranks/snapshot_iter_3",
                                                       refresh=True))
    assert files == [".metadata", ".snapkeep-commit.json", ".snapkeep-in-progress",
                     "__0_0.distcp", "__1_0.distcp"]
    marker = json.loads(fs.cat_file("sharded-bucket/two-ranks/snapshot_iter_3/"
                                    ".snapkeep-commit.json"))
    assert marker["world_size"] == 2 and marker["step"] == 3
    assert {n: f["rank"] for n, f in marker["files"].items()} == {
        ".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1}

    saved = torch.load(rep / "params_rank0.pt", weights_only=True)[3]
    resumed_dir = tmp_path / "resume"
    resumed_dir.mkdir()
    run(WORKER, 1, [str(tmp_path / "init_resume"), url, str(resumed_dir), "resume"],
        timeout_s=TIMEOUT_S, env=env)
    (report,) = reports(resumed_dir, "resume", 1)
    assert report.get("error") is None, report
    assert (report["loaded"], report["iteration"]) == ("snapshot_iter_3", 3)
    resumed = torch.load(resumed_dir / "resumed_rank0.pt", weights_only=True)
    assert resumed["params"].keys() == saved["params"].keys()
    for key, value in saved["params"].items():
        assert torch.equal(resumed["params"][key], value), key
    for key, value in saved["exp_avg"].items():
        assert torch.equal(resumed["exp_avg"][key], value), key
