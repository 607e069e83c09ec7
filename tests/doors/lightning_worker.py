"""A Lightning fit of a small model on CPU, checkpointed every epoch through snapkeep's door; the
kill tests and ``tools/lightning_crash_trials.py`` run it, kill it and rerun it.

    python lightning_worker.py OUT [--epochs N] [--kill-in-save K] [--stock]

It resumes with ``ckpt_path="last"`` (a first run finds nothing and starts fresh), prints
``step N`` after each optimizer step (flushed) and writes the final model and optimizer states
to ``OUT/final.pt``. ``--kill-in-save K``: the K-th save (1-based) of this process SIGKILLs it
half-way through writing the snapshot's temp file. ``--stock``: Lightning's own
``TorchCheckpointIO`` and ``ModelCheckpoint`` (for the corruption comparison).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
from typing import Any

import torch

STEPS_PER_EPOCH = 8


def make_module() -> Any:
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            print(f"step {self.trainer.global_step}", flush=True)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return Tiny()


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS_PER_EPOCH * 16, 64, generator=g)
    y = torch.randn(STEPS_PER_EPOCH * 16, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16,
                                       shuffle=True)


class KillInSave:
    """A savefun that SIGKILLs this process half-way through the ``k``-th save's temp file."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls = 0

    def __call__(self, obj: Any, f: Any, **kwargs: Any) -> None:
        self.calls += 1
        if self.calls != self.k:
            torch.save(obj, f, **kwargs)
            return
        buffer = io.BytesIO()
        torch.save(obj, buffer, **kwargs)
        f.write(buffer.getbuffer()[:buffer.tell() // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--kill-in-save", type=int, default=0)
    parser.add_argument("--stock", action="store_true")
    args = parser.parse_args(argv)

    import lightning.pytorch as pl

    torch.manual_seed(0)
    model = make_module()
    ckpt_dir = os.path.join(args.out, "ckpts")
    if args.stock:
        plugins: list[Any] = []
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True,
                                                  monitor="train_loss", save_top_k=2)
    else:
        from snapkeep.lightning import ModelCheckpoint, SnapkeepCheckpointIO
        from snapkeep.writing import ThreadWriter

        writer = ThreadWriter(savefun=KillInSave(args.kill_in_save)) if args.kill_in_save \
            else None
        plugins = [SnapkeepCheckpointIO(writer)]
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, monitor="train_loss",
                                     save_top_k=2)
    trainer = pl.Trainer(
        max_epochs=args.epochs, accelerator="cpu", devices=1, deterministic=True,
        enable_progress_bar=False, enable_model_summary=False, logger=False,
        callbacks=[checkpoint], plugins=plugins, default_root_dir=args.out)
    trainer.fit(model, loader(), ckpt_path="last")
    optimizer = trainer.optimizers[0]
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": trainer.global_step}, os.path.join(args.out, "final.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
