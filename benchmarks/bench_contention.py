"""Is the second core free? What background work costs the free-core loop's step.

Times one iteration of ``bench_free_core.py``'s loop (1 torch thread: forward/backward,
Adam step, EMA update; median of ``--steps``) alone and while a second thread of the same
process (a) streams memory with 16 MiB ``memmove`` calls (GIL released, like snapkeep's staging
copy) or (b) runs small matmuls in a Python loop (takes the GIL between them); and, apart from
that, the wall time of a pure-Python CPU loop run alone and in two processes at once (do two
vCPUs give two cores' throughput?). Step wall time above the step's own thread CPU time is
time the training thread was runnable but not running (GIL, or the core taken).

Then, as a snapkeep worker process does while it writes: another process computing XXH3-128
over 8 MiB slices of a 256 MiB buffer, at full speed and paced (a pause after each slice);
**loss per GiB** = seconds the loop loses per GiB hashed (the pacing question: does the same
work cost the loop less when spread out?).

    python benchmarks/bench_contention.py
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_free_core import make  # noqa: E402


def _burn(n: int) -> float:
    t0, x = time.perf_counter(), 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t0


def _burn_into(n: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    q.put(_burn(n))


def _steps(step: Callable[[], None], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _hash(stop: object, pause_s: float, count: object) -> None:
    import numpy as np
    import xxhash

    buf = np.ones(256 << 20, dtype=np.uint8)
    done = 0
    while not stop.is_set():  # type: ignore[attr-defined]
        for off in range(0, buf.nbytes, 8 << 20):
            xxhash.xxh3_128(memoryview(buf[off:off + (8 << 20)])).digest()
            done += 8 << 20
            if pause_s:
                time.sleep(pause_s)
            if stop.is_set():  # type: ignore[attr-defined]
                break
    count.value = done  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model-mib", type=float, default=128)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--burn", type=int, default=20_000_000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, opt, ema = make(args.model_mib, 2048)
    x = torch.randn(args.batch, 2048)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.01)

    for _ in range(2):
        step()
    src = torch.ones(512 << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    stop = threading.Event()

    def stream() -> None:
        chunk = 16 << 20
        while not stop.is_set():
            for off in range(0, src.nbytes, chunk):
                ctypes.memmove(dst.data_ptr() + off, src.data_ptr() + off, chunk)

    def spin() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            a @ a

    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("| background | step s | step's thread CPU s |\n|---|---:|---:|")
    backgrounds: list[tuple[str, Callable[[], None] | None]] = [
        ("none", None), ("memory stream (GIL released)", stream),
        ("small matmuls (takes the GIL)", spin), ("none, again", None)]
    for name, target in backgrounds:
        stop.clear()
        thread = threading.Thread(target=target) if target else None
        if thread:
            thread.start()
        walls, cpus = [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            step()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
        stop.set()
        if thread:
            thread.join()
        print(f"| {name} | {statistics.median(walls):.3f} | {statistics.median(cpus):.3f} |")
    print("\n| XXH3 in another process | hash GiB/s | step s | loop loss per GiB hashed s |"
          "\n|---|---:|---:|---:|")
    base = statistics.median([_steps(step, args.steps) for _ in range(2)])
    print(f"| none | - | {base:.3f} | - |")
    for pause_ms in (0, 1, 2, 4, 0, 2):
        stop_p = mp.Event()
        count = mp.Value("q", 0)
        proc = mp.Process(target=_hash, args=(stop_p, pause_ms / 1000, count))
        proc.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        s = _steps(step, args.steps)
        elapsed = time.perf_counter() - t0
        stop_p.set()
        proc.join()
        rate = count.value / (1 << 30) / (elapsed + 0.5)  # it hashed from 0.5 s before the steps
        loss = args.steps * (s - base) / max(rate * elapsed, 1e-9)
        print(f"| {'full speed' if not pause_ms else f'{pause_ms} ms pause per 8 MiB'} | "
              f"{rate:.1f} | {s:.3f} | {loss:.3f} |")
    alone = _burn(args.burn)
    q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    procs = [mp.Process(target=_burn_into, args=(args.burn, q)) for _ in range(2)]
    for proc in procs:
        proc.start()
    both = sorted(q.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    print(f"\nPython CPU loop: alone {alone:.2f} s; two processes at once "
          f"{both[0]:.2f} s and {both[1]:.2f} s (x{max(both) / alone:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
