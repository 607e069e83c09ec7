"""A Hugging Face Trainer run on a tiny GPT-2 built in code (no hub download, CPU), for the HF
door's tests and its kill benchmark.

    python hf_worker.py OUT_DIR [--max-steps 8] [--save-steps 2] [--eval-steps N]
        [--resume none|verified|stock|latest] [--callback] [--save-total-limit K]
        [--hold-at N] [--hold-stage model|optimizer|state] [--hidden 32] [--stale N]
        [--owned [--memory ROOT]]

``--hold-at N``: while saving checkpoint-N, at ``--hold-stage``, write ``OUT_DIR/holding-N`` and
wait to be killed (the parent sends SIGKILL): ``model`` after the weights, ``optimizer`` after
``optimizer.pt`` is half written (its bytes flushed so far), ``state`` after
``trainer_state.json``, before the commit marker. At the end it writes ``OUT_DIR/final.pt`` (the
model's parameters) and prints ``resumed-from <path|None>`` and ``best <path|None>``.
``--memory ROOT``: the owned save keeps a memory tier in ``ROOT`` every step
(``SnapkeepTrainer(memory=...)``); ``--resume latest`` passes ``resume_from_checkpoint=True``
(the newer of RAM and ``latest_verified``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import snapkeep  # noqa: E402
from snapkeep import hf  # noqa: E402

SEQ = 16


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hold(out_dir: str, step: int) -> None:
    with open(os.path.join(out_dir, f"holding-{step}"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the parent kills us; bounded if it never does
        time.sleep(0.05)
    sys.exit(3)


def make_trainer_class(base: type, out_dir: str, hold_at: int | None, stage: str) -> type:
    class Holding(base):  # type: ignore[misc,valid-type]
        def _holding(self, which: str) -> bool:
            return hold_at is not None and self.state.global_step == hold_at and stage == which

        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            if self._holding("model"):
                hold(out_dir, hold_at)  # type: ignore[arg-type]
            if self._holding("optimizer"):
                path = os.path.join(output_dir, "optimizer.pt")
                torch.save(self.optimizer.state_dict(), path)
                size = os.path.getsize(path)
                with open(path, "r+b") as f:  # as if killed halfway through writing it
                    f.truncate(size // 2)
                hold(out_dir, hold_at)  # type: ignore[arg-type]
            super()._save_optimizer_and_scheduler(output_dir)

        def _snapkeep_write(self, output_dir: str, step: int, staged: dict,  # type: ignore
                            *rest: object) -> None:
            if hold_at == step:  # the owned path: hold inside the background save
                self._save(output_dir, state_dict=staged["model"])
                hold(out_dir, step)
            super()._snapkeep_write(output_dir, step, staged, *rest)

    return Holding


class HoldBeforeMarker(hf.SnapkeepCallback):
    def __init__(self, out_dir: str, hold_at: int | None) -> None:
        super().__init__()
        self._out, self._at = out_dir, hold_at

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self._at:
            hold(self._out, self._at)
        return super().on_save(args, state, control, **kwargs)


def main(argv: list[str] | None = None) -> Trainer:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--eval-steps", type=int, default=None)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--load-best", action="store_true")
    p.add_argument("--greater-is-better", action="store_true",
                   help="rank eval_loss upside down, so the best is an early checkpoint")
    p.add_argument("--resume", choices=["none", "verified", "stock", "latest"],
                   default="none")
    p.add_argument("--memory", default=None, help="the owned save's memory tier root")
    p.add_argument("--callback", action="store_true")
    p.add_argument("--owned", action="store_true", help="hf.SnapkeepTrainer's async save")
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--hold-stage", default="model",
                   choices=["model", "optimizer", "state"])
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--stale", type=int, default=None,
                   help="leave a checkpoint-N of an earlier run in out_dir first")
    a = p.parse_args(argv)

    if a.stale is not None:  # an earlier run's leftover in a reused output_dir
        os.makedirs(os.path.join(a.out_dir, f"checkpoint-{a.stale}"), exist_ok=True)
        with open(os.path.join(a.out_dir, f"checkpoint-{a.stale}", "config.json"), "w") as f:
            f.write("{}")
        ahead = time.time() + 3600  # its clock ran ahead (another node, a sync): the Trainer
        os.utime(os.path.join(a.out_dir, f"checkpoint-{a.stale}"), (ahead, ahead))  # orders
        # by mtime, or by number when mtimes lie within 1 s: either way it looks newest
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=a.hidden, n_head=2, vocab_size=64, n_positions=SEQ)
    model = GPT2LMHeadModel(config)
    evaluating = a.eval_steps is not None
    args = TrainingArguments(
        output_dir=a.out_dir, max_steps=a.max_steps, per_device_train_batch_size=4,
        learning_rate=1e-2, save_strategy="steps", save_steps=a.save_steps,
        eval_strategy="steps" if evaluating else "no", eval_steps=a.eval_steps,
        metric_for_best_model="eval_loss" if evaluating else None,
        greater_is_better=a.greater_is_better if evaluating else None,
        load_best_model_at_end=a.load_best, save_total_limit=a.save_total_limit,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no", seed=0,
        dataloader_num_workers=0,
    )
    callbacks = []
    if a.callback:
        callbacks.append(HoldBeforeMarker(a.out_dir, a.hold_at if a.hold_stage == "state"
                                          else None))
    base: type = hf.SnapkeepTrainer if a.owned else Trainer
    cls = make_trainer_class(base, a.out_dir, a.hold_at, a.hold_stage)
    tier = {} if a.memory is None else {
        "memory": snapkeep.MemoryTier(every=1, replicas=0, root=a.memory)}
    trainer = cls(model=model, args=args, train_dataset=Tokens(64, 64, 1),
                  eval_dataset=Tokens(8, 64, 2) if evaluating else None, callbacks=callbacks,
                  **tier)
    resume: str | bool | None = None
    if a.resume == "verified":
        resume = hf.latest_verified(a.out_dir)
    elif a.resume == "latest":
        resume = True
    elif a.resume == "stock":
        resume = get_last_checkpoint(a.out_dir) if os.path.isdir(a.out_dir) else None
    print(f"resumed-from {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    print(f"best {trainer.state.best_model_checkpoint}", flush=True)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               os.path.join(a.out_dir, "final.pt"))
    return trainer


if __name__ == "__main__":
    main()
