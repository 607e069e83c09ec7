"""ppe's MNIST example with only ``import snapkeep as ppe`` (``ppe_mnist_example.py``), run as a
user would, in processes of its own (forked by a zygote that imported torch and snapkeep once;
ppe's own spelling in a new interpreter, with no snapkeep in it): it trains, logs, prints its
report and keeps snapshots; SIGKILLed mid-epoch and rerun, its ``log`` has every epoch once with
the uninterrupted run's values; and the same script under ppe itself writes the same log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from support import zygote

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ppe_mnist_example.py"
SRC = HERE.parents[1] / "src"
EPOCHS, ITERS_PER_EPOCH = 4, 4
KILL_AT = 10  # after the epoch-2 snapshot (8) and the 3-iteration log line of 9
FILES = [".snapkeep/log.json", ".snapkeep/log_iter.jsonl.json",
         ".snapkeep/snapshot_iter_12.json", ".snapkeep/snapshot_iter_16.json",
         "log", "log_iter.jsonl", "snapshot_iter_12", "snapshot_iter_16"]
ROW_KEYS = ["epoch", "iteration", "train/loss", "lr", "val/loss", "val/acc"]


def _run(script: Path, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``script``: the snapkeep example in a process of its own forked by a zygote that
    imported torch and snapkeep once (tests/support/zygote.py); any other script (ppe's own
    spelling: no snapkeep in its process) in a new interpreter."""
    full_env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1",
                    SNAPKEEP_EXAMPLE_OUT=str(out), EPOCHS=str(EPOCHS), **env)
    if script == SCRIPT:
        base = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
        return zygote.run(zygote.shared(("torch", "snapkeep"), base), str(script), [],
                          cwd=str(out.parent), env=full_env, timeout=300)
    return subprocess.run([sys.executable, str(script)], cwd=out.parent, env=full_env,
                          capture_output=True, text=True, timeout=300, check=False)


def _listing(directory: Path) -> list[str]:
    # the store's lock file (.snapkeep/*.lock) stays by design
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.suffix != ".lock")


def _without_time(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert all(e["elapsed_time"] > 0 for e in entries)
    return [{k: v for k, v in e.items() if k != "elapsed_time"} for e in entries]


def _logs(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    per_epoch = json.loads((out / "log").read_text())
    per_3 = [json.loads(line) for line in (out / "log_iter.jsonl").read_text().splitlines()]
    return _without_time(per_epoch), _without_time(per_3)


def _printed_rows(stdout: str) -> list[list[str]]:
    """PrintReport's rows (each starts with ppe's erase-below sequence), as cells."""
    cells = [line.split("\x1b[J")[-1].split() for line in stdout.split("\n") if "\x1b[J" in line]
    # ppe's own progress bar erases with the same sequence: its lines start with words
    return [row for row in cells if row and row[0].isdigit()]


def _start(stdout: str) -> int:
    found = re.search(r"^starting at iteration (\d+)$", stdout, re.M)
    assert found, stdout
    return int(found.group(1))


def _model(out: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(out / f"snapshot_iter_{step}", weights_only=True)
    return state["models"]["main"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("straight") / "result"
    done = _run(SCRIPT, out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_example_trains_logs_prints_and_snapshots(straight):
    out, stdout = straight
    assert _start(stdout) == 0 and "finished at iteration 16" in stdout
    per_epoch, per_3 = _logs(out)
    assert [(e["epoch"], e["iteration"]) for e in per_epoch] == [(1, 4), (2, 8), (3, 12), (4, 16)]
    assert all(set(e) == set(ROW_KEYS) for e in per_epoch)
    assert [e["lr"] for e in per_epoch] == pytest.approx([0.05, 0.035, 0.0245, 0.01715])
    assert [e["iteration"] for e in per_3] == [3, 6, 9, 12, 15]
    # the printed report: ppe's header, then one row per epoch with the logged values
    assert "epoch       iteration   train/loss  lr          val/loss    val/acc" in stdout
    rows = _printed_rows(stdout)
    assert rows == [[format(e[k], "g") for k in ROW_KEYS] for e in per_epoch]
    assert "16 iter, 4 epoch / 4 epochs" in stdout  # the progress bar's status
    assert _listing(out) == FILES  # n_retains=2, a checksum manifest for each file
    state = torch.load(out / "snapshot_iter_16", weights_only=True)
    log_state = state["extensions"]["LogReport"]["extension"]
    assert json.loads(log_state["_log"])[-1]["iteration"] == 16
    assert state["extensions"]["LRScheduler"]["extension"]["scheduler"]["last_epoch"] == 4


@pytest.mark.parametrize(("writer", "resumable"), [("simple", {8}), ("thread", {4, 8})])
def test_killed_and_rerun_log_has_every_epoch_once_with_the_same_values(
        tmp_path, straight, writer, resumable):
    straight_out, _ = straight
    out = tmp_path / "result"
    killed = _run(SCRIPT, out, WRITER=writer, KILL_AT_ITERATION=str(KILL_AT))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "finished" not in killed.stdout
    # the killed run's files are ahead of its last snapshot (log_iter.jsonl has iteration 9)
    assert [json.loads(line)["iteration"]
            for line in (out / "log_iter.jsonl").read_text().splitlines()] == [3, 6, 9]

    rerun = _run(SCRIPT, out, WRITER=writer)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _start(rerun.stdout) in resumable
    assert _logs(out) == _logs(straight_out)  # every period once, the same numbers
    expected_model = _model(straight_out, 16)
    resumed_model = _model(out, 16)
    assert expected_model.keys() == resumed_model.keys()
    assert all(torch.equal(expected_model[k], resumed_model[k]) for k in expected_model)
    assert _listing(out) == FILES
    # ppe's PrintReport reprints the restored log first: every epoch once in the rerun
    assert [row[0] for row in _printed_rows(rerun.stdout)] == ["1", "2", "3", "4"]


def test_the_same_script_under_ppe_writes_the_same_log(tmp_path, straight):
    pytest.importorskip("pytorch_pfn_extras")
    text = SCRIPT.read_text()
    swapped = text.replace("import snapkeep as ppe", "import pytorch_pfn_extras as ppe")
    swapped = swapped.replace("import snapkeep.training.extensions as",
                              "import pytorch_pfn_extras.training.extensions as")
    imports = [line for line in swapped.splitlines() if line.startswith("import ")]
    assert [line.split("#")[0].strip() for line in imports if "pfn" in line.split("#")[0]] == [
        "import pytorch_pfn_extras as ppe",
        "import pytorch_pfn_extras.training.extensions as extensions"]
    assert "import snapkeep" not in swapped
    script = tmp_path / "ppe_original.py"
    script.write_text(swapped)
    out = tmp_path / "result"
    done = _run(script, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _logs(out) == _logs(straight[0])
    assert _printed_rows(done.stdout) == _printed_rows(straight[1])
