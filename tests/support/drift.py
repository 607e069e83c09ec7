"""Drift over many saves: host memory, open files, threads, child processes and shared-memory
segments of a training process (and its children) sampled while one door or writer saves a
small state N times, in a fresh process per case.

Run one case (prints one JSON line, the :func:`run_case` result)::

    PYTHONPATH=src python tests/support/drift.py CASE SAVES OUT_DIR [--every K]

``benchmarks/bench_drift.py`` runs every case with 1,000 saves and prints the table;
``tests/test_drift.py`` runs 100 saves per case. The verdict (:func:`verdict`) is not timing
dependent: counts are compared after the save in flight was waited for, and RSS growth is the
Theil-Sen slope (median of the slopes of every pair of samples) of the samples after warm-up,
which one outlier (a malloc trim, a page-cache blip) does not move.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

#: the cases, in the order the benchmark prints them
CASES = (
    "extension/SimpleWriter", "extension/ThreadWriter", "extension/ThreadQueueWriter",
    "extension/ProcessWriter", "extension/ProcessQueueWriter", "Checkpointer",
    "Lightning/SnapkeepCheckpointIO", "HF/SnapkeepCallback", "HF/SnapkeepTrainer",
)
_SHM_DIR = "/dev/shm"
_ARENA_PREFIX = "snapkeep_"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One observation after ``saves`` saves (the save in flight waited for).

    Attributes:
        saves: saves done so far.
        rss_bytes: resident memory of the process plus its descendants, in bytes.
        fds: open file descriptors of the process and its descendants.
        threads: threads of the process and its descendants.
        children: live (not zombie) descendant processes.
        shm: ``/dev/shm`` segments the tree holds open or mapped, or snapkeep arenas it owns.
    """

    saves: int
    rss_bytes: int
    fds: int
    threads: int
    children: int
    shm: int


#: multiprocessing's long-lived helpers (started once per process, by the first process writer):
#: not a door's children
_INFRASTRUCTURE = ("resource_tracker", "forkserver")


def _tree() -> list[psutil.Process]:
    me = psutil.Process()
    procs = [me]
    for child in me.children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                    word in " ".join(child.cmdline()) for word in _INFRASTRUCTURE):
                procs.append(child)
        except psutil.Error:
            pass
    return procs


def _shm_of(pids: set[int]) -> set[str]:
    """/dev/shm names mapped or open in ``pids``, plus snapkeep arenas owned by one of them."""
    names: set[str] = set()
    prefix = _SHM_DIR + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        names.add(line[at + len(prefix):].strip().removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    names.add(target[len(prefix):].removesuffix(" (deleted)"))
        except OSError:
            pass
    try:
        for name in os.listdir(_SHM_DIR):
            if name.startswith(_ARENA_PREFIX):
                try:
                    owner = int(name[len(_ARENA_PREFIX):].split("_")[0], 36)
                except ValueError:
                    continue
                if owner in pids:
                    names.add(name)
    except OSError:
        pass
    return names


def sample(saves: int) -> Sample:
    """The tree's counts now."""
    rss = fds = threads = 0
    procs = _tree()
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
        except psutil.Error:
            pass
    return Sample(saves=saves, rss_bytes=rss, fds=fds, threads=threads,
                  children=len(procs) - 1, shm=len(_shm_of({p.pid for p in procs})))


class Probe:
    """Samples every ``every`` saves; ``drain`` (called first) waits for the save in flight."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.samples: list[Sample] = []
        self.drain: Callable[[], None] = lambda: None

    def after_save(self, saves: int) -> None:
        if saves % self.every == 0:
            self.drain()
            self.samples.append(sample(saves))


# -- the cases ---------------------------------------------------------------------------------
def _mlp() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 16))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _extension(writer_name: str, out: str, saves: int, probe: Probe) -> None:
    import torch

    import snapkeep
    from snapkeep.training import ExtensionsManager, extensions

    model, optimizer = _mlp()
    writer = getattr(snapkeep.writing, writer_name)(out_dir=out)
    # one iteration more than sampled: the manager finalizes the extension at its last one
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=saves + 1,
                                writer=writer)
    manager.extend(extensions.snapshot(n_retains=2), trigger=(1, "iteration"))
    probe.drain = writer.wait
    x = torch.randn(8, 256)
    try:
        while not manager.stop_trigger:
            with manager.run_iteration(step_optimizers=["main"]):
                model(x).square().mean().backward()
            if manager.iteration <= saves:
                probe.after_save(manager.iteration)
    finally:
        manager.finalize()


def _checkpointer(out: str, saves: int, probe: Probe) -> None:
    import torch

    import snapkeep

    model, optimizer = _mlp()
    ckpt = snapkeep.Checkpointer(out, keep=2)
    probe.drain = ckpt.wait
    x = torch.randn(8, 256)
    try:
        state = {"model": model, "optimizer": optimizer}
        ckpt.load(state)
        for step in range(1, saves + 1):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
            ckpt.save(step, state)
            probe.after_save(step)
    finally:
        ckpt.close()


def _lightning(out: str, saves: int, probe: Probe) -> None:
    import lightning.pytorch as pl
    import torch

    from snapkeep.lightning import ModelCheckpoint, SnapkeepCheckpointIO

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()[0]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Sampler(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            # the checkpoint of step N was saved at the end of its batch: sample before N+1
            if trainer.global_step:
                probe.after_save(trainer.global_step)

        def on_train_end(self, trainer: Any, *args: Any) -> None:
            probe.after_save(trainer.global_step)

    io = SnapkeepCheckpointIO(keep=2, quiet=True)
    probe.drain = io.wait
    data = torch.utils.data.TensorDataset(torch.randn(saves, 256))
    trainer = pl.Trainer(max_steps=saves, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[io], callbacks=[
                             Sampler(), ModelCheckpoint(dirpath=out, every_n_train_steps=1,
                                                        save_top_k=1)])
    try:
        trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=1))
    finally:
        io.close()


def _hf(owned: bool, out: str, saves: int, probe: Probe) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from snapkeep.hf import SnapkeepCallback, SnapkeepTrainer

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.ids = torch.randint(0, 64, (saves, 16),
                                     generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Sampler(TrainerCallback):  # type: ignore[misc]
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            probe.after_save(state.global_step)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                       n_positions=16))
    args = TrainingArguments(output_dir=out, max_steps=saves, save_steps=1, save_total_limit=2,
                             per_device_train_batch_size=1, use_cpu=True, report_to=[],
                             disable_tqdm=True, logging_strategy="no")
    if owned:
        trainer: Any = SnapkeepTrainer(model=model, args=args, train_dataset=Tokens(),
                                       callbacks=[Sampler()])
        probe.drain = trainer.wait_for_checkpoint
    else:
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                          callbacks=[SnapkeepCallback(), Sampler()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()


def _case(name: str) -> Callable[[str, int, Probe], None]:
    door, _, writer = name.partition("/")
    if door == "extension":
        return lambda out, saves, probe: _extension(writer, out, saves, probe)
    if door == "Checkpointer":
        return _checkpointer
    if door == "Lightning":
        return _lightning
    if door == "HF":
        return lambda out, saves, probe: _hf(writer == "SnapkeepTrainer", out, saves, probe)
    raise ValueError(f"unknown case {name!r}; one of {', '.join(CASES)}")


def _settled(before: Sample, timeout_s: float = 30.0, pooled_s: float = 3.0) -> Sample:
    """The counts once the tree is back to ``before``'s children and segments (a worker's
    exit: polled up to ``timeout_s``) and then to its threads and fds, for up to ``pooled_s``
    more: snapkeep's copy and write pools keep their idle threads for the process's life by
    design, so waiting the whole ``timeout_s`` for them only spent 30 s per case."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = sample(0)
        # a constant POSIX semaphore (``sem.*``, tqdm's multiprocessing lock) stays mapped
        segments = [n for n in _shm_of({p.pid for p in _tree()}) if not n.startswith("sem.")]
        if (now.children <= before.children and len(segments) <= before.shm) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    deadline = time.monotonic() + pooled_s
    while (now.threads > before.threads or now.fds > before.fds) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
        now = sample(0)
    return now


def run_case(name: str, saves: int, out: str, every: int) -> dict[str, Any]:
    """Run case ``name`` (one of :data:`CASES`) for ``saves`` saves into ``out``, sampling
    every ``every`` saves; returns the samples, the counts before the door existed (after
    ``import torch`` and the door's imports) and after it was closed, and the seconds taken."""
    import torch

    torch.set_num_threads(1)
    fn = _case(name)
    import snapkeep  # noqa: F401  (imports before the baseline)
    if name.startswith("Lightning"):
        import lightning.pytorch  # noqa: F401
    if name.startswith("HF"):
        import transformers  # noqa: F401
    probe = Probe(every)
    before = sample(0)
    start = time.perf_counter()
    fn(out, saves, probe)
    took = time.perf_counter() - start
    after = _settled(before)
    return {"case": name, "saves": saves, "every": every, "seconds": took,
            "before": dataclasses.asdict(before), "after_close": dataclasses.asdict(after),
            "samples": [dataclasses.asdict(s) for s in probe.samples],
            "threads_alive": sorted(t.name for t in threading.enumerate()),
            "shm_alive": sorted(_shm_of({p.pid for p in _tree()}))}


# -- the verdict ---------------------------------------------------------------------------------
def theil_sen(xs: list[float], ys: list[float]) -> float:
    """Median of the slopes of every pair of points with distinct x (robust to outliers)."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs))
              for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    return statistics.median(slopes) if slopes else 0.0


def verdict(result: dict[str, Any], warmup_saves: int) -> dict[str, Any]:
    """Summary of one case: RSS at warm-up and at the end (MiB), growth per 100 saves after
    warm-up (Theil-Sen, MB = 10^6 bytes), and the counts (fds, threads, children, shm) at
    warm-up, at the end, their largest value after warm-up, their growth (the least of the last
    fifth of the samples minus the most of the first fifth: > 0 is a leak) and after close
    against before."""
    samples = [s for s in result["samples"] if s["saves"] >= warmup_saves]
    if len(samples) < 2:
        raise ValueError(f"{result['case']}: fewer than 2 samples after {warmup_saves} saves")
    first, last = samples[0], samples[-1]
    xs = [float(s["saves"]) for s in samples]
    slope = theil_sen(xs, [float(s["rss_bytes"]) for s in samples])
    row: dict[str, Any] = {
        "case": result["case"], "saves": result["saves"], "seconds": result["seconds"],
        "warmup_saves": first["saves"],
        "rss_warm_mib": first["rss_bytes"] / 2**20, "rss_end_mib": last["rss_bytes"] / 2**20,
        "rss_growth_mb_per_100": slope * 100 / 1e6,
    }
    window = max(3, len(samples) // 5)
    for key in ("fds", "threads", "children", "shm"):
        row[f"{key}_warm"] = first[key]
        row[f"{key}_end"] = last[key]
        row[f"{key}_max"] = max(s[key] for s in samples)
        # a leak raises every later sample; a thread or file of the save just finished
        # (transient) raises one sample at most
        row[f"{key}_grew"] = min(s[key] for s in samples[-window:]) \
            - max(s[key] for s in samples[:window])
        row[f"{key}_leaked_after_close"] = result["after_close"][key] - result["before"][key]
    return row


def leaks(row: dict[str, Any]) -> list[str]:
    """What grew after warm-up in a :func:`verdict` row (empty: nothing)."""
    return [f"{key}: {row[key + '_warm']} at warm-up, {row[key + '_end']} at the end"
            for key in ("fds", "threads", "children", "shm") if row[f"{key}_grew"] > 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=CASES)
    parser.add_argument("saves", type=int)
    parser.add_argument("out")
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = run_case(args.case, args.saves, args.out, args.every)
    sys.stdout.write("DRIFT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
