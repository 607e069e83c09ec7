"""The Ray Train door end to end (issue 33, item 2), with a real local Ray cluster.

The recipe of docs/cluster.md (``docs/examples/ray_train.py``, imported and run as written): a
``TorchTrainer`` of 2 CPU workers (gloo, DDP, ``DistributedSampler`` + ``StatefulDataLoader``)
snapshots through snapkeep and reports each snapshot to Ray. A worker process is SIGKILLed in
the middle of a step, on the first attempt only: the example's dataset is wrapped so that rank
``r`` kills its own process (``os.kill(os.getpid(), SIGKILL)``) when it fetches its N-th sample,
and writes its pid to a marker first (so the restarted group does not kill again). Ray
(``FailureConfig(max_failures=1)``) restarts the group; the workers resume, and the final state
(model, optimizer, every rank's data position and torch generators) is bit-identical to an
uninterrupted run's (Python's and NumPy's global generators are drawn from by Ray's own code in
the worker: see ``_same_but_global_python_numpy_random``). Every fetch is logged per process,
so the step each attempt started from is known: ``steps - fetched / batch``.

One Ray cluster for the module's tests (``ray.init(address="local", num_cpus=2,
include_dashboard=False, _temp_dir=<short dir>)``), shut down after them, with a check that none
of its processes, session files or ``/dev/shm`` segments is left; the suite's leak check runs
per test for every other process.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")
pytest.importorskip("torchdata")

import snapkeep  # noqa: E402
import snapkeep.ray  # noqa: E402
from snapkeep.distributed import object_from_bytes  # noqa: E402
from support.leak_check import LONG_LIVED_PIDS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "ray_train.py"
STEPS = 24  # 192 samples, 8 per rank and step, 2 ranks: 12 steps per epoch, 2 epochs
EVERY = 4
BATCH = 8
TEMPLATE = "ckpt_{step}"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("snapkeep_ray_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    return module


class KillOnce(torch.utils.data.Dataset):
    """The example's dataset; in rank ``rank``'s process, each fetch is logged to
    ``log.<pid>``, and the ``at``-th fetch SIGKILLs the process, unless ``marker`` exists (it is
    written first, so only the first attempt dies)."""

    def __init__(self, base: Any, *, rank: int, at: int, marker: str, log: str) -> None:
        self.base, self.rank, self.at, self.marker, self.log = base, rank, at, marker, log
        self.fetched = 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        if os.environ.get("RANK") == str(self.rank):
            self.fetched += 1
            with open(f"{self.log}.{os.getpid()}", "a") as f:
                f.write(f"{index}\n")
            if self.fetched == self.at and not os.path.exists(self.marker):
                with open(self.marker, "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)  # this Ray Train worker, mid-step
        return self.base[index]


def _ray_processes(temp: str) -> list[psutil.Process]:
    """Processes of the cluster started in ``temp`` (every Ray process names its session or
    temp directory on its command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


#: Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
#: default), and a worker's ``ray.train.report`` blocks until the poll has taken its result (a
#: queue of one), as do the start, the end and the noticing of a dead worker: up to 2 s a report,
#: and the uninterrupted fit took 41 s (20 s polled every 0.25 s, as here). Read by ``fit`` from
#: the driver's environment and passed to the controller and the workers; a poll that takes longer
#: is a missed one, fatal only after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (10 min).
_RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}


@pytest.fixture(scope="module")
def _ray_cluster() -> Iterator[tuple[Any, str]]:
    """A local Ray cluster of 2 CPUs and the example module, one for this module's tests (its
    start and shutdown cost ~10 s on 2 busy cores); afterwards nothing of the cluster is left:
    no process, no session directory, no /dev/shm segment of Ray's (snapkeep's own are the
    suite's leak check's, which also finds no child process of a test left but the
    cluster's)."""
    temp = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # short: Ray's unix sockets live under it
    shm_before = set(os.listdir("/dev/shm"))
    ray_tmp_before = os.path.exists("/tmp/ray")
    example = _example()
    ray.cloudpickle.register_pickle_by_value(example)  # the workers need not import them
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    saved = {name: os.environ.get(name) for name in _RAY_TRAIN_ENV}
    os.environ.update(_RAY_TRAIN_ENV)
    started = time.perf_counter()
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp,
                 logging_level="warning")
        print(f"ray.init: {time.perf_counter() - started:.1f} s")
        yield example, temp
    finally:
        ray.shutdown()
        left = {p.pid: p for p in _ray_processes(temp)}
        for pid, proc in _CLUSTER.items():  # its workers too (the leak check let them live on)
            if proc.is_running():  # (the same process: psutil compares its start time)
                left.setdefault(pid, proc)
        gone, alive = psutil.wait_procs(list(left.values()), timeout=60)
        LONG_LIVED_PIDS.difference_update(_CLUSTER)
        _CLUSTER.clear()
        for proc in alive:  # a failure below, but never a leak
            proc.kill()
        shutil.rmtree(temp, ignore_errors=True)
        ray.cloudpickle.unregister_pickle_by_value(example)
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        del sys.modules[example.__name__]
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert [p.pid for p in alive] == [], "Ray processes left after ray.shutdown()"
    assert {n for n in set(os.listdir("/dev/shm")) - shm_before
            if "ray" in n.lower() or "plasma" in n.lower()} == set()
    assert os.path.exists("/tmp/ray") == ray_tmp_before


@pytest.fixture
def cluster(_ray_cluster: tuple[Any, str]) -> Iterator[Any]:
    """The module's cluster, for one test: the processes of the cluster (every one names its
    temp directory on its command line: Ray's own and its idle workers, which live on for the
    next test) are the cluster's, not the test's leak (checked when the cluster shuts down)."""
    example, temp = _ray_cluster
    try:
        yield example
    finally:
        for proc in _ray_processes(temp):  # raylet's workers rename themselves (ray::IDLE)
            try:
                for each in [proc, *proc.children(recursive=True)]:
                    _CLUSTER.setdefault(each.pid, each)
            except psutil.NoSuchProcess:
                continue
        LONG_LIVED_PIDS.update(_CLUSTER)


#: the module cluster's processes that a test left for the next, by pid (exempt from the leak
#: check until the cluster is shut down, then checked gone)
_CLUSTER: dict[int, psutil.Process] = {}


def _tensors_equal(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors by torch.equal, containers key by key)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in _tensors_equal(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, bytes) and isinstance(b, bytes) and a != b:  # a rank's values, RNG
        return _tensors_equal(object_from_bytes(a, True), object_from_bytes(b, True), where)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _tensors_equal(x, y,
                                                                                f"{where}[{i}]")]
    return [] if a == b else [where]


def _final(snapshots: pathlib.Path) -> dict[str, Any]:
    state = snapkeep.load_latest(snapshots, template=TEMPLATE)
    assert state is not None, snapshots
    return state


def _started_from(log: pathlib.Path, marker: pathlib.Path) -> tuple[int, list[int]]:
    """The fetches of the killed process, and the step each later attempt of that rank started
    from (its fetches, BATCH per step, counted to the end)."""
    killed = int(marker.read_text())
    counts = {int(p.name.rsplit(".", 1)[1]): len(p.read_text().split())
              for p in log.parent.glob(log.name + ".*")}
    return counts.pop(killed), [STEPS - n // BATCH for n in counts.values()]


def _kill_once(example: Any, tmp_path: pathlib.Path, *, rank: int, at: int) -> KillOnce:
    return KillOnce(example.synthetic_data(), rank=rank, at=at,
                    marker=str(tmp_path / "kill-marker"), log=str(tmp_path / "fetched"))


def test_a_killed_worker_resumes_from_ray_checkpoint_bit_identical(
        cluster: Any, tmp_path: pathlib.Path) -> None:
    """Rank 1 dies by SIGKILL in the middle of step 14 (its 107th fetch), two steps after the
    report of step 12; Ray restarts the group, which resumes from step 12 (the snapshot Ray's
    checkpoint names, or, had Ray not yet registered that report, snapkeep's newest committed
    one: the same step) and ends bit-identical to an uninterrupted run."""
    started = time.perf_counter()
    reference = cluster.fit(str(tmp_path), name="reference", steps=STEPS, every=EVERY,
                            keep=None, max_failures=0)
    print(f"uninterrupted fit: {time.perf_counter() - started:.1f} s")
    assert reference.error is None
    expected = _final(tmp_path / "reference" / "snapshots")

    started = time.perf_counter()
    result = cluster.fit(str(tmp_path), name="killed", steps=STEPS, every=EVERY, keep=None,
                         max_failures=1, dataset=_kill_once(cluster, tmp_path, rank=1,
                                                            at=13 * BATCH + 3))
    print(f"fit with a kill and a restart: {time.perf_counter() - started:.1f} s")
    assert result.error is None
    assert _started_from(tmp_path / "fetched", tmp_path / "kill-marker") == (13 * BATCH + 3,
                                                                             [12])
    named = snapkeep.ray.reference_of(result.checkpoint)
    assert (named.step, named.name, named.world_size) == (STEPS, f"ckpt_{STEPS}", 2)
    assert named.directory == str(tmp_path / "killed" / "snapshots")
    final = _final(tmp_path / "killed" / "snapshots")
    assert _tensors_equal(expected["models"], {}) != []  # the comparison can fail
    assert _same_but_global_python_numpy_random(final, expected)


def _same_but_global_python_numpy_random(final: dict[str, Any],
                                         expected: dict[str, Any]) -> bool:
    """Every tensor of the model and optimizer, every rank's data position and torch's
    generators are equal. The global generators of Python's ``random`` and of NumPy may differ:
    code of Ray's in the worker process draws from them (snapkeep's save, verify and load draw
    nothing: checked in one process), so a restarted process's streams are shifted by Ray's
    draws; a loop's own randomness belongs in torch's generators (a ``torch.Generator`` in
    ``state`` is saved and restored too)."""
    differ = {d.split("[")[0] for d in _tensors_equal(final, expected)}
    assert differ <= {f".rank_state.rank{r}.rng.{g}" for r in range(2)
                      for g in ("python", "numpy")}, sorted(differ)
    return True


def test_ray_retention_never_deletes_a_snapshot_and_resume_works(
        cluster: Any, tmp_path: pathlib.Path) -> None:
    """Ray's ``num_to_keep=1`` deletes Ray's references only. Rank 0 dies by SIGKILL in step 19,
    after 4 reports; the restarted group resumes from step 16 (through Ray's reference to it, or,
    when Ray had not yet registered that report, past Ray's reference to step 12), and after
    6 reports Ray keeps one checkpoint (naming the last step) while snapkeep's directory holds
    every snapshot (``keep=None``), each verified by ``snapkeep verify``; every reference left in
    Ray's run directory names one of them."""
    result = cluster.fit(str(tmp_path), name="keep1", steps=STEPS, every=EVERY, keep=None,
                         num_to_keep=1, max_failures=1,
                         dataset=_kill_once(cluster, tmp_path, rank=0, at=18 * BATCH + 5))
    assert result.error is None
    assert _started_from(tmp_path / "fetched", tmp_path / "kill-marker") == (18 * BATCH + 5,
                                                                             [16])
    assert len(result.best_checkpoints) == 1, result.best_checkpoints
    last = snapkeep.ray.reference_of(result.checkpoint)
    assert snapkeep.ray.reference_of(result.best_checkpoints[0][0]) == last
    assert (last.step, last.name) == (STEPS, f"ckpt_{STEPS}")
    run = tmp_path / "keep1"
    snapshots = sorted(p.name for p in (run / "snapshots").glob("ckpt_*"))
    assert snapshots == sorted(f"ckpt_{s}" for s in range(EVERY, STEPS + 1, EVERY))
    # a reference Ray copied but never registered (the kill came first) stays, unknown to Ray's
    # retention; each names a snapshot that is there
    left = [snapkeep.ray.reference_of(ray.train.Checkpoint.from_directory(str(p)))
            for p in run.iterdir() if p.is_dir() and p.name.startswith("checkpoint_")]
    assert last in left and {r.name for r in left} <= set(snapshots), left
    verify = subprocess.run([sys.executable, "-m", "snapkeep", "verify", str(run / "snapshots"),
                             "--template", TEMPLATE], capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
