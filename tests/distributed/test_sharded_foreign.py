"""A torch.distributed.checkpoint directory snapkeep did not write, named like a snapshot (a run
checkpointed with DCP before snapkeep was added): never swept, retained or resumed from, and
named at every resume, never a silent fresh start (issue 32, adoption; 971f8e4 said only
"starting fresh")."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp

import snapkeep
from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def _stock_dcp(path: str) -> list[str]:
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, one process assumed
        dcp.save({"model": torch.nn.Linear(4, 2).state_dict()}, checkpoint_id=path)
    return sorted(os.listdir(path))


def test_the_checkpointer_names_a_stock_dcp_directory_and_never_deletes_it(tmp_path, capfd):
    stock = _stock_dcp(str(tmp_path / "ckpt_3"))
    model = torch.nn.Linear(4, 2)
    with snapkeep.Checkpointer(tmp_path, template="ckpt_{step}", sharded=True, keep=1) as ck:
        assert ck.load({"model": model}) is None
        err = capfd.readouterr().err
        assert "starting fresh" in err and "skipped ckpt_3 (step 3)" in err, err
        assert "torch.distributed.checkpoint directory snapkeep did not write" in err
        for step in (5, 6):
            ck.save(step, {"model": model})
    assert sorted(os.listdir(tmp_path / "ckpt_3")) == stock  # kept as it was
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt_")) == ["ckpt_3",
                                                                                  "ckpt_6"]
    with snapkeep.Checkpointer(tmp_path, template="ckpt_{step}", sharded=True) as ck:
        assert ck.load({"model": model}) == 6
        assert "skipped ckpt_3 (step 3)" in capfd.readouterr().err


def test_the_ppe_extension_names_it_too(tmp_path, capfd):
    out = str(tmp_path)
    _stock_dcp(os.path.join(out, "snapshot_iter_7"))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=3, out_dir=out,
                                writer=writing.SimpleWriter(out_dir=out))
    manager.extend(ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, autoload=True),
                   trigger=(1, "iteration"))
    manager.start_extensions()
    err = capfd.readouterr().err
    assert "skipped snapshot_iter_7 (step 7)" in err and "did not write" in err, err
    while not manager.stop_trigger:
        with manager.run_iteration(step_optimizers=["main"]):
            model(torch.ones(2, 4)).sum().backward()
    manager.finalize()
    assert os.path.exists(os.path.join(out, "snapshot_iter_7", ".metadata"))
