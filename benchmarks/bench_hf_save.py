"""Training-thread stall per checkpoint save of a Hugging Face Trainer: the stock save, the stock
save plus ``snapkeep.hf.SnapkeepCallback`` (marker: every file hashed and fsynced), and
``snapkeep.hf.SnapkeepTrainer`` (the owned save: staged, written on a background thread).

A GPT-2 built in code (CPU; default 8 layers, hidden 512, vocab 8192: 29 M parameters, ~0.35 GB
with AdamW's state), a checkpoint every ``--save-steps`` steps. Stall = wall time the training
thread spends in ``Trainer._save_checkpoint`` plus the callbacks' ``on_save``. Runs in ABBA
order (stock, callback, owned, owned, callback, stock, ...) in one process; medians over every
save of every run.

    PYTHONPATH=src python benchmarks/bench_hf_save.py [--rounds 2] [--saves 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from snapkeep import hf  # noqa: E402

SEQ = 32


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def timed(base: type, stalls: list[float]) -> type:
    class Timed(base):  # type: ignore[misc,valid-type]
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            start = time.perf_counter()
            super()._save_checkpoint(model, trial)
            stalls.append(time.perf_counter() - start)

    return Timed


class TimedCallback(hf.SnapkeepCallback):
    def __init__(self, stalls: list[float]) -> None:
        super().__init__()
        self.stalls = stalls

    def on_save(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_save(*args, **kwargs)
        self.stalls[-1] += time.perf_counter() - start


def one_run(kind: str, a: argparse.Namespace, root: str) -> tuple[list[float], float, int]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=a.layers, n_embd=a.hidden, n_head=8, vocab_size=a.vocab,
                        n_positions=SEQ)
    model = GPT2LMHeadModel(config)
    out = tempfile.mkdtemp(dir=root)
    steps = a.saves * a.save_steps
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=a.save_steps, save_total_limit=2, report_to=[], use_cpu=True,
        disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0)
    stalls: list[float] = []
    base = hf.SnapkeepTrainer if kind == "owned" else Trainer
    callbacks = [TimedCallback(stalls)] if kind == "callback" else []
    trainer = timed(base, stalls)(model=model, args=args, train_dataset=Tokens(4 * steps,
                                                                                a.vocab),
                                  callbacks=callbacks)
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs) \
        // max(1, len(os.listdir(out)))
    return stalls, total, size


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    a = p.parse_args()
    torch.set_num_threads(1)
    kinds = ["stock", "callback", "owned"]
    stalls: dict[str, list[float]] = {k: [] for k in kinds}
    totals: dict[str, list[float]] = {k: [] for k in kinds}
    size = 0
    with tempfile.TemporaryDirectory() as root:
        for r in range(a.rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                s, total, size = one_run(kind, a, root)
                stalls[kind] += s
                totals[kind].append(total)
    base = statistics.median(stalls["stock"])
    print(f"checkpoint size {size / 2**20:.0f} MiB, {a.saves} saves x {a.rounds} rounds per "
          f"kind, torch threads 1")
    print(f"{'save path':<34}{'stall/save (median s)':>22}{'vs stock':>10}"
          f"{'run (median s)':>16}")
    names = {"stock": "stock Trainer", "callback": "stock + SnapkeepCallback",
             "owned": "SnapkeepTrainer (async)"}
    for kind in kinds:
        med = statistics.median(stalls[kind])
        print(f"{names[kind]:<34}{med:>22.3f}{med / base:>10.2f}"
              f"{statistics.median(totals[kind]):>16.2f}")


if __name__ == "__main__":
    main()
