"""Exact continuation through the framework doors: a Lightning fit or a Hugging Face Trainer
run with dropout, killed at a step and rerun, for ``test_framework_continuation.py``, the matrix's
subprocess scenario (``test_matrix.py``), ``tools/lightning_crash_trials.py --continuation``
and ``benchmarks/hf_kill_trials.py --mid-epoch``.

    python continuation_worker.py lightning DIR STEPS [EXIT_AT] [--loader plain|stateful]
        [--generator] [--every N] [--val-every N] [--kill-at K] [--batches-per-epoch B]
        [--workers W]
    python continuation_worker.py hf DIR STEPS [EXIT_AT] [--every N] [--kill-at K]
        [--batches-per-epoch B] [--ignore-data-skip]

Lightning: snapkeep's ``SnapkeepCheckpointIO`` and ``ModelCheckpoint`` (names ``ckpt_<step>``,
``every_n_train_steps=N``, every snapshot kept), a validation loop every ``--val-every``
batches (an integer ``val_check_interval``; 0: once per epoch), resumed with
``ckpt_path="last"``. HF: ``SnapkeepTrainer`` saving ``checkpoint-N`` every ``N`` steps,
resumed with ``latest_verified``. The model is ``Linear(4, 8) -> Dropout(0.5) -> Linear(8, 1)``
(a torch RNG draw at every step), Adam, 6-sample batches of a shuffled loader.

After each step's save it prints ``step N DIGEST`` (flushed; ``DIGEST``: the batch's bytes and
the dropout mask, so the data position and the random stream are compared step by step). At the
end it writes ``final.pt`` (model, optimizer, torch RNG state) into the working directory.
``EXIT_AT``: the process ends after that step's save with ``sys.exit(0)``, without closing
anything; ``--kill-at K``: it SIGKILLs itself once step K's snapshot is committed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from typing import Any

import torch

BATCH = 6


def _data(batches_per_epoch: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    n = BATCH * batches_per_epoch
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g),
                                          torch.randn(n, 1, generator=g))


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5),
                               torch.nn.Linear(8, 1))


def _forward(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The loss and the digest of what the step drew (the batch, then the dropout mask)."""
    hidden = net[0](x)
    mask = net[1](torch.ones_like(hidden))  # the draw the forward would make
    loss = torch.nn.functional.mse_loss(net[2](hidden * mask), y)
    digest = hashlib.sha256(x.numpy().tobytes() + mask.numpy().tobytes()).hexdigest()[:16]
    return loss, digest


def _say(step: int, digest: str) -> None:
    print("step", step, digest, flush=True)


def _final(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state()}, "final.pt")


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# -- Lightning -----------------------------------------------------------------------------------
def lightning(a: argparse.Namespace) -> None:
    import lightning.pytorch as pl

    from snapkeep.lightning import ModelCheckpoint, SnapkeepCheckpointIO

    for name in ("lightning.pytorch", "lightning.fabric"):
        import logging

        logging.getLogger(name).setLevel(logging.ERROR)
    torch.manual_seed(0)
    data = _data(a.batches_per_epoch)
    generator = torch.Generator().manual_seed(7) if a.generator else None
    if a.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: Any = StatefulDataLoader(data, batch_size=BATCH, shuffle=True,
                                         generator=generator, num_workers=a.workers)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True,
                                             generator=generator, num_workers=a.workers)
    val = torch.utils.data.DataLoader(_data(2), batch_size=BATCH)
    io = SnapkeepCheckpointIO()

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.digest = ""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss, self.digest = _forward(self.net, *batch)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = self.global_step
            _say(step, self.digest)
            if step == a.exit_at:
                sys.exit(0)  # without closing anything
            if step == a.kill_at:
                io.wait()  # the snapshot of this step is committed
                _kill_self()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    module = Tiny()
    checkpoint = ModelCheckpoint(dirpath=a.directory, filename="ckpt_{step}",
                                 auto_insert_metric_name=False, every_n_train_steps=a.every or None,
                                 save_top_k=-1, save_last=True, enable_version_counter=False)
    checkpoint.FILE_EXTENSION = ""
    trainer = pl.Trainer(
        max_steps=a.steps, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        val_check_interval=a.val_every or None, check_val_every_n_epoch=1,
        callbacks=[checkpoint], plugins=[io], default_root_dir=a.directory)
    try:
        trainer.fit(module, loader, val, ckpt_path="last")
    finally:
        io.close()
    _final(module.net, trainer.optimizers[0])


# -- Hugging Face --------------------------------------------------------------------------------
def hf(a: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import (
        PretrainedConfig,
        PreTrainedModel,
        TrainerCallback,
        TrainingArguments,
    )

    from snapkeep import hf as door

    class TinyConfig(PretrainedConfig):  # type: ignore[misc]
        model_type = "snapkeep-continuation"

    class Tiny(PreTrainedModel):  # type: ignore[misc]
        config_class = TinyConfig

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.net = _net()
            self.digest = ""

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            loss, self.digest = _forward(self.net, x, y)
            return {"loss": loss}

    class Pairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.data = _data(a.batches_per_epoch)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            x, y = self.data[i]
            return {"x": x, "y": y}

    trainer: Any = None

    torch.manual_seed(0)
    model = Tiny(TinyConfig())
    args = TrainingArguments(
        output_dir=a.directory, max_steps=a.steps, per_device_train_batch_size=BATCH,
        optim="adamw_torch", learning_rate=0.01, lr_scheduler_type="constant",
        save_strategy="steps", save_steps=a.every, report_to=[], use_cpu=True,
        disable_tqdm=True, logging_strategy="no", seed=0, dataloader_num_workers=0,
        ignore_data_skip=a.ignore_data_skip)

    class Trainer(door.SnapkeepTrainer):  # type: ignore[misc]
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self._digest = self.model.digest
            return loss

    class After(TrainerCallback):  # type: ignore[misc]
        """Runs after the step's save (the Trainer saves in ``_maybe_log_save_evaluate``,
        after ``on_step_end``; the next ``on_step_begin`` or ``on_train_end`` follows)."""

        pending = 0

        def _after(self, step: int) -> None:
            _say(step, trainer._digest)
            if step == a.exit_at:
                sys.exit(0)
            if step == a.kill_at:
                trainer.wait_for_checkpoint()
                _kill_self()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.pending = state.global_step

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.pending:
                step, self.pending = self.pending, 0
                self._after(step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.pending:
                step, self.pending = self.pending, 0
                self._after(step)

    trainer = Trainer(model=model, args=args, train_dataset=Pairs(), callbacks=[After()])
    trainer.train(resume_from_checkpoint=door.latest_verified(a.directory))
    _final(model.net, trainer.optimizer)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("door", choices=["lightning", "hf"])
    p.add_argument("directory")
    p.add_argument("steps", type=int)
    p.add_argument("exit_at", type=int, nargs="?", default=-1)
    p.add_argument("--loader", choices=["plain", "stateful"], default="stateful")
    p.add_argument("--generator", action="store_true", help="generator= on the loader")
    p.add_argument("--every", type=int, default=1,
                   help="a snapshot every N steps (0, Lightning: its default trigger)")
    p.add_argument("--val-every", type=int, default=0,
                   help="Lightning's val_check_interval in batches (0: once per epoch)")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--batches-per-epoch", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--ignore-data-skip", action="store_true", help="HF: the Trainer's flag")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")  # the frameworks' own; snapkeep's are what is tested
    warnings.filterwarnings("always", message="snapkeep: ")
    lightning(a) if a.door == "lightning" else hf(a)


if __name__ == "__main__":
    main(sys.argv[1:])
