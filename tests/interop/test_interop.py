"""A ppe-example-shaped script (ppe_example.py) run both ways -- plug-in (ppe's manager with
snapkeep's snapshot, or ppe's snapshot with a snapkeep writer) and import swap -- with each
writer: SIGKILLed mid-epoch and rerun, it must resume from the last epoch's snapshot and end
with the parameters of an uninterrupted run, bit for bit, with exactly ``n_retains`` snapshots
and manifests left and a ``log`` holding every epoch once."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

pytest.importorskip("pytorch_pfn_extras")

SCRIPT = pathlib.Path(__file__).with_name("ppe_example.py")
SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
ITERS_PER_EPOCH, EPOCHS = 4, 4
KILL_AT = 2 * ITERS_PER_EPOCH + 2  # mid epoch 3: the snapshots of iterations 4 and 8 exist
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(mode: str, writer: str, out: pathlib.Path, *extra: str, kill_at: int | None = None
         ) -> tuple[int, list[dict]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    env.pop("SNAPKEEP_EXAMPLE_KILL_AT", None)
    if kill_at is not None:
        env["SNAPKEEP_EXAMPLE_KILL_AT"] = str(kill_at)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), mode, writer, str(out), *extra], env=env,
        capture_output=True, text=True, timeout=240, check=False)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if kill_at is None and proc.returncode != 0:
        pytest.fail(f"{mode}/{writer} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc.returncode, events


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """Parameters of an uninterrupted run (the same for every mode and writer)."""
    rc, events = _run("sk-ext", "SimpleWriter", tmp_path_factory.mktemp("reference"))
    assert events[0] == {"event": "start", "iteration": 0}
    assert events[-1]["iteration"] == EPOCHS * ITERS_PER_EPOCH
    return str(events[-1]["params"])


def _kill_and_resume(mode: str, writer: str, out: pathlib.Path, reference: str,
                     *extra: str, first_mode: str | None = None) -> None:
    rc, events = _run(first_mode or mode, writer if first_mode is None else "SimpleWriter",
                      out, *extra, kill_at=KILL_AT)
    assert rc == -signal.SIGKILL, events
    assert [e["event"] for e in events] == ["start"]  # killed before the end
    rc, events = _run(mode, writer, out, *extra)
    assert events[0] == {"event": "start", "iteration": 2 * ITERS_PER_EPOCH}  # resumed
    assert events[-1]["iteration"] == EPOCHS * ITERS_PER_EPOCH
    assert events[-1]["params"] == reference  # bit-identical to the uninterrupted run
    snapshots = sorted(n for n in os.listdir(out) if n.startswith("snapshot_iter_"))
    assert snapshots == ["snapshot_iter_12", "snapshot_iter_16"]  # n_retains=2
    manifests = sorted(n for n in os.listdir(out / ".snapkeep")
                       if n.startswith("snapshot_") and n.endswith(".json"))
    assert manifests == ["snapshot_iter_12.json", "snapshot_iter_16.json"]
    log = json.loads((out / "log").read_text())
    assert [entry["epoch"] for entry in log] == [1, 2, 3, 4]
    assert [entry["iteration"] for entry in log] == [4, 8, 12, 16]


# The two plug-in variants share the writer classes between them: each class runs once on the
# plug-in path (a case costs two interpreter starts), and once more under the import swap.
@pytest.mark.parametrize("writer", ["SimpleWriter", "ThreadWriter", "ProcessWriter"])
def test_plugin_snapkeep_snapshot_in_ppe_manager(tmp_path, reference, writer):
    _kill_and_resume("sk-ext", writer, tmp_path, reference)


@pytest.mark.parametrize("writer", ["ThreadQueueWriter", "ProcessQueueWriter"])
def test_plugin_ppe_snapshot_with_snapkeep_writer(tmp_path, reference, writer):
    # ppe's snapshot saves no RNG state: the script registers snapkeep.training.RngState
    _kill_and_resume("ppe-ext", writer, tmp_path, reference)


# every writer class already ran once above: the import swap needs one thread and one process
# writer (each case costs two interpreter starts that import ppe)
@pytest.mark.parametrize("writer", ["ThreadWriter", "ProcessQueueWriter"])
def test_import_swap(tmp_path, reference, writer):
    _kill_and_resume("swap", writer, tmp_path, reference)


def test_directory_written_by_ppe_resumes_in_snapkeep(tmp_path, reference):
    # ppe's own snapshot and writer, killed; snapkeep's snapshot resumes from its files (no
    # manifests: loaded completely, with a warning) and its retention removes them
    _kill_and_resume("sk-ext", "ThreadWriter", tmp_path, reference, "--rng-object",
                     first_mode="ppe-native")
