"""One door's training with snapkeep's preemption on a really slow write (run by
test_door_deadline.py): the ppe ``ExtensionsManager`` loop with ``extensions.preemption``,
Lightning's ``Trainer`` with snapkeep's ``ModelCheckpoint``, or the Hugging Face ``Trainer`` with
``SnapkeepCallback(preemption=True)``; a snapshot every ``EVERY`` (4) steps.

Usage: ``python door_deadline_worker.py DOOR OUT_DIR STEPS`` (DOOR: ``ppe``, ``lightning`` or
``hf``). Environment: ``PAUSE_AT`` (after that step, once the last durable save is committed,
print ``paused N pid P`` and wait for a line on stdin: the test signals it there), ``SLOW_S``
(each durable write takes about that many seconds more: a throttled storage for ppe and
Lightning, a slower checkpoint write for the HF Trainer; unset: local files, fast),
``SNAPKEEP_GRACE_S`` (snapkeep's), ``TIER_ROOT`` (ppe: ``extensions.memory_tier`` in that
directory; Lightning: ``SnapkeepCheckpointIO(memory=...)`` there; HF:
``SnapkeepTrainer(memory=...)``). Prints ``step N``; at the end saves the model's state to
``final.pt`` beside OUT_DIR.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch

EVERY = 4
X = torch.linspace(-1, 1, 6 * 64).reshape(6, 64)
STATE_BYTES = 64 * 64 * 4 * 3  # the Linear's weight and Adam's two moments (about)


def _pause(step: int, pause_at: int) -> None:
    if step == pause_at:
        print("paused", step, "pid", os.getpid(), flush=True)
        sys.stdin.readline()  # the test signals this process, then lets it go on


def _slow_writer() -> Any:
    from snapkeep.writing import ThreadWriter

    slow_s = float(os.environ.get("SLOW_S", "0"))
    if not slow_s:
        return ThreadWriter()
    from support.slow_storage import SlowPfio

    return ThreadWriter(fs=SlowPfio(STATE_BYTES / slow_s))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 64, bias=False)


def ppe(out: str, steps: int, pause_at: int) -> torch.nn.Module:
    from snapkeep.training import ExtensionsManager
    from snapkeep.training import extensions as ext

    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    writer = _slow_writer()
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=steps, out_dir=out,
                                writer=writer)
    manager.extend(ext.snapshot(autoload=True, filename="ckpt_{.iteration}"),
                   trigger=(EVERY, "iteration"))
    tier_root = os.environ.get("TIER_ROOT")
    if tier_root:  # the door's memory tier: a preemption that does not fit goes there
        manager.extend(ext.memory_tier(ext.MemoryTier(every=EVERY, replicas=0, root=tier_root)))
    manager.extend(ext.preemption(timeout_s=60))
    while not manager.stop_trigger:
        with manager.run_iteration():
            optimizer.zero_grad()
            model(X[manager.iteration % 6]).pow(2).mean().backward()
            optimizer.step()
        step = manager.iteration
        print("step", step, flush=True)
        if step == pause_at:
            writer.wait()  # the durable save of step 4 committed: measured before the signal
        _pause(step, pause_at)
    return model


def lightning(out: str, steps: int, pause_at: int) -> torch.nn.Module:
    import lightning.pytorch as pl

    from snapkeep.lightning import ModelCheckpoint, SnapkeepCheckpointIO

    tier_root = os.environ.get("TIER_ROOT")
    memory = None
    if tier_root:  # the door's memory tier: a preemption that does not fit goes there
        import snapkeep

        memory = snapkeep.MemoryTier(every=EVERY, replicas=0, root=tier_root)
    io = SnapkeepCheckpointIO(_slow_writer(), memory=memory)

    class Tiny(pl.LightningModule):
        """One batch per epoch, the input the step's: a resume is exact at any step."""

        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(X[self.global_step % 6]).pow(2).mean()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            print("step", self.global_step, flush=True)
            if self.global_step == pause_at:
                io.wait()  # the durable save of step 4 committed
            _pause(self.global_step, pause_at)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.zeros(1, 1)), batch_size=1)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    module = Tiny()
    checkpoint = ModelCheckpoint(dirpath=out, filename="ckpt_{step}",
                                 auto_insert_metric_name=False, every_n_train_steps=EVERY,
                                 save_top_k=-1, enable_version_counter=False, timeout_s=60)
    checkpoint.FILE_EXTENSION = ""
    trainer = pl.Trainer(max_steps=steps, max_epochs=-1, accelerator="cpu", devices=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[checkpoint], plugins=[io],
                         default_root_dir=out)
    try:
        trainer.fit(module, ckpt_path="last")
    finally:
        io.close()
    return module.net


def hf(out: str, steps: int, pause_at: int) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import (
        PretrainedConfig,
        PreTrainedModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from snapkeep import hf as snapkeep_hf

    class Tiny(PreTrainedModel):  # type: ignore[misc]
        config_class = PretrainedConfig  # built in code: no hub download

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.net = _model()

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.net(x).pow(2).mean()}

    class Inputs(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(X)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": X[i]}

    slow_s = float(os.environ.get("SLOW_S", "0"))

    class SlowSave(Trainer):  # type: ignore[misc]
        """The stock Trainer whose checkpoint write takes ``SLOW_S`` seconds more."""

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            time.sleep(slow_s)
            super()._save_checkpoint(model, trial)

    class SlowOwnedSave(snapkeep_hf.SnapkeepTrainer):  # type: ignore[misc]
        """snapkeep's owned save (with its memory tier) whose background checkpoint write
        takes ``SLOW_S`` seconds more."""

        def _snapkeep_write(self, *args: Any) -> None:
            time.sleep(slow_s)
            super()._snapkeep_write(*args)

    owned: list[Any] = []  # the owned save, whose checkpoint-4 is written in the background

    class Pause(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            print("step", state.global_step, flush=True)
            if state.global_step == pause_at and owned:
                owned[0].wait_for_checkpoint()  # checkpoint-4 committed
            _pause(state.global_step, pause_at)  # (the stock save wrote it synchronously)

    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=1, optim="adamw_torch",
        learning_rate=0.01, lr_scheduler_type="constant", save_strategy="steps",
        save_steps=EVERY, report_to=[], use_cpu=True, disable_tqdm=True,
        logging_strategy="no", seed=0, dataloader_num_workers=0)
    torch.manual_seed(0)
    model = Tiny(PretrainedConfig())
    callback = snapkeep_hf.SnapkeepCallback(preemption=True, timeout_s=60)
    tier_root = os.environ.get("TIER_ROOT")
    if tier_root:  # the owned save's memory tier: a preemption that does not fit goes there
        import snapkeep

        trainer = SlowOwnedSave(
            model=model, args=args, train_dataset=Inputs(), callbacks=[callback, Pause()],
            memory=snapkeep.MemoryTier(every=EVERY, replicas=0, root=tier_root))
        owned.append(trainer)
    else:
        trainer = SlowSave(model=model, args=args, train_dataset=Inputs(),
                           callbacks=[callback, Pause()])  # the agreement first: next step
    trainer.train(resume_from_checkpoint=snapkeep_hf.latest_verified(out))
    return model.net


def main() -> None:
    door, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pause_at = int(os.environ.get("PAUSE_AT", "-1"))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    net = {"ppe": ppe, "lightning": lightning, "hf": hf}[door](out, steps, pause_at)
    torch.save({k: v.clone() for k, v in net.state_dict().items()},
               os.path.join(os.path.dirname(os.path.abspath(out)), "final.pt"))
    print("final", flush=True)


if __name__ == "__main__":
    main()
