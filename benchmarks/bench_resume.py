"""Resume speed: snapkeep's autoload against ``torch.load`` (+ ``load_state_dict``), with and
without ``mmap=True``, and a plain read of the file, warm and cold page cache (issue 12, item 4).

The parent saves one manager snapshot of ``--state-gib`` (a model of 1/3 of it in 8 float32
tensors plus Adam's ``exp_avg``/``exp_avg_sq``) with snapkeep's ``SimpleWriter`` (so it has its
checksum manifest), then runs every contender ``--reps`` times, each in a fresh child process
(a model, a fresh Adam and, for autoload, the manager already built, as in a restarted
trainer), in ABBA order. Each child
times only the resume and reports its peak RSS (anonymous + file-backed pages, so
mapped file pages count, from ``VmHWM``) and its RSS before the resume.
**cold** drops the file's pages from the
page cache first (``fsync`` + ``posix_fadvise(DONTNEED)``). Linux only.

    python benchmarks/bench_resume.py --state-gib 1 --reps 2 --json results/resume.json

``--doors`` adds every door of snapkeep (ppe extension, ``Checkpointer`` full and incremental,
``load_latest``, Lightning's ``load_checkpoint``, HF's ``latest_verified`` + the Trainer's
reads) and the stock Lightning and HF loads of the same state, each with its ratio to
``torch.load(mmap=True)`` + ``load_state_dict`` (of the medians, and the median of the ratios
paired by repetition) and, for the framework doors, to its stock load:

    python benchmarks/bench_resume.py --state-gib 0.5 --reps 4 --doors --cache warm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from _measure import GIB, median, table

from snapkeep.training import ExtensionsManager, extensions
from snapkeep.writing import SimpleWriter

CONTENDERS = ("torch.load", "torch.load(mmap=True)", "DCP load", "snapkeep autoload",
              "read file", "xxh3 of the file")
#: Every door of snapkeep over the same state (``--doors``), each timed from the door's
#: construction (the manager with its default-style ThreadWriter, the Checkpointer) to every
#: optimizer page resident, as a restarted trainer sees it (issue 24's cold-resume target).
DOORS = ("door: extension autoload (ThreadWriter; built in the timing)",
         "door: Checkpointer.load", "door: load_latest + load_state_dict",
         "door: Lightning load_checkpoint", "door: Checkpointer.load (incremental)",
         "door: HF latest_verified + Trainer's load")
#: What the framework doors do without snapkeep, on the same state (``--doors``): Lightning's
#: ``TorchCheckpointIO.load_checkpoint`` (``torch.load``) and the HF Trainer's resume reads
#: (safetensors ``load_file`` of the model, ``torch.load`` of ``optimizer.pt``).
STOCK = ("stock: Lightning TorchCheckpointIO", "stock: HF Trainer's load")
#: How snapkeep could verify and load (``--variants``): the choice behind autoload's path.
VARIANTS = ("one pass into new storages", "read+hash then mmap load",
            "mmap+hash then mmap load")
N_PARAMS = 8


def make_model(state_gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    per = max(1024, int(state_gib * GIB / 3 / 4 / N_PARAMS) // 1024 * 1024)
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(per // 1024, 1024)) for _ in range(N_PARAMS)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def manager_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: str,
                autoload: bool) -> Any:
    manager = ExtensionsManager({"main": model}, {"main": optimizer}, max_epochs=1,
                                iters_per_epoch=1000, writer=SimpleWriter(out_dir=out))
    manager.extend(extensions.snapshot(autoload=autoload), trigger=(1, "iteration"))
    return manager


def save(state_gib: float, out: str) -> str:
    model, optimizer = make_model(state_gib)
    manager = manager_for(model, optimizer, out, autoload=False)
    with manager.run_iteration(step_optimizers=["main"]):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, float(i + 1))
    manager.finalize()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "dcp"), no_dist=True)
    import snapkeep

    with snapkeep.Checkpointer(os.path.join(out, "ckpt"), writer=SimpleWriter()) as ckpt:
        ckpt.save(1, {"model": model, "optimizer": optimizer}, force=True)
    with snapkeep.Checkpointer(os.path.join(out, "incr"), incremental=True) as ckpt:
        ckpt.save(1, {"model": model, "optimizer": optimizer}, force=True)
    save_frameworks(model, optimizer, out)
    return os.path.join(out, "snapshot_iter_1")


def lightning_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                         ) -> dict[str, Any]:
    """The part of Lightning's checkpoint dict that holds the state."""
    return {"epoch": 0, "global_step": 1, "state_dict": model.state_dict(),
            "optimizer_states": [optimizer.state_dict()], "lr_schedulers": []}


def save_frameworks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: str) -> None:
    """The same state as a Lightning checkpoint (snapkeep's door and stock ``torch.save``) and
    an HF ``checkpoint-1`` directory (``model.safetensors``, ``optimizer.pt``, committed by
    snapkeep's marker)."""
    from safetensors.torch import save_file

    from snapkeep.hf import commit_checkpoint
    from snapkeep.lightning import SnapkeepCheckpointIO

    io = SnapkeepCheckpointIO()
    os.makedirs(os.path.join(out, "lightning"))
    io.save_checkpoint(lightning_checkpoint(model, optimizer),
                       os.path.join(out, "lightning", "epoch=0-step=1.ckpt"))
    io.teardown()
    os.makedirs(os.path.join(out, "lightning-stock"))
    torch.save(lightning_checkpoint(model, optimizer),
               os.path.join(out, "lightning-stock", "epoch=0-step=1.ckpt"))
    hf = os.path.join(out, "hf", "checkpoint-1")
    os.makedirs(hf)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(hf, "model.safetensors"))
    torch.save(optimizer.state_dict(), os.path.join(hf, "optimizer.pt"))
    commit_checkpoint(hf, step=1)


def door_files(contender: str, path: str) -> list[str]:
    """The files a contender reads (their pages are dropped or read before it runs)."""
    out = os.path.dirname(path)
    sub = {DOORS[1]: "ckpt", DOORS[3]: "lightning", DOORS[4]: "incr", DOORS[5]: "hf",
           STOCK[0]: "lightning-stock", STOCK[1]: "hf"}.get(contender)
    if sub is None:
        return [path]
    return [os.path.join(d, f) for d, _, files in os.walk(os.path.join(out, sub))
            for f in files if not f.endswith((".lock", ".json"))]


def hf_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: str) -> None:
    """What the HF Trainer reads on resume: the model's safetensors file and ``optimizer.pt``
    (``torch.load(weights_only=True)``), applied with ``load_state_dict``."""
    from safetensors.torch import load_file

    model.load_state_dict(load_file(os.path.join(checkpoint, "model.safetensors")))
    optimizer.load_state_dict(torch.load(os.path.join(checkpoint, "optimizer.pt"),
                                         map_location="cpu", weights_only=True))


def door_load(contender: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              path: str) -> None:
    """One of :data:`DOORS` (see there), quiet."""
    import snapkeep
    from snapkeep.writing import ThreadWriter

    out = os.path.dirname(path)
    if contender == DOORS[0]:
        manager = ExtensionsManager({"main": model}, {"main": optimizer}, max_epochs=1,
                                    iters_per_epoch=1000, writer=ThreadWriter(out_dir=out))
        manager.extend(extensions.snapshot(autoload=True, quiet=True), trigger=(1, "iteration"))
        manager.start_extensions()
        if manager.iteration != 1:
            raise RuntimeError(f"autoload did not resume (iteration {manager.iteration})")
        manager.finalize()
    elif contender == DOORS[1]:
        with snapkeep.Checkpointer(os.path.join(out, "ckpt")) as ckpt:
            if ckpt.load(into={"model": model, "optimizer": optimizer}) != 1:
                raise RuntimeError("Checkpointer.load did not resume")
    elif contender == DOORS[2]:
        state = snapkeep.load_latest(out)
        model.load_state_dict(state["models"]["main"])
        optimizer.load_state_dict(state["optimizers"]["main"])
        del state
    elif contender == DOORS[3]:
        from snapkeep.lightning import SnapkeepCheckpointIO

        io = SnapkeepCheckpointIO()
        ckpt = io.load_checkpoint(os.path.join(out, "lightning", "epoch=0-step=1.ckpt"))
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
        del ckpt
        io.teardown()
    elif contender == DOORS[4]:
        with snapkeep.Checkpointer(os.path.join(out, "incr"), incremental=True) as ckpt:
            if ckpt.load(into={"model": model, "optimizer": optimizer}) != 1:
                raise RuntimeError("Checkpointer.load (incremental) did not resume")
    elif contender == DOORS[5]:
        from snapkeep.hf import latest_verified

        checkpoint = latest_verified(os.path.join(out, "hf"), quiet=True)
        if checkpoint is None:
            raise RuntimeError("latest_verified found nothing")
        hf_load(model, optimizer, checkpoint)
    elif contender == STOCK[0]:
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        ckpt = TorchCheckpointIO().load_checkpoint(
            os.path.join(out, "lightning-stock", "epoch=0-step=1.ckpt"))
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
        del ckpt
    elif contender == STOCK[1]:
        hf_load(model, optimizer, os.path.join(out, "hf", "checkpoint-1"))
    else:
        raise ValueError(f"unknown door {contender!r}")


def dcp_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """DCP's documented resume: ``get_state_dict`` (which builds Adam's state), ``dcp.load``
    into it, ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(os.path.dirname(path), "dcp"), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def variant_load(variant: str, manager: Any, path: str) -> None:
    """One way to verify and load the snapshot into the built manager (``--variants``)."""
    from snapkeep._core.format.checksum import digest_file, digest_stream, require_match
    from snapkeep._core.load.loading import into_existing_state, load_file
    from snapkeep._core.load.one_pass import load_verified
    from snapkeep.store import open_store

    store = open_store(os.path.dirname(path), "snapshot_iter_{step}")
    entry = store.entries()[-1]
    manifest = store.expected(entry)
    if variant == "one pass into new storages":
        state = load_verified(path, checksum=manifest.checksum, size_bytes=manifest.size_bytes,
                              algorithm=manifest.algorithm)
    else:
        if variant == "read+hash then mmap load":
            with open(path, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                digest, size = digest_stream(f)
        else:
            digest, size = digest_file(path)
        require_match(path, digest, size, recorded_checksum=manifest.checksum,
                      recorded_size=manifest.size_bytes, algorithm=manifest.algorithm)
        state = load_file(store.storage, path)
    with into_existing_state(list(manager.optimizers.values())):
        manager.load_state_dict(state)


def make_resident(optimizer: torch.optim.Optimizer) -> None:
    """Read one byte of every page of the optimizer's state ("ready to train": nothing of it
    left on disk). Copy-on-write views of a mapped file stay shared with the page cache."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                value.reshape(-1).view(torch.uint8)[::4096].sum()


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _status_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` (peak RSS of this process image: anonymous + file-backed +
    shared pages, reset by exec, unlike ``ru_maxrss``, which a child inherits) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _read_all(path: str) -> None:
    buf = bytearray(8 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def child(contender: str, path: str, state_gib: float, cold: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, optimizer = make_model(state_gib)
    for cached in door_files(contender, path):
        if cold:
            drop_cache(cached)
        else:  # the whole file in the page cache (a cold mmap run before read only part of it)
            _read_all(cached)
    if contender in (DOORS[3], STOCK[0]):  # imported before the timing, as in a trainer
        import lightning.pytorch.plugins.io  # noqa: F401

        import snapkeep.lightning  # noqa: F401
    if contender in (DOORS[5], STOCK[1]):
        import safetensors.torch  # noqa: F401

        import snapkeep.hf  # noqa: F401
    before = _status_bytes("VmRSS")
    manager = manager_for(model, optimizer, os.path.dirname(path), autoload=True) \
        if contender == "snapkeep autoload" else None
    if contender in VARIANTS:
        manager = manager_for(model, optimizer, os.path.dirname(path), autoload=False)
    t0 = time.perf_counter()
    if contender in VARIANTS:
        variant_load(contender, manager, path)
    elif contender in DOORS or contender in STOCK:
        door_load(contender, model, optimizer, path)
    elif contender == "DCP load":
        dcp_load(model, optimizer, path)
    elif contender in ("torch.load", "torch.load(mmap=True)"):
        state = torch.load(path, weights_only=True, mmap=contender != "torch.load")
        model.load_state_dict(state["models"]["main"])
        optimizer.load_state_dict(state["optimizers"]["main"])
        del state
    elif manager is not None:  # snapkeep autoload: list, verify while loading, load in place
        manager.start_extensions()
        if manager.iteration != 1:
            raise RuntimeError(f"autoload did not resume (iteration {manager.iteration})")
    elif contender == "read file":
        _read_all(path)
    elif contender == "xxh3 of the file":  # the hash any verified resume adds (one core)
        from snapkeep._core.format.checksum import digest_file

        digest_file(path)
    else:
        raise ValueError(f"unknown contender {contender!r}")
    if contender not in ("read file", "xxh3 of the file"):
        make_resident(optimizer)
    elapsed = time.perf_counter() - t0
    step_s = None
    if contender not in ("read file", "xxh3 of the file"):  # the loaded values
        first = next(iter(model.parameters()))
        if float(first[0, 0]) == 0.0 or len(optimizer.state) != N_PARAMS \
                or float(optimizer.state[first]["exp_avg"][0, 0]) == 0.0:
            raise RuntimeError(f"{contender} did not load the state")
        for p in model.parameters():  # the first step writes every optimizer page
            p.grad = torch.zeros_like(p)
        t1 = time.perf_counter()
        optimizer.step()
        step_s = time.perf_counter() - t1
    peak = _status_bytes("VmHWM")
    return {"time_s": elapsed, "first_step_s": step_s, "rss_before": before, "peak_rss": peak}


#: First snapshot against later ones (``--first-snapshot``), each in a fresh process.
FIRST_SNAPSHOT = ("first snapshot: extension after resume", "first snapshot: direct writer",
                  "first snapshot: direct writer, prefault")
SNAPSHOT_EVERY = 8  # iterations between the extension's snapshots
N_SNAPSHOTS = 3
STEPS_BETWEEN = 2  # optimizer steps between two direct writer calls (training in between)


class _TimedWriter:
    """A ``ThreadWriter`` whose calls (the stall a snapshot puts on training) are timed."""

    def __new__(cls, **kwargs: Any) -> Any:
        from snapkeep.writing import ThreadWriter

        class Timed(ThreadWriter):
            stalls: list[float] = []

            def __call__(self, *args: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return super().__call__(*args, **kw)
                finally:
                    self.stalls.append(time.perf_counter() - t0)

        return Timed(**kwargs)


def first_touch_floor(nbytes: int) -> dict[str, float]:
    """Seconds to copy ``nbytes`` into fresh anonymous pages (each page faulted in and zeroed by
    the kernel on its first write: what a first snapshot's staging copy cannot avoid) and into
    the same pages once warm (what a later snapshot's copy costs)."""
    import ctypes
    import mmap

    src = torch.ones(nbytes // 4)
    fresh = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = (ctypes.c_char * nbytes).from_buffer(fresh)
    dst = ctypes.addressof(view)
    try:
        t0 = time.perf_counter()
        ctypes.memmove(dst, src.data_ptr(), nbytes)
        t1 = time.perf_counter()
        ctypes.memmove(dst, src.data_ptr(), nbytes)
        t2 = time.perf_counter()
    finally:
        del view
        fresh.close()
    return {"fresh_copy_s": t1 - t0, "warm_copy_s": t2 - t1}


def first_snapshot_child(contender: str, path: str, state_gib: float) -> dict[str, Any]:
    """Stall of each snapshot (seconds) after a restart: the extension resuming ``path`` and
    snapshotting every :data:`SNAPSHOT_EVERY` iterations (overlap off: the stall is the whole
    staging copy), or direct ``ThreadWriter`` calls on the built state with
    :data:`STEPS_BETWEEN` optimizer steps before each (``, prefault``: the script calls
    ``writer.prefault(...)`` once the state exists, before those steps). Direct runs also
    report :func:`first_touch_floor` for the state's bytes."""
    torch.set_num_threads(1)
    model, optimizer = make_model(state_gib)
    out = tempfile.mkdtemp(prefix="first-", dir=os.path.dirname(os.path.dirname(path)))
    try:
        writer = _TimedWriter(out_dir=out)
        floor: dict[str, float] = {}
        if contender.startswith("first snapshot: direct writer"):
            for p in model.parameters():  # Adam's state exists, as in a trainer
                p.grad = torch.ones_like(p)
            optimizer.step()

            def state() -> dict[str, Any]:
                return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

            if contender.endswith("prefault"):
                writer.prefault(state, [optimizer])
            for i in range(N_SNAPSHOTS):
                for _ in range(STEPS_BETWEEN):
                    optimizer.step()
                writer(f"direct_{i}", out, state())
                writer.wait()
            nbytes = sum(p.numel() * 3 * 4 for p in model.parameters())
            floor = first_touch_floor(nbytes)
        else:
            # the saved snapshot, seen from a new out_dir (so the runs do not write into it)
            os.symlink(path, os.path.join(out, os.path.basename(path)))
            manifests = os.path.join(out, ".snapkeep")
            os.makedirs(manifests)
            name = os.path.basename(path) + ".json"
            shutil.copy(os.path.join(os.path.dirname(path), ".snapkeep", name), manifests)
            manager = ExtensionsManager({"main": model}, {"main": optimizer}, max_epochs=1,
                                        iters_per_epoch=1000, writer=writer)
            manager.extend(extensions.snapshot(autoload=True, overlap=False),
                           trigger=(SNAPSHOT_EVERY, "iteration"))
            manager.start_extensions()
            while len(writer.stalls) < N_SNAPSHOTS:
                with manager.run_iteration(step_optimizers=["main"]):
                    for p in model.parameters():
                        p.grad = torch.full_like(p, 1e-3)
            manager.finalize()
        writer.finalize()
        return {"stalls_s": writer.stalls, **floor}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def summarize_first(contender: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of the first-snapshot table: medians over runs of the first stall, of the later
    stalls, of first / later, and (direct runs) of the first-touch floor, with
    ``bound`` = (later + fresh copy - warm copy) / later: the least first / later any staging
    into fresh pages can reach here."""
    firsts = [r["stalls_s"][0] for r in results]
    laters = [median(r["stalls_s"][1:]) for r in results]
    row: dict[str, Any] = {
        "case": contender.split(": ")[1], "first_s": median(firsts), "later_s": median(laters),
        "ratio": median([f / lt for f, lt in zip(firsts, laters)]),
        "stalls_s": [r["stalls_s"] for r in results]}
    if all("fresh_copy_s" in r for r in results):
        row["fresh_copy_s"] = median([r["fresh_copy_s"] for r in results])
        row["warm_copy_s"] = median([r["warm_copy_s"] for r in results])
        row["bound"] = median([(lt + r["fresh_copy_s"] - r["warm_copy_s"]) / lt
                               for lt, r in zip(laters, results)])
    return row


FIRST_COLUMNS = [("case", "case", ""), ("first_s", "first stall s", ".3f"),
                 ("later_s", "later stall s", ".3f"), ("ratio", "first / later", ".2f"),
                 ("fresh_copy_s", "copy into fresh pages s", ".3f"),
                 ("warm_copy_s", "copy into warm pages s", ".3f"),
                 ("bound", "least first / later", ".2f")]


def run_child(contender: str, path: str, state_gib: float, cold: bool) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, __file__, "--child", contender, "--path", path,
         "--state-gib", str(state_gib)] + (["--cold"] if cold else []),
        env=env, capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{contender} child failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=2, help="runs per contender and cache state")
    p.add_argument("--dir", default=None, help="where to save (default: a temp dir on disk)")
    p.add_argument("--json", default=None)
    p.add_argument("--cache", choices=("both", "cold", "warm"), default="both")
    p.add_argument("--variants", action="store_true",
                   help="also time each way snapkeep could verify and load (VARIANTS)")
    p.add_argument("--doors", action="store_true",
                   help="also time every door of snapkeep over the same state (DOORS)")
    p.add_argument("--first-snapshot", action="store_true",
                   help="also time the first snapshot after a restart against later ones")
    p.add_argument("--only", default=None,
                   help="comma-separated contenders to run (default: all)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child in FIRST_SNAPSHOT:
        print(json.dumps(first_snapshot_child(args.child, args.path, args.state_gib)))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.path, args.state_gib, args.cold)))
        return 0
    out = tempfile.mkdtemp(prefix="bench-resume-", dir=args.dir or os.getcwd())
    try:
        path = save(args.state_gib, out)
        size = os.path.getsize(path)
        runs: dict[tuple[str, bool], list[dict[str, Any]]] = {}
        names = list(CONTENDERS) + (list(VARIANTS) if args.variants else []) \
            + (list(DOORS) + list(STOCK) if args.doors else [])
        if args.only:
            names = [n for n in names if n in args.only.split(",")]
        colds = {"both": (False, True), "cold": (True,), "warm": (False,)}[args.cache]
        cases = [(c, cold) for cold in colds for c in names
                 if not (c == "read file" and not cold)]
        load_before = os.getloadavg()
        if args.first_snapshot:
            cases += [(c, False) for c in FIRST_SNAPSHOT]
        for rep in range(args.reps):
            order = cases if rep % 4 in (0, 3) else list(reversed(cases))  # ABBA
            for contender, cold in order:
                runs.setdefault((contender, cold), []).append(
                    run_child(contender, path, args.state_gib, cold))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    load_after = os.getloadavg()
    rows = []
    med = {k: median([r["time_s"] for r in v]) for k, v in runs.items() if k[0] in CONTENDERS
           or k[0] in VARIANTS or k[0] in DOORS or k[0] in STOCK}

    def ratio(t: float, key: tuple[str, bool]) -> float | None:
        return t / med[key] if key in med else None

    def paired(results: list[dict[str, Any]], key: tuple[str, bool],
               total: bool = False) -> list[float]:
        """Per-run ratios to ``key``'s run of the same repetition (ABBA neighbours);
        ``total``: resume + first step."""
        if key not in runs:
            return []

        def t(r: dict[str, Any]) -> float:
            return float(r["time_s"]) + (float(r["first_step_s"] or 0.0) if total else 0.0)

        return sorted(t(a) / t(b) for a, b in zip(results, runs[key]))

    first_rows = [summarize_first(c, runs.pop((c, False))) for c in FIRST_SNAPSHOT
                  if (c, False) in runs]
    for (contender, cold), results in runs.items():
        t = med[(contender, cold)]
        steps = [r["first_step_s"] for r in results if r.get("first_step_s") is not None]
        rows.append({
            "contender": contender, "cache": "cold" if cold else "warm", "time_s": t,
            "first_step_s": median(steps) if steps else None,
            "x_torch_load": ratio(t, ("torch.load", cold)),
            "x_dcp": ratio(t, ("DCP load", cold)),
            "x_mmap": ratio(t, ("torch.load(mmap=True)", cold)),
            "spread_s": f"{min(r['time_s'] for r in results):.2f}-"
                        f"{max(r['time_s'] for r in results):.2f}",
            "x_mmap_paired": median(paired(results, ("torch.load(mmap=True)", cold)))
            if paired(results, ("torch.load(mmap=True)", cold)) else None,
            "x_mmap_pairs": "-".join(f"{x:.2f}" for x in paired(
                results, ("torch.load(mmap=True)", cold))[::max(1, len(results) - 1)]),
            "x_mmap_total": median(paired(results, ("torch.load(mmap=True)", cold), True))
            if paired(results, ("torch.load(mmap=True)", cold)) and steps else None,
            "x_stock": median(paired(results, (STOCK[0] if "Lightning" in contender
                                               else STOCK[1], cold)))
            if contender in (DOORS[3], DOORS[5]) else None,
            "x_read": ratio(t, ("read file", True)) if cold else None,
            "peak_x": median([r["peak_rss"] for r in results]) / size,
            "extra_x": median([r["peak_rss"] - r["rss_before"] for r in results]) / size,
        })
    print(f"state file {size / GIB:.3f} GiB, {args.reps} runs each (ABBA), medians; load "
          f"average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    print(table(rows, [
        ("contender", "contender", ""), ("cache", "cache", ""), ("time_s", "resume s", ".3f"),
        ("spread_s", "min-max s", ""), ("first_step_s", "first step s", ".3f"),
        ("x_torch_load", "x torch.load", ".2f"), ("x_dcp", "x DCP", ".2f"),
        ("x_mmap", "x mmap", ".2f"), ("x_mmap_paired", "x mmap, paired", ".2f"),
        ("x_mmap_pairs", "paired min-max", ""),
        ("x_mmap_total", "+ first step, x mmap", ".2f"), ("x_stock", "x stock door", ".2f"),
        ("x_read", "x read", ".2f"), ("peak_x", "peak RSS x state", ".2f"),
        ("extra_x", "RSS added x state", ".2f")]))
    if first_rows:
        print(f"\nfirst snapshot after a restart (ThreadWriter, {N_SNAPSHOTS} snapshots a run; "
              "ratio = median over runs of first / median of the later ones)")
        print(table(first_rows, FIRST_COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_bytes": size, "reps": args.reps, "rows": rows,
                       "loadavg_before": load_before, "loadavg_after": load_after,
                       "first_snapshot": first_rows,
                       "runs": {f"{c}|{'cold' if k else 'warm'}": v
                                for (c, k), v in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
