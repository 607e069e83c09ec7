"""The victim of the crash trials: a training run that snapshots every iteration until killed.

Run as ``python tools/crash_child.py child --out DIR`` (one fresh interpreter per run) or as
``python tools/crash_child.py zygote`` (a fork server: it imports torch and snapkeep once, then
forks one training child per ``run DIR ...`` line read on stdin, printing ``pid N`` and, when the
child has ended, ``exit N STATUS``). Forking from a process that has run no torch op keeps
trials fast; the children are ordinary processes, killed with a real SIGKILL.

Each run resumes with ``autoload`` from DIR, checks what it loaded and prints one line::

    ready pid=N loaded=STEP verified=0|1 consistent=0|1 temps=K name=FILE

(``loaded=0 name=-`` on the first run), then trains forever, one snapshot per iteration, printing
``begin STEP`` as each save starts. Every
parameter equals :func:`expected_param` of the step, so a loaded snapshot is checked against its
own step. Two records are appended to files in DIR's parent, flushed before the next step:
``begun.log`` (``STEP`` when the save of STEP starts) and ``committed.log`` (``STEP NAME
CHECKSUM``, from a post-commit hook, i.e. after the snapshot and its manifest are durable).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
from typing import Any

import torch

import snapkeep
from snapkeep._core.storage import TEMP_MARKER
from snapkeep.store import SnapshotStore as Catalog
from snapkeep.store import ppe_template
from snapkeep.training import ExtensionsManager, extensions

TEMPLATE = "snapshot_iter_{.iteration}"
WIDTH = 1024  # a 4 MiB weight: a save (torch.save + fsync + manifest) takes ~40 ms here
N_RETAINS = 3


@functools.lru_cache(maxsize=8)
def _pattern(shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(math.prod(shape), dtype=torch.float32) % 97).reshape(shape)


def expected_param(step: int, shape: torch.Size) -> torch.Tensor:
    """The value of a parameter of ``shape`` after ``step`` iterations."""
    return _pattern(tuple(shape)) + float(step)


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()


def _temps(directory: str) -> int:
    count = 0
    for _root, _dirs, files in os.walk(directory):
        count += sum(1 for name in files if TEMP_MARKER in name)
    return count


def run(out: str, writer_kind: str = "simple") -> None:
    """Resume from ``out`` (if anything is there), report, then train until killed."""
    torch.set_num_threads(1)
    logs = os.path.dirname(os.path.abspath(out))
    begun, committed = os.path.join(logs, "begun.log"), os.path.join(logs, "committed.log")

    def savefun(obj: Any, f: Any) -> None:
        step = int(obj["_start_iteration"])
        _append(begun, str(step))
        print(f"begin {step}", flush=True)  # the driver times its kill from this line
        torch.save(obj, f)

    if writer_kind == "simple":
        writer: Any = snapkeep.writing.SimpleWriter(savefun=savefun, out_dir=out)
    elif writer_kind == "thread":
        writer = snapkeep.writing.ThreadWriter(savefun=savefun, out_dir=out)
    else:
        raise ValueError(f"writer must be 'simple' or 'thread', got {writer_kind!r}")
    model = torch.nn.Linear(WIDTH, WIDTH)
    # No torch.optim optimizer: building the first one imports torch._dynamo, seconds per
    # process; the parameters are set directly, and the save path is the same.
    manager = ExtensionsManager(model, {}, 10**9, iters_per_epoch=1, writer=writer)
    ext = extensions.snapshot(filename=TEMPLATE, autoload=True, n_retains=N_RETAINS)
    manager.extend(ext, trigger=(1, "iteration"))

    def record(rec: Any) -> None:
        _append(committed, f"{rec.step} {os.path.basename(rec.path)} {rec.checksum}")

    writer.add_post_commit_hook(record)
    manager.start_extensions()  # autoload; stale temps of the killed run are removed
    step = manager.iteration
    consistent = all(torch.equal(p, expected_param(step, p.shape)) for p in model.parameters())
    entry = ext.loaded_entry
    verified = 0
    if entry is not None:
        storage, directory = writer.storage_for(out)
        catalog = Catalog(storage, directory, ppe_template(TEMPLATE))
        verified = int(catalog.manifest(entry) is not None)
    print(f"ready pid={os.getpid()} loaded={step} verified={verified} "
          f"consistent={int(consistent)} temps={_temps(out)} "
          f"name={entry.name if entry is not None else '-'}", flush=True)
    while True:
        with manager.run_iteration():
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(expected_param(manager.iteration + 1, p.shape))


def _warm_up() -> None:
    """One intra-op thread, so that no thread pool exists when forking."""
    torch.set_num_threads(1)


def zygote() -> None:
    """Fork server: ``run OUT WRITER`` on stdin forks a child running :func:`run`."""
    _warm_up()
    print("serving", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] != "run" or len(parts) != 3:
            print(f"error unknown command {line.strip()!r}", flush=True)
            continue
        pid = os.fork()
        if pid == 0:  # the child: never returns into the server loop
            status = 0
            try:
                sys.stdin.close()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                run(parts[1], parts[2])
            except BaseException as e:  # reported to the driver, which fails the trial
                print(f"failed pid={os.getpid()} {type(e).__name__}: {e}", flush=True)
                status = 1
            finally:
                os._exit(status)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    child = sub.add_parser("child", help="one training run in this process")
    child.add_argument("--out", required=True)
    child.add_argument("--writer", default="simple", choices=["simple", "thread"])
    sub.add_parser("zygote", help="fork server reading 'run OUT WRITER' lines on stdin")
    args = parser.parse_args(argv)
    if args.mode == "child":
        try:
            run(args.out, args.writer)
        except Exception as e:
            print(f"failed pid={os.getpid()} {type(e).__name__}: {e}", flush=True)
            raise
    else:
        zygote()


if __name__ == "__main__":
    main()
