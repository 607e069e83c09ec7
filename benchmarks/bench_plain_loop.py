"""How long does a save stop a plain PyTorch loop? (issue 20)

The three ways of the docs' "A plain PyTorch loop" page, on the same state (a model of
``--model-mib`` MiB of float32 parameters trained with AdamW: about 3x that in state), in one
run:

- ``torch.save``: ``torch.save({'model': ..., 'optimizer': ...}, path)`` in the loop (blocks for
  the whole write; no fsync, as users write it);
- ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` of the same state dicts (gloo
  group of size 1), one save in flight;
- ``snapkeep Checkpointer``: ``Checkpointer.save(step, state)`` with the default ThreadWriter
  (staged CPU copy, written in the background; RNG capture on).

Each round runs one optimizer step then one save per method, in rotating order (ABC, BCA, CAB)
so that the load drift of a shared machine spreads over all three; after each save the script
waits until it is durable before the next step, outside the timing. Reported: the stall (seconds
the save call blocks), median over rounds after the first (the first allocates buffers, shown
apart), and each method's median stall divided by snapkeep's.

Usage: ``python benchmarks/bench_plain_loop.py --model-mib 200 --rounds 6``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import snapkeep

MIB = 1 << 20


def build(model_mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of linear layers of ``model_mib`` MiB of float32 parameters, and AdamW stepped
    once (its two state tensors per parameter exist)."""
    width = 2048
    layers = max(1, model_mib * MIB // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, optim)
    return model, optim


def step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()


def state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in optim.state.values():
        total += sum(v.numel() * v.element_size() for v in s.values()
                     if isinstance(v, torch.Tensor))
    return total


class Method:
    name = ""

    def save(self, step_n: int) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        """Block until the last save is durable (outside the timing)."""

    def close(self) -> None:
        self.wait()


class TorchSave(Method):
    name = "torch.save"

    def __init__(self, out: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.out, self.model, self.optim = out, model, optim

    def save(self, step_n: int) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optim.state_dict(),
                    "step": step_n}, os.path.join(self.out, f"ckpt_{step_n}.pt"))


class DcpAsync(Method):
    name = "DCP async_save"

    def __init__(self, out: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.out, self.model, self.optim = out, model, optim
        self.future: Any = None

    def save(self, step_n: int) -> None:
        if self.future is not None:
            self.future.result()
        self.future = dcp.async_save(
            {"model": self.model.state_dict(), "optimizer": self.optim.state_dict()},
            checkpoint_id=os.path.join(self.out, f"step_{step_n}"))

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None


class Snapkeep(Method):
    name = "snapkeep Checkpointer"

    def __init__(self, out: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.ckpt = snapkeep.Checkpointer(out, keep=2)
        self.state = {"model": model, "optimizer": optim}

    def save(self, step_n: int) -> None:
        self.ckpt.save(step_n, self.state)

    def wait(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()


def timed(fn: Callable[[int], None], step_n: int) -> float:
    start = time.perf_counter()
    fn(step_n)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=6, help="saves per method (first apart)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, optim = build(args.model_mib)
    size = state_bytes(model, optim)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-plain-") as root:
        kinds: list[type[Method]] = [TorchSave, DcpAsync, Snapkeep]
        methods: list[Method] = []
        for i, kind in enumerate(kinds):
            out = os.path.join(root, str(i))
            os.makedirs(out)
            methods.append(kind(out, model, optim))
        stalls: dict[str, list[float]] = {m.name: [] for m in methods}
        for r in range(args.rounds):
            order = methods[r % 3:] + methods[:r % 3]
            for method in order:
                step(model, optim)
                stalls[method.name].append(timed(method.save, r))
                method.wait()
                if isinstance(method, TorchSave):  # keep the disk usage flat
                    os.remove(os.path.join(method.out, f"ckpt_{r}.pt"))
        for method in methods:
            method.close()
    dist.destroy_process_group()
    later = {name: statistics.median(values[1:]) for name, values in stalls.items()}
    base = later["snapkeep Checkpointer"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"state {size / MIB:.0f} MiB (model {args.model_mib} MiB + AdamW), {args.rounds} "
          f"saves per method, torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {load:.1f}")
    print()
    print("| method | first save stall s | stall s (median of later) | min-max s | "
          "stall / snapkeep |")
    print("|---|---:|---:|---:|---:|")
    for name, values in stalls.items():
        rest = values[1:]
        print(f"| {name} | {values[0]:.3f} | {later[name]:.3f} | {min(rest):.3f}-{max(rest):.3f}"
              f" | {later[name] / base:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
