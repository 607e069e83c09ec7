"""The framework doors' rows of the door x guarantee matrix (``test_matrix.py``): Lightning and
the Hugging Face Trainer, each driven as its users drive it, resuming first, saving a snapshot
at every step with a ``val_loss`` metric, under snapkeep's retention (``keep=``).

The rows have the matrix's door interface (``name``, ``sharded``, ``snapshot_name``, ``train``,
``hold_code``, ``worker_command``: ``continuation_worker.py``, so the kill -9 scenario resumes
mid-epoch and at epoch ends through them), duck-typed (``test_matrix`` imports this module;
a subclass of its ``Door`` would import it back). ``skips``: scenario -> why it cannot apply
to the door (skipped with that reason by ``conftest.py``).

Also a worker, for the preemption tests (a real signal to a real Trainer process)::

    python framework_doors.py lightning DIR STOP [--every N] [--pause-at K] [--memory ROOT]

saves every ``N`` steps; after step ``K`` prints ``step K`` (flushed) and waits for a line on
stdin (the test signals it meanwhile); writes ``DIR/final.pt`` (the model's state) at the end.
With ``--memory ROOT`` the IO keeps a memory tier in ``ROOT`` every step, and step ``K`` is
printed once its saves and its RAM snapshot are committed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from snapkeep.retention import RetentionPolicy

X = torch.linspace(-1, 1, 24).reshape(6, 4)
#: The subprocess scenario's worker (a shuffled loader, dropout, a snapshot every step):
#: mid-epoch and epoch-end resumes through the door.
CONTINUATION_WORKER = pathlib.Path(__file__).with_name("continuation_worker.py")


def _worker_command(door: str, directory: str, steps: int, exit_at: int | None) -> list[str]:
    return [sys.executable, str(CONTINUATION_WORKER), door, directory, str(steps),
            *([str(exit_at)] if exit_at is not None else [])]


def val_loss(step: int) -> float:
    return 1.0 / (1 + step)


@contextlib.contextmanager
def _quiet_framework(*loggers: str) -> Iterator[None]:
    """The framework's own INFO lines and warnings off, as a user silences them, so that
    snapkeep's notices are what stderr shows."""
    saved = [(name, logging.getLogger(name).level) for name in loggers]
    for name in loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in saved:
            logging.getLogger(name).setLevel(level)


# -- Lightning -----------------------------------------------------------------------------------
def _lightning_module(pause_at: int = 0, backbone: torch.nn.Module | None = None) -> Any:
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        """One batch per epoch; the input is the step's (as the matrix's plain loops), so a
        resume at any step is at an epoch boundary, where Lightning continues exactly."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 2)
            if backbone is not None:  # frozen: saved, never trained (incremental: one blob)
                self.backbone = backbone

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            step = self.global_step + 1
            self.log("val_loss", val_loss(step), on_step=True, on_epoch=False)
            return self.net(X[step % 6]).pow(2).sum()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.global_step == pause_at:
                io = self.trainer.strategy.checkpoint_io
                if getattr(io, "memory", None) is not None:
                    io.wait()  # the saves and the RAM snapshot of this step committed
                print(f"step {self.global_step}", flush=True)
                go = os.environ.get("SNAPKEEP_TEST_GO")
                if go is None:
                    sys.stdin.readline()  # the test signals this process, then lets it go on
                    return
                deadline = time.monotonic() + 120  # ranks under torchrun: a file, bounded
                while not os.path.exists(go) and time.monotonic() < deadline:
                    time.sleep(0.02)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(1, 1)),
                                               batch_size=1)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.net.parameters(), lr=0.1)

    return Tiny()


def train_lightning(directory: pathlib.Path | str, stop: int, *,
                    keep: RetentionPolicy | None = None, every: int = 1,
                    pause_at: int = 0, devices: int = 1, preemption: bool = True,
                    callbacks: tuple[Any, ...] = (), memory: Any = None,
                    backbone: torch.nn.Module | None = None) -> torch.nn.Module:
    """Lightning's Trainer with snapkeep's CheckpointIO and ModelCheckpoint (names
    ``ckpt_<step>``, every ``every`` steps), resumed with ``ckpt_path="last"``; with
    ``memory`` (a ``snapkeep.MemoryTier``) the IO keeps the tier; with ``backbone`` (a frozen
    module, part of the model) the checkpoints are incremental."""
    import lightning.pytorch as pl

    from snapkeep.lightning import ModelCheckpoint, SnapkeepCheckpointIO

    with _quiet_framework("lightning.pytorch", "lightning.fabric"):
        module = _lightning_module(pause_at, backbone)
        checkpoint = ModelCheckpoint(dirpath=directory, filename="ckpt_{step}",
                                     auto_insert_metric_name=False, every_n_train_steps=every,
                                     save_top_k=-1, enable_version_counter=False,
                                     preemption=preemption)
        checkpoint.FILE_EXTENSION = ""  # Lightning's documented knob: names end in the step
        io = SnapkeepCheckpointIO(keep=keep, memory=memory, incremental=backbone is not None)
        trainer = pl.Trainer(
            max_steps=stop, max_epochs=-1, accelerator="cpu", devices=devices, logger=False,
            strategy="ddp" if devices > 1 else "auto",
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[checkpoint, *callbacks], plugins=[io], default_root_dir=directory)
        try:
            trainer.fit(module, ckpt_path="last")
        finally:
            io.close()
    return module.net


class LightningDoor:
    name = "lightning"
    sharded = False
    skips: dict[str, str] = {}
    memory_tier = True  # SnapkeepCheckpointIO(memory=...)
    frozen_blobs = True  # SnapkeepCheckpointIO(incremental=True)

    def snapshot_name(self, step: int) -> str:
        return f"ckpt_{step}"

    def train(self, directory: pathlib.Path, stop: int, *,
              keep: RetentionPolicy | None = None, memory: Any = None, every: int = 1,
              length: int | None = None) -> torch.nn.Module:
        # length: Lightning's run ends at max_steps=stop; the tier stays while RAM is newer
        return train_lightning(directory, stop, keep=keep, memory=memory, every=every)

    def train_frozen(self, directory: pathlib.Path | str, stop: int, *,
                     after_save: Any = None) -> tuple[torch.nn.Module, torch.nn.Module]:
        """Incremental checkpoints over a frozen 1 MiB backbone (the matrix's
        ``_frozen_backbone``); ``after_save(step)`` once step's checkpoint is committed (at
        the next batch's start: Lightning runs ModelCheckpoint's save after every other
        callback's batch end)."""
        import lightning.pytorch as pl

        from snapkeep.lightning import SnapkeepCheckpointIO

        class AfterSave(pl.Callback):  # type: ignore[misc]
            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                io = trainer.strategy.checkpoint_io
                if after_save is not None and isinstance(io, SnapkeepCheckpointIO) \
                        and trainer.global_step > 0:
                    io.wait()
                    after_save(trainer.global_step)

        torch.manual_seed(1)
        backbone = torch.nn.Linear(512, 512, bias=False)
        backbone.requires_grad_(False)
        net = train_lightning(directory, stop, backbone=backbone, callbacks=(AfterSave(),))
        return net, backbone

    def plant_other_door(self, directory: pathlib.Path | str, step: int,
                         storage_options: dict[str, Any] | None = None) -> str | None:
        """The Checkpointer saves ``ckpt_<step>`` here: a Lightning resume must skip it."""
        import snapkeep

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        with snapkeep.Checkpointer(directory, template="ckpt_{step}",
                                   storage_options=storage_options) as ckpt:
            ckpt.save(step, {"model": model})
        return f"ckpt_{step}"

    def load_alias(self, directory: pathlib.Path | str, alias: str) -> Any:
        """``SnapkeepCheckpointIO.load_checkpoint`` of the reference record ``alias``."""
        from snapkeep.lightning import SnapkeepCheckpointIO

        io = SnapkeepCheckpointIO()
        try:
            return io.load_checkpoint(os.path.join(os.fspath(directory), alias))
        finally:
            io.close()

    def worker_command(self, directory: str, steps: int, exit_at: int | None) -> list[str]:
        """torchdata's StatefulDataLoader (the loader Lightning resumes mid-epoch), 4 batches
        an epoch, a snapshot every step (``ckpt_<step>``)."""
        return _worker_command("lightning", directory, steps, exit_at)

    #: the session ``SnapkeepCheckpointIO.open(DIR, template='ckpt_{step}')`` opens (the same
    #: store lock), without importing Lightning in the holder (seconds)
    hold_code = ("from snapkeep.session import Session\n"
                 "from snapkeep.store import open_store\n"
                 "held = Session(open_store(DIR, 'ckpt_{step}'))\n"
                 "held.open()\n")


# -- Hugging Face ---------------------------------------------------------------------------------
def _hf_model() -> Any:
    from transformers import PretrainedConfig, PreTrainedModel

    class TinyConfig(PretrainedConfig):  # type: ignore[misc]
        model_type = "snapkeep-tiny"

    class Tiny(PreTrainedModel):  # type: ignore[misc]
        """A Linear(4, 2) as a ``PreTrainedModel`` (built in code: no hub download), its loss
        the matrix's plain loops' one."""

        config_class = TinyConfig

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.net = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.net(x).pow(2).sum()}

    torch.manual_seed(0)
    return Tiny(TinyConfig())


class _Inputs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": X[i]}


def train_hf(directory: pathlib.Path | str, stop: int, *,
             keep: RetentionPolicy | None = None, every: int = 1, preemption: bool = False,
             callbacks: tuple[Any, ...] = (), memory: Any = None,
             length: int | None = None) -> torch.nn.Module:
    """The Trainer with snapkeep's owned, asynchronous save (``SnapkeepTrainer``, its
    ``SnapkeepCallback`` giving ``keep``), saving ``checkpoint-N`` every step with ``val_loss``
    logged at each, resumed with ``resume_from_checkpoint=latest_verified(...)``; with
    ``memory`` (a ``snapkeep.MemoryTier``) the owned save keeps the tier and the resume is
    ``resume_from_checkpoint=True`` (the newer of RAM and ``latest_verified``); with
    ``length`` the run plans ``length`` steps and stops after ``stop`` (an unfinished run)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import TrainerCallback, TrainingArguments

    from snapkeep import hf

    class LogValLoss(TrainerCallback):  # type: ignore[misc]
        trainer: Any = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.trainer.log({"val_loss": val_loss(state.global_step)})
            if state.global_step == stop:  # before its planned end (length): no end save
                control.should_training_stop = True

    with _quiet_framework("transformers"):
        args = TrainingArguments(
            output_dir=str(directory), max_steps=length or stop, per_device_train_batch_size=1,
            optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", save_strategy="steps",
            save_steps=every, report_to=[], use_cpu=True, disable_tqdm=True,
            logging_strategy="no", seed=0, dataloader_num_workers=0)
        log = LogValLoss()
        trainer = hf.SnapkeepTrainer(model=_hf_model(), args=args, train_dataset=_Inputs(),
                                     callbacks=[hf.SnapkeepCallback(keep=keep,
                                                                    preemption=preemption),
                                                log, *callbacks], memory=memory)
        log.trainer = trainer
        trainer.train(resume_from_checkpoint=True if memory is not None
                      else hf.latest_verified(directory))
    return trainer.model.net


class HFDoor:
    name = "hf"
    sharded = True  # its snapshots are directories (checkpoint-N), each with a marker
    memory_tier = True  # SnapkeepTrainer(memory=...)
    other_door_skip = ("its snapshots are checkpoint-N directories the Trainer writes; another "
                       "door's single file under those names is no directory and never listed")
    skips = {
        "test_the_reading_doors_agree_with_the_training_door":
            "load_latest reads snapkeep's own snapshots; the Trainer reads its checkpoint-N "
            "directories itself (resume_from_checkpoint=latest_verified(...))",
        "test_a_damaged_blob_is_written_again_and_every_snapshot_loads":
            "no incremental checkpoints: checkpoint-N holds the Trainer's own files "
            "(model.safetensors, optimizer.pt), which from_pretrained and "
            "resume_from_checkpoint read as they are; a file referring to shared blobs would "
            "break both (hf.SnapkeepSaveMixin)",
    }

    def snapshot_name(self, step: int) -> str:
        return f"checkpoint-{step}"

    def train(self, directory: pathlib.Path, stop: int, *,
              keep: RetentionPolicy | None = None, memory: Any = None, every: int = 1,
              length: int | None = None) -> torch.nn.Module:
        return train_hf(directory, stop, keep=keep, memory=memory, every=every, length=length)

    def worker_command(self, directory: str, steps: int, exit_at: int | None) -> list[str]:
        """``SnapkeepTrainer``, 4 batches an epoch, ``checkpoint-N`` every step."""
        return _worker_command("hf", directory, steps, exit_at)

    #: the session ``SnapkeepCallback(output_dir=DIR).open()`` opens, without importing
    #: transformers in the holder (seconds)
    hold_code = ("from snapkeep.session import Session\n"
                 "from snapkeep.store import CheckpointDirs, resolve_storage\n"
                 "held = Session(CheckpointDirs(*resolve_storage(DIR)))\n"
                 "held.open()\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("door", choices=["lightning"])
    parser.add_argument("directory")
    parser.add_argument("stop", type=int)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--pause-at", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1, help="ranks (under torchrun: DDP)")
    parser.add_argument("--memory", default=None, help="a memory tier's root (every step)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    memory = None
    if args.memory is not None:
        import snapkeep

        memory = snapkeep.MemoryTier(every=1, replicas=0, root=args.memory)
    model = train_lightning(args.directory, args.stop, every=args.every,
                            pause_at=args.pause_at, devices=args.devices, memory=memory)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(model.state_dict(), os.path.join(args.directory, "final.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
