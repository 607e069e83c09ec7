"""The resumable training demo behind ``snapkeep demo``.

Trains an MLP classifier on scikit-learn's bundled handwritten digits (1,797 8x8 grey images,
shipped inside the ``scikit-learn`` wheel, so nothing is downloaded) with snapkeep's
``ExtensionsManager``, one of the ``snapkeep.writing`` writers and ``extensions.snapshot`` with
``n_retains`` and ``autoload``.

Everything that decides the next update is in the snapshot: parameters, Adam state, the global RNG
states (dropout and the random augmentation draw from them) and the position of the shuffled
``torch.utils.data.DataLoader`` (``extensions.snapshot(loaders={'train': loader})``: its epoch's
order and the batches the loop has received). With one intra-op thread and deterministic
algorithms, a run killed at any moment and started again with the same command ends with
bit-identical metrics to an uninterrupted run.

A snapshot is also taken at the last iteration, so running a finished command again reports the
final metrics without training. SIGTERM or SIGUSR1 (a scheduler's preemption) makes the run
snapshot the current iteration, wait for the commit and exit with code 143
(``extensions.preemption``); the same command resumes from that snapshot.

``python -m snapkeep.demo [options]`` is ``snapkeep demo [options]``.

The task itself (data, model, evaluation) is :mod:`snapkeep._demo_task`; its names are
re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy
import torch
import torch.nn.functional as F

import snapkeep
from snapkeep._demo_task import (
    LastLoss,
    augment,
    build_model,
    evaluate,
    load_digits_split,
)
from snapkeep.store import SnapshotStore
from snapkeep.training import PRIORITY_SNAPSHOT, ExtensionsManager, extensions
from snapkeep.training.triggers import Trigger

logger = logging.getLogger(__name__)

#: Hidden sizes of the ``--model-size`` presets. State bytes (float32 params + Adam's two moments)
#: are about ``12 * (h**2 + 76*h)``: small 0.3 MB, medium 13.5 MB, large 116 MB.
MODEL_SIZES: Mapping[str, int] = {"small": 128, "medium": 1024, "large": 3072}
WRITERS: tuple[str, ...] = ("simple", "thread", "process", "thread-queue", "process-queue")
TEMPLATE = "snapshot_iter_{.iteration}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of one demo run (the CLI options).

    Attributes:
        out_dir: directory for snapshots (created if missing).
        iterations: training length in iterations (the run stops at this iteration).
        snapshot_interval: iterations between snapshots; one is also taken at ``iterations``.
        n_retains: snapshots kept (newest by step); <= 0 keeps all.
        writer: one of :data:`WRITERS`.
        hidden_size: width of the MLP's two hidden layers.
        seed: seeds model init, dropout/augmentation RNG and the data order.
        log_interval: iterations between progress lines (default: ``snapshot_interval``).
        batch_size: training batch size.
        threads: torch intra-op threads; results are bit-identical for a fixed count.
        lr: Adam learning rate.
    """

    out_dir: str = "result/demo"
    iterations: int = 300
    snapshot_interval: int = 50
    n_retains: int = 3
    writer: str = "thread-queue"
    hidden_size: int = MODEL_SIZES["small"]
    seed: int = 0
    log_interval: int | None = None
    batch_size: int = 64
    threads: int = 1
    lr: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("iterations", "snapshot_interval", "hidden_size", "batch_size", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.log_interval is not None and self.log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {self.log_interval!r}")
        if self.writer not in WRITERS:
            raise ValueError(f"writer must be one of {', '.join(WRITERS)}; got {self.writer!r}")


# -- snapshots --------------------------------------------------------------------------------


def make_writer(kind: str, out_dir: str) -> snapkeep.writing.Writer:
    """The writer for ``--writer kind``, writing under ``out_dir``."""
    from snapkeep import writing

    classes: dict[str, Callable[..., snapkeep.writing.Writer]] = {
        "simple": writing.SimpleWriter, "thread": writing.ThreadWriter,
        "process": writing.ProcessWriter, "thread-queue": writing.ThreadQueueWriter,
        "process-queue": writing.ProcessQueueWriter,
    }
    if kind not in classes:
        raise ValueError(f"writer must be one of {', '.join(WRITERS)}; got {kind!r}")
    return classes[kind](out_dir=out_dir)


class SnapshotSchedule(Trigger):
    """Fires every ``interval`` iterations and at iteration ``last``. Stateless."""

    def __init__(self, interval: int, last: int) -> None:
        self.interval = interval
        self.last = last

    def __call__(self, manager: Any) -> bool:
        return self.may_fire(manager.iteration, 1)

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        return iteration > 0 and (iteration % self.interval == 0 or iteration == self.last)


class ReachedIteration(Trigger):
    """Stop trigger: fires once ``manager.iteration >= last`` (also after resuming past it)."""

    def __init__(self, last: int) -> None:
        self.last = last

    def __call__(self, manager: Any) -> bool:
        return bool(manager.iteration >= self.last)


class StallClock:
    """How long training stalled in the snapshot extension at each of its iterations (seconds).

    Two extensions with the snapshot's trigger and priority run around it: the manager runs the
    extensions at ``PRIORITY_SNAPSHOT`` last, in registration order, so the one registered just
    before the snapshot (:meth:`extend_before`) starts the clock and the one registered just after
    (:meth:`extend_after`) stops it. The snapshot extension itself is registered as is, so
    ``extensions.preemption`` finds it.
    """

    def __init__(self) -> None:
        self.stall_s: list[float] = []
        self._start: float | None = None

    def extend_before(self, manager: ExtensionsManager, trigger: Trigger) -> None:
        """Register the clock's start; call just before registering the snapshot."""
        def start(manager: Any) -> None:
            self._start = time.perf_counter()

        manager.extend(start, name="snapshot_clock_start", trigger=trigger,
                       priority=PRIORITY_SNAPSHOT)

    def extend_after(self, manager: ExtensionsManager, trigger: Trigger) -> None:
        """Register the clock's stop; call just after registering the snapshot."""
        def stop(manager: Any) -> None:
            if self._start is not None:
                self.stall_s.append(time.perf_counter() - self._start)
                self._start = None

        manager.extend(stop, name="snapshot_clock_stop", trigger=trigger,
                       priority=PRIORITY_SNAPSHOT)


# -- the run ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoResult:
    """Outcome of :func:`run_demo`; ``as_json()`` is what ``--json`` prints."""

    iteration: int
    loss: float
    accuracy: float
    eval_loss: float
    resumed_from: str | None
    resumed_iteration: int | None
    already_done: bool
    iterations_run: int
    snapshots: int
    retained: list[str]
    snapshot_size_bytes: int | None
    stall_ms_mean: float | None
    stall_ms_max: float | None
    elapsed_s: float
    it_per_s: float | None
    writer: str
    hidden_size: int
    parameters: int

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _ms(values: list[float]) -> str:
    return f"{1e3 * sum(values) / len(values):.1f}" if values else "-"


def run_demo(config: DemoConfig, echo: Callable[[str], None] = print) -> DemoResult:
    """Train (or resume) the digits classifier; print progress lines through ``echo``.

    Raises:
        SystemExit: 143 after a preemption snapshot (SIGTERM or SIGUSR1; committed first).
        snapkeep.NoValidSnapshotError: snapshot files exist in ``out_dir`` but none verifies.
        snapkeep.StateMismatchError: the newest snapshot was made with another ``hidden_size``.
        ValueError: the snapshot's loader had another number of batches per epoch
            (another ``batch_size``).
        OSError: ``out_dir`` cannot be created or written.
        ImportError: scikit-learn is missing.
    """
    saved_threads = torch.get_num_threads()
    saved_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _run(config, echo)
    finally:
        torch.set_num_threads(saved_threads)
        torch.use_deterministic_algorithms(saved_deterministic)


class RunSettings:
    """The settings that decide the data order (seed, batch size), kept in the snapshot: a rerun
    with other settings is refused before anything is loaded, instead of mixing two runs."""

    def __init__(self, *, seed: int, batch_size: int) -> None:
        self.settings = {"seed": seed, "batch_size": batch_size}

    def state_dict(self) -> dict[str, int]:
        return dict(self.settings)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raises:
            ValueError: the snapshot was taken with other settings (names both values)."""
        for key, value in self.settings.items():
            if key in state and int(state[key]) != value:
                raise ValueError(
                    f"the snapshot was taken with {key}={int(state[key])}, this run {value}: "
                    "rerun with the same settings to resume, or use another --out")


def _run(config: DemoConfig, echo: Callable[[str], None]) -> DemoResult:
    train_x, train_y, test_x, test_y = load_digits_split()
    # The demo only draws from torch's generator; seeding the others too makes the whole
    # snapshot (which records every global RNG) identical between a resumed and a straight run.
    random.seed(config.seed)
    numpy.random.seed(config.seed)
    torch.manual_seed(config.seed)
    model = build_model(config.hidden_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    if not 1 <= config.batch_size <= len(train_x):
        raise ValueError(f"batch_size must be in [1, {len(train_x)}], got {config.batch_size}")
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(train_x, train_y), batch_size=config.batch_size,
        shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(config.seed))
    last_loss = LastLoss()
    n_params = sum(p.numel() for p in model.parameters())

    writer = make_writer(config.writer, config.out_dir)
    manager = ExtensionsManager(
        model, optimizer, max_epochs=1, iters_per_epoch=len(loader),
        out_dir=config.out_dir, writer=writer, stop_trigger=ReachedIteration(config.iterations),
        state_objects={"last_loss": last_loss,
                       "settings": RunSettings(seed=config.seed, batch_size=config.batch_size)},
    )
    # quiet: the demo says itself where it resumed from (one line, not the notice too)
    snapshot = extensions.snapshot(
        filename=TEMPLATE, writer=writer, n_retains=config.n_retains, autoload=True,
        loaders={"train": loader}, quiet=True)
    schedule = SnapshotSchedule(config.snapshot_interval, config.iterations)
    snap = StallClock()
    snap.extend_before(manager, schedule)
    manager.extend(snapshot, trigger=schedule)
    snap.extend_after(manager, schedule)
    manager.extend(extensions.preemption())  # SIGTERM/SIGUSR1: snapshot, then exit 143
    log_interval = config.log_interval or config.snapshot_interval

    echo(f"snapkeep demo: digits MLP hidden={config.hidden_size} ({n_params:,} parameters, "
         f"~{12 * n_params / 1e6:.1f} MB with Adam state), writer={config.writer}, "
         f"out={config.out_dir}, seed={config.seed}")
    try:
        start = time.perf_counter()
        manager.start_extensions()  # autoload happens here
        entry = snapshot.loaded_entry
        resumed_from = entry.name if entry is not None else None
        first = manager.iteration
        if resumed_from is None:
            echo(f"starting fresh (no snapshot in {config.out_dir}); "
                 f"training {config.iterations} iterations")
        else:
            echo(f"resumed from {resumed_from} (iteration {first}) in "
                 f"{time.perf_counter() - start:.2f} s")
        already_done = first >= config.iterations
        if already_done:
            echo(f"already at iteration {first} >= --iterations {config.iterations}; "
                 "nothing to train, final metrics follow")

        start = time.perf_counter()
        reported = 0
        while not manager.stop_trigger:
            for x, y in loader:
                with manager.run_iteration(step_optimizers=["main"]):
                    loss = F.cross_entropy(model(augment(x)), y)
                    snapkeep.report({"loss": loss})
                    loss.backward()
                    last_loss.value = float(loss.detach())
                iteration = manager.iteration
                if iteration % log_interval == 0 or iteration == config.iterations:
                    accuracy, _ = evaluate(model, test_x, test_y)
                    stalls = snap.stall_s[reported:]
                    reported = len(snap.stall_s)
                    echo(f"iter {iteration:>6}  loss {last_loss.value:.4f}  "
                         f"accuracy {accuracy:.4f}  snapshot stall {_ms(stalls)} ms")
                if manager.stop_trigger:  # --iterations need not end an epoch
                    break
        manager.finalize()  # waits for the last snapshot to commit
        elapsed_s = time.perf_counter() - start
    finally:
        manager.finalize()

    accuracy, eval_loss = evaluate(model, test_x, test_y)
    iterations_run = manager.iteration - first
    storage, directory = writer.storage_for(config.out_dir)
    entries = SnapshotStore(storage, directory, snapshot.store_template).entries()
    size = storage.size(entries[-1].path) if entries else None
    stalls_ms = [1e3 * s for s in snap.stall_s]
    return DemoResult(
        iteration=manager.iteration, loss=last_loss.value, accuracy=accuracy,
        eval_loss=eval_loss, resumed_from=resumed_from,
        resumed_iteration=first if resumed_from is not None else None,
        already_done=already_done, iterations_run=iterations_run, snapshots=len(snap.stall_s),
        retained=[e.name for e in entries], snapshot_size_bytes=size,
        stall_ms_mean=sum(stalls_ms) / len(stalls_ms) if stalls_ms else None,
        stall_ms_max=max(stalls_ms) if stalls_ms else None,
        elapsed_s=elapsed_s,
        it_per_s=iterations_run / elapsed_s if iterations_run and elapsed_s > 0 else None,
        writer=config.writer, hidden_size=config.hidden_size, parameters=n_params,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m snapkeep.demo [options]``: the ``snapkeep demo`` command (same options, output
    and exit status: 143 after a preemption snapshot)."""
    import sys

    from snapkeep.cli import cli

    cli.main(["demo", *(sys.argv[1:] if argv is None else argv)],
             prog_name="python -m snapkeep")


if __name__ == "__main__":
    main()
