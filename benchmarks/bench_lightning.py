"""What does a Lightning checkpoint cost the training loop? (issue 26)

Three ``CheckpointIO`` plugins, in one run, on the same checkpoint dict (Lightning's layout:
``state_dict`` + Adam's ``optimizer_states``, ``--model-mib`` MiB of float32 parameters, about
3x that in all):

- ``TorchCheckpointIO``: Lightning's default (``_atomic_save``: ``torch.save`` into memory, then
  the bytes to the file); the save blocks for all of it;
- ``AsyncCheckpointIO``: Lightning's async wrapper around it: clones every tensor on the
  caller's thread (on a GPU: on the GPU), then the same save on a thread pool;
- ``SnapkeepCheckpointIO``: snapkeep's door with its default ThreadWriter (a CPU copy into
  reused buffers, committed in the background with fsync and a checksum manifest).

Each plugin runs in its own process (so its peak memory is its own), ``--saves`` saves, each
followed by ``--gap-steps`` "training steps" (an in-place update of every tensor, as an
optimizer step writes them) and the removal of the previous checkpoint (``save_top_k=1``); then
``teardown()`` (drain). The processes run in ABBA order over ``--rounds`` (A B C C B A ...), so
the load drift of a shared machine spreads over all three.

Reported per plugin: the stall (seconds ``save_checkpoint`` blocks), median over the saves after
the first of every round, and the first save's (buffers allocated) apart; the peak resident host
memory above the live state (anonymous RSS of the process, sampled every 20 ms from the first
save to the end of the drain), median over rounds; the drain at teardown; each median divided by
snapkeep's.

With ``--device cuda`` the state lives on the GPU and each plugin's peak GPU memory above the
state (``torch.cuda.max_memory_allocated``, reset before the first save) is reported too: the
figure of issue 26 (``AsyncCheckpointIO`` clones every tensor on the GPU; snapkeep stages into
pinned host buffers). Not measured on the benchmarks' VM (no GPU): see the README's lower bound.

Usage: ``python benchmarks/bench_lightning.py --model-mib 96 --saves 5 --rounds 2``
(3 x 96 MiB = 288 MiB of state) [``--device cuda``].
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import TreeMemory, table  # noqa: E402

MIB = 1 << 20
PLUGINS = ("torch", "async", "snapkeep")
LABELS = {"torch": "TorchCheckpointIO", "async": "AsyncCheckpointIO",
          "snapkeep": "SnapkeepCheckpointIO"}


def _checkpoint(model_mib: int, device: str = "cpu") -> dict[str, Any]:
    """A Lightning-shaped checkpoint: 8 parameters, Adam's two moments for each, on
    ``device``."""
    numel = model_mib * MIB // 4 // 8
    params = {f"layer{i}.weight": torch.randn(numel, device=device) for i in range(8)}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(numel, device=device),
                 "exp_avg_sq": torch.rand(numel, device=device)} for i in range(8)}
    return {"epoch": 0, "global_step": 10, "pytorch-lightning_version": "2.6",
            "state_dict": params,
            "optimizer_states": [{"state": state, "param_groups": [
                {"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(8))}]}],
            "lr_schedulers": [], "callbacks": {}, "loops": {}}


def _plugin(name: str) -> Any:
    if name == "torch":
        from lightning.fabric.plugins import TorchCheckpointIO

        return TorchCheckpointIO()
    if name == "async":
        from lightning.fabric.plugins import TorchCheckpointIO
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        return AsyncCheckpointIO(TorchCheckpointIO())
    from snapkeep.lightning import SnapkeepCheckpointIO

    return SnapkeepCheckpointIO()


def _tensors(checkpoint: dict[str, Any]) -> list[torch.Tensor]:
    out = list(checkpoint["state_dict"].values())
    for s in checkpoint["optimizer_states"][0]["state"].values():
        out += [s["exp_avg"], s["exp_avg_sq"]]
    return out


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    cuda = args.device.startswith("cuda")
    checkpoint = _checkpoint(args.model_mib, args.device)
    tensors = _tensors(checkpoint)
    io = _plugin(args.child)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    gpu_base = torch.cuda.memory_allocated() if cuda else 0
    memory = TreeMemory()
    base = memory.current_bytes(refresh=True)
    memory.start_window()
    stalls: list[float] = []
    previous = None
    for i in range(args.saves):
        path = os.path.join(args.dir, f"epoch=0-step={i}.ckpt")
        checkpoint["global_step"] = i
        start = time.perf_counter()
        io.save_checkpoint(checkpoint, path)
        stalls.append(time.perf_counter() - start)
        if previous is not None:
            io.remove_checkpoint(previous)
        previous = path
        for _ in range(args.gap_steps):  # training: every tensor updated in place
            for t in tensors:
                t.add_(1e-3)
    start = time.perf_counter()
    io.teardown()
    drain_s = time.perf_counter() - start
    memory.end_window()
    gpu_peak = torch.cuda.max_memory_allocated() - gpu_base if cuda else 0
    print(json.dumps({"stalls": stalls, "drain_s": drain_s,
                      "extra_peak_bytes": memory.peak_bytes - base,
                      "extra_gpu_peak_bytes": gpu_peak}))
    memory.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=int, default=96)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--gap-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--device", default="cpu", help="where the state lives (cuda: GPU "
                        "memory above the state reported too)")
    parser.add_argument("--child", choices=PLUGINS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    root = args.dir or tempfile.mkdtemp(prefix="bench-lightning-", dir=os.getcwd())
    order: list[str] = []
    for r in range(args.rounds):
        order += list(PLUGINS) if r % 2 == 0 else list(reversed(PLUGINS))
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in PLUGINS}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    try:
        for n, name in enumerate(order):
            directory = os.path.join(root, f"{n}-{name}")
            os.makedirs(directory)
            run = subprocess.run(
                [sys.executable, __file__, "--child", name, "--dir", directory,
                 "--model-mib", str(args.model_mib), "--saves", str(args.saves),
                 "--gap-steps", str(args.gap_steps), "--device", args.device],
                env=env, capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise SystemExit(f"{name} failed:\n{run.stderr[-3000:]}")
            results[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
            shutil.rmtree(directory)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    state_mib = 3 * args.model_mib
    rows = []
    medians = {}
    for name in PLUGINS:
        runs = results[name]
        stall = statistics.median(s for r in runs for s in r["stalls"][1:])
        first = statistics.median(r["stalls"][0] for r in runs)
        peak = statistics.median(r["extra_peak_bytes"] for r in runs) / MIB
        drain = statistics.median(r["drain_s"] for r in runs)
        gpu = statistics.median(r["extra_gpu_peak_bytes"] for r in runs) / MIB
        medians[name] = (stall, peak)
        rows.append({"plugin": LABELS[name], "stall": stall, "first": first, "peak": peak,
                     "drain": drain, "gpu": gpu})
    for row, name in zip(rows, PLUGINS, strict=True):
        row["stall_x"] = medians[name][0] / medians["snapkeep"][0]
        row["peak_x"] = medians[name][1] / max(medians["snapkeep"][1], 1.0)
    print(f"state {state_mib} MiB ({args.model_mib} MiB of parameters + Adam), "
          f"{args.saves} saves x {args.rounds} rounds (ABBA), {args.gap_steps} in-place steps "
          f"between saves; {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"state on {args.device}")
    columns = [("plugin", "plugin", "s"), ("stall", "stall/save s (median)", ".3f"),
               ("stall_x", "x snapkeep", ".1f"), ("first", "first save s", ".3f"),
               ("peak", "peak host MiB above state", ".0f"),
               ("peak_x", "x snapkeep", ".2f"), ("drain", "teardown s", ".2f")]
    if args.device.startswith("cuda"):
        columns.append(("gpu", "peak GPU MiB above state", ".0f"))
    print(table(rows, columns))


if __name__ == "__main__":
    main()
