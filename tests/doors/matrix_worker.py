"""One door's training loop for the matrix's subprocess scenario (exit without close, kill -9,
rerun): a shuffled ``DataLoader`` over a small dataset on the global RNG, dropout (a torch RNG
draw at every step), Adam, a snapshot at every step through the door.

Usage: ``python matrix_worker.py DOOR DIR STEPS [EXIT_AT]`` with ``DOOR`` one of
``checkpointer``, ``checkpointer-sharded``, ``extension``, ``extension-sharded``; ``DIR`` a
path or fsspec URL (storage options as JSON in ``SNAPKEEP_TEST_STORAGE_OPTIONS``). It prints
``step N DIGEST`` after each step's save (``DIGEST``: the batch's bytes and the dropout mask,
so the data position and the random stream are compared step by step), and at the end writes
``final.pt`` (model, optimizer, torch RNG state) into the working directory. With ``EXIT_AT``,
the process ends after that step's save without calling ``close``/``finalize`` (the
interpreter's exit drain commits). The matrix runs it forked from a zygote
(tests/support/zygote.py); ``python matrix_worker.py ...`` runs it the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch

import snapkeep

BATCH, SAMPLES = 6, 24  # 4 batches an epoch


def _setup() -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 4), torch.randn(SAMPLES, 1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 1))
    return data, model, torch.optim.Adam(model.parameters(), lr=0.01)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> str:
    """One training step; the digest of what it drew (the batch, then the dropout mask)."""
    optimizer.zero_grad()
    hidden = model[0](x)
    mask = model[1](torch.ones_like(hidden))  # the same draw the forward below would make
    loss = torch.nn.functional.mse_loss(model[2](hidden * mask), y)
    loss.backward()
    optimizer.step()
    return hashlib.sha256(x.numpy().tobytes() + mask.numpy().tobytes()).hexdigest()[:16]


def _say(step: int, digest: str) -> None:
    print("step", step, digest, flush=True)


def checkpointer(directory: str, steps: int, exit_at: int, options: dict[str, Any],
                 sharded: bool, incremental: bool = False
                 ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    data, model, optimizer = _setup()
    if sharded:  # sharded snapshots keep a StatefulDataLoader's position only
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: Any = StatefulDataLoader(data, batch_size=BATCH, shuffle=True)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    state = {"model": model, "optimizer": optimizer, "data": loader}
    ckpt = snapkeep.Checkpointer(directory, sharded=sharded, storage_options=options or None,
                                 incremental=incremental)
    step = ckpt.load(into=state) or 0
    while step < steps:
        for x, y in loader:
            digest = _step(model, optimizer, x, y)
            step += 1
            ckpt.save(step, state)
            _say(step, digest)
            if step == exit_at:
                sys.exit(0)  # without close: the exit drain commits the pending snapshot
            if step == steps:
                break
    ckpt.close()
    return model, optimizer


def extension(directory: str, steps: int, exit_at: int, options: dict[str, Any],
              sharded: bool, incremental: bool = False
              ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from snapkeep.training import ExtensionsManager, extensions
    from snapkeep.writing import ThreadWriter

    data, model, optimizer = _setup()
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    manager = ExtensionsManager(model, optimizer, steps // len(loader),
                                iters_per_epoch=len(loader),
                                writer=ThreadWriter(out_dir=directory, storage_options=options))
    mode = extensions.SnapshotMode.SHARDED if sharded else extensions.SnapshotMode.DEFAULT
    manager.extend(extensions.snapshot(autoload=True, loaders={"train": loader},
                                       snapshot_mode=mode, incremental=incremental),
                   trigger=(1, "iteration"))
    while not manager.stop_trigger:
        for x, y in loader:
            with manager.run_iteration():
                digest = _step(model, optimizer, x, y)
            _say(manager.iteration, digest)
            if manager.iteration == exit_at:
                sys.exit(0)  # without finalize
    manager.finalize()
    return model, optimizer


def main() -> None:
    door, directory, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    exit_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    options = json.loads(os.environ.get("SNAPKEEP_TEST_STORAGE_OPTIONS", "{}"))
    incremental = door.endswith("-incremental")
    if door in ("extension", "extension-sharded", "extension-incremental"):
        model, optimizer = extension(directory, steps, exit_at, options,
                                     sharded=door == "extension-sharded",
                                     incremental=incremental)
    elif door in ("checkpointer", "checkpointer-sharded", "checkpointer-incremental"):
        model, optimizer = checkpointer(directory, steps, exit_at, options,
                                        sharded=door == "checkpointer-sharded",
                                        incremental=incremental)
    else:
        raise SystemExit(f"unknown door {door!r}")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state()}, "final.pt")


if __name__ == "__main__":
    main()
