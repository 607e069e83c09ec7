"""The storage step a RAM snapshot must match or beat at recovery is that of the snapshots of the
whole manager: a ``snapshot_object`` of the model alone, however new, is not a step the run can
resume from, and must not make the tier drop a newer RAM step for an older full snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def _run(out: Path, root: Path) -> tuple[ExtensionsManager, torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    writer = writing.ThreadWriter(out_dir=str(out), timeout_s=30)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=20, out_dir=str(out),
                                writer=writer)
    manager.extend(ext.snapshot(filename="s_{.iteration}", autoload=True), trigger=(5, "iteration"))
    manager.extend(ext.snapshot_object(model, filename="m_{.iteration}"), trigger=(1, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=3, replicas=0, root=str(root)))
    manager.extend(tier)
    return manager, model, tier, writer


def test_a_model_only_snapshot_does_not_hide_a_newer_ram_step(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "shm"
    manager, model, tier, writer = _run(out, root)
    while manager.iteration < 7:  # full snapshot: step 5; model alone: 1..7; RAM: step 6
        with manager.run_iteration():
            model(torch.randn(8, 16)).sum().backward()
            manager.optimizers["main"].step()
    tier.wait()
    writer.finalize()  # the process "dies" here
    weight = model.weight.detach().clone()

    resumed, model2, tier2, writer2 = _run(out, root)
    resumed.start_extensions()
    assert resumed.iteration == 6  # RAM's step 6, not the full snapshot's step 5
    assert tier2.restored is not None and tier2.restored.source == "own"
    assert tier2.restored.storage_step == 5
    assert not torch.equal(model2.weight, weight)  # step 6's weights, not step 7's
    resumed.finalize()
    writer2.finalize()
    manager.finalize()
