"""A plain loop with ``Checkpointer(incremental=True)`` for the incremental kill trials
(``support.incremental_trials``): a frozen backbone of four 1 MiB layers and a trainable 2 MiB
head under AdamW, a snapshot every step (``keep=2``: every save writes the head's blobs, and
retention deletes the blobs of the snapshot it drops).

    python incremental_worker.py OUT --steps N             # prints starting/resumed/saved/final
    python incremental_worker.py OUT --steps N --reference # prints 'state STEP DIGEST' per step
    python incremental_worker.py OUT --steps N --staging-budget B  # full snapshots, B bytes of
                                                                   # staging (issue 34)

Batches depend on the step only, so a resumed run continues as the uninterrupted one.
"""

from __future__ import annotations

import argparse
import sys

import torch
import xxhash

from snapkeep import Checkpointer


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    backbone = [torch.nn.Linear(512, 512, bias=False) for _ in range(4)]
    model = torch.nn.Sequential(*backbone, torch.nn.Linear(512, 1024))
    for layer in backbone:
        layer.weight.requires_grad_(False)
    return model, torch.optim.AdamW(model[4].parameters(), lr=1e-3)


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    hasher = xxhash.xxh3_128()
    for _, value in sorted(model.state_dict().items()):
        hasher.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for _, state in sorted(optim.state_dict()["state"].items()):
        for _, value in sorted(state.items()):
            hasher.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return str(hasher.hexdigest())


def step_once(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--staging-budget", type=int, default=None)
    args = parser.parse_args()
    model, optim = build()
    if args.reference:
        print(f"state 0 {digest(model, optim)}", flush=True)
        for step in range(1, args.steps + 1):
            step_once(model, optim, step)
            print(f"state {step} {digest(model, optim)}", flush=True)
        return
    print("starting", flush=True)
    state = {"model": model, "optim": optim}
    budget = args.staging_budget
    with Checkpointer(args.out, keep=2, incremental=budget is None,
                      staging_budget=budget) as ckpt:
        start = ckpt.load(state) or 0
        print(f"resumed {start} {digest(model, optim)}", flush=True)
        for step in range(start + 1, args.steps + 1):
            step_once(model, optim, step)
            ckpt.save(step, state)
            print(f"saved {step}", flush=True)
    print(f"final {digest(model, optim)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
