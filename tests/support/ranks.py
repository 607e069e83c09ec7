"""Start the ranks of a gloo job as subprocesses, bounded in time, leaving none behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[2] / "src")
TESTS = str(Path(__file__).resolve().parents[1])  # workers import tests/support too


def say(*words: object) -> None:
    """Print ``words`` as one line, in one write, flushed. torchrun starts each rank as
    ``python -u``, where ``print`` writes every word and the newline apart: two ranks on one
    pipe came out as ``pausedstep 6`` (a CI run's failure, and 2 in 5 runs here)."""
    sys.stdout.write(" ".join(str(word) for word in words) + "\n")
    sys.stdout.flush()


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([SRC, TESTS] + ([path] if path else [])),
               PYTHONWARNINGS="ignore")
    env.update(extra or {})
    return env


#: What the ranks' zygote imports once (tests/support/zygote.py): ~2.8 CPU-s a rank process
#: would spend importing them itself.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "snapkeep", "snapkeep.training", "snapkeep.sharded_checkpoint")


def start(script: Path, world_size: int, args: Sequence[str], *,
          env: dict[str, str] | None = None, ranks: Sequence[int] | None = None,
          ) -> list[Any]:
    """Start ``script RANK WORLD_SIZE *args`` for each rank (all by default), each a process
    of its own in a session of its own, stdout and stderr together in ``.stdout``: forked by
    this test process's zygote of that rank, which imported torch and snapkeep once
    (:class:`support.zygote.ForkedPopen`, the ``subprocess.Popen`` interface)."""
    from support.zygote import ForkedPopen, shared_all

    environment = rank_env(env)
    chosen = list(range(world_size) if ranks is None else ranks)
    # one zygote per rank: each rank's interpreter has its own str hash seed, as in a real job
    # (an order of a set of names that differs between ranks must still agree); all ready
    # before the first rank starts
    zygotes = shared_all(PRELOAD, environment, [f"rank{rank}" for rank in chosen])
    return [ForkedPopen(forks, str(script), [str(rank), str(world_size), *args],
                        env=environment)
            for forks, rank in zip(zygotes, chosen)]


def finish(procs: Sequence[Any], timeout_s: float) -> list[str]:
    """Wait for every process (``timeout_s`` in all, then kill them); return their outputs."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return outputs


def run(script: Path, world_size: int, args: Sequence[str], *, timeout_s: float,
        env: dict[str, str] | None = None) -> list[str]:
    """Run every rank to the end; fail (with the outputs) when one exits non-zero."""
    procs = start(script, world_size, args, env=env)
    outputs = finish(procs, timeout_s)
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        if proc.returncode != 0:
            raise AssertionError(f"rank {rank} exited with {proc.returncode}:\n{output}")
    return outputs


def reports(report_dir: Path, prefix: str, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((report_dir / f"{prefix}_rank{r}.json").read_text())
            for r in range(world_size)]


def torchrun(script: Path, args: Sequence[str], *, nproc: int = 2,
             env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``torchrun --standalone --nproc-per-node=NPROC script *args`` in its own session,
    stdout and stderr together in ``.stdout``."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(script), *args],
        env=rank_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def torchrun_forked(script: Path, args: Sequence[str], *, nproc: int = 2,
                    env: dict[str, str] | None = None) -> list[Any]:
    """The ranks ``torchrun --standalone --nproc-per-node=NPROC script *args`` would start, with
    the environment ``init_process_group``'s ``env://`` reads from torchrun (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``: rank 0 hosts the store), forked by this test process's rank zygotes: no
    agent, no interpreter start and no torch import per rank (~8 CPU-s a launch). For the
    uninterrupted reference run of a test, where torchrun itself is not what it checks; no
    ``TORCHELASTIC_RUN_ID``, so snapkeep does not take the ranks for torchrun's (no launcher
    watch). Each rank's ``.stdout`` as in :func:`start`."""
    from support.storage_backends import free_port
    from support.zygote import ForkedPopen, shared_all

    environment = rank_env(env)
    port = str(free_port())
    zygotes = shared_all(PRELOAD, environment, [f"rank{rank}" for rank in range(nproc)])
    return [ForkedPopen(forks, str(script), [str(arg) for arg in args],
                        env={**environment, "RANK": str(rank), "LOCAL_RANK": str(rank),
                             "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                             "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": port})
            for rank, forks in enumerate(zygotes)]


def run_torchrun_forked(script: Path, args: Sequence[str], *, timeout_s: float, nproc: int = 2,
                        env: dict[str, str] | None = None) -> str:
    """:func:`torchrun_forked` run to the end; fail (with the outputs) when a rank exits
    non-zero. Returns the ranks' outputs, one after the other."""
    import threading

    procs = torchrun_forked(script, args, nproc=nproc, env=env)
    outputs = [""] * nproc

    def read(rank: int) -> None:  # every rank's pipe read at once: none blocks on a full one
        outputs[rank] = procs[rank].communicate(timeout=timeout_s)[0]

    readers = [threading.Thread(target=read, args=(rank,), daemon=True) for rank in range(nproc)]
    try:
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        if proc.returncode != 0:
            raise AssertionError(f"rank {rank} exited with {proc.returncode}:\n{output}")
    return "".join(outputs)
