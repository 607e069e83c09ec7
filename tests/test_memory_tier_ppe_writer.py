"""The memory tier under ppe's ``ExtensionsManager`` with ppe's default writer (no ``writer=``):
the snapshot extension writes with a snapkeep writer into ``manager.out``, and the tier's
recovery, which runs before that extension picked its writer, must list the same directory:
otherwise it sees no storage step and resumes an older RAM step than storage holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from snapkeep.training import extensions as ext

ppe = pytest.importorskip("pytorch_pfn_extras")

TEMPLATE = "snapshot_iter_{.iteration}"


def _run(out: Path, root: Path) -> tuple[Any, torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=12,
                                             out_dir=str(out))  # ppe's default writer
    snapshot = ext.snapshot(filename=TEMPLATE, autoload=True)
    manager.extend(snapshot, trigger=(3, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=5, replicas=0, root=str(root)))
    manager.extend(tier)
    return manager, model, tier, snapshot


def test_storage_newer_than_ram_is_resumed_from_under_ppe_default_writer(
        tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model, tier, snapshot = _run(out, root)
    while manager.iteration < 6:  # storage: steps 3 and 6; RAM: step 5
        with manager.run_iteration():
            model(torch.randn(2, 16)).sum().backward()
            manager.optimizers["main"].step()
    tier.wait()
    assert (out / "snapshot_iter_6").exists()
    snapshot.writer.finalize()  # the process "dies" here: the tier keeps step 5 in RAM

    resumed, _, tier2, snapshot2 = _run(out, root)
    resumed.start_extensions()
    assert resumed.iteration == 6  # storage's step 6, not RAM's step 5
    assert tier2.restored is None
    snapshot2.finalize(resumed)
    tier2.finalize(resumed)
    snapshot.finalize(manager)
