"""Continuation with a real shuffled data loader, end to end: the ppe-style script
``loader_loop.py`` is killed (SIGKILL of its process group, workers included) or preempted
(SIGTERM through ``extensions.preemption()``) inside an iteration, mid-epoch or after an
epoch-end snapshot, and the same command is run again. It must exit 0 with bit-identical
parameters, Adam state, LogReport log and batches (index lists) to an uninterrupted run.

Epochs have 5 batches (37 samples, batch 8, last partial), 3 epochs; snapshots every 4
iterations (resume mid-epoch from 4, 8 or 12) or every 5 (epoch ends: 5, 10).

Each one-process run is a process of its own forked by a zygote that imported torch once
(tests/support/zygote.py); the 2-rank runs are torchrun's (the uninterrupted reference: the same
ranks forked with torchrun's environment).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import zygote
from support.ranks import run_torchrun_forked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("loader_loop.py")
SRC = str(Path(__file__).resolve().parents[2] / "src")
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                PYTHONPATH=SRC + (os.pathsep + path if path else ""))


#: What the script imports before its own code: every one-process run is forked by this test
#: process's zygote that imported them once (tests/support/zygote.py: a real process in a
#: session of its own, SIGKILL of its group, exit codes as subprocess's), not a new
#: interpreter that imports torch (~3 CPU-s a run, 2-3 runs a cell).
PRELOAD = ("torch", "snapkeep", "snapkeep.training", "torchdata.stateful_dataloader")


def _run(out: Path, args: list[str], *, torchrun: bool = False) -> subprocess.CompletedProcess[str]:
    if not torchrun:
        return zygote.run(zygote.shared(PRELOAD, _env()), str(SCRIPT), [str(out), *args],
                          cwd=os.getcwd(), env=_env(), timeout=TIMEOUT_S)
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              "2"]
    proc = subprocess.Popen([*prefix, str(SCRIPT), str(out), *args], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        try:  # nothing left behind: workers and ranks share the session's process group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _log(out: Path) -> list[dict[str, object]]:
    return [{k: v for k, v in entry.items() if k != "elapsed_time"}
            for entry in json.loads((out / "log").read_text())]


_STRAIGHT: dict[tuple[str, ...], Path] = {}


@pytest.fixture(scope="module")
def straight_dir(tmp_path_factory):
    def get(args: tuple[str, ...], torchrun: bool) -> Path:
        # the snapshot interval changes neither the batches nor the results, nor does the
        # worker count of a plain DataLoader (torchdata's StatefulDataLoader draws its
        # generator differently with workers): one uninterrupted run serves those cells
        ignored = {"--every"} | ({"--workers"} if "stateful" not in args else set())
        key = tuple(a for i, a in enumerate(args)
                    if a not in ignored and (i == 0 or args[i - 1] not in ignored))
        if key not in _STRAIGHT:
            out = tmp_path_factory.mktemp("straight")
            if torchrun:  # the same ranks, forked with torchrun's environment (torchrun is
                # what the killed run and its rerun go through)
                run_torchrun_forked(SCRIPT, [str(out), *args], timeout_s=TIMEOUT_S,
                                    env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
            else:
                done = _run(out, list(args))
                assert done.returncode == 0, done.stderr[-3000:]
            _STRAIGHT[key] = out
        return _STRAIGHT[key]
    yield get
    _STRAIGHT.clear()


def _assert_identical(straight: Path, resumed: Path, iterations: int = 15) -> None:
    a = torch.load(straight / "final.pt", weights_only=True)
    b = torch.load(resumed / "final.pt", weights_only=True)
    assert a["iteration"] == b["iteration"] == iterations
    n = len(b["seen"])
    assert 0 < n < iterations and b["seen"] == a["seen"][-n:]  # the rerun fed the same batches
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(),
                      strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(pa[key], pb[key]), key
    assert _log(straight) == _log(resumed)


# (loop shape, loader kind, workers, rng, snapshot interval, interruption at iteration)
CELLS = [
    ("snapkeep", "plain", 0, "global", 4, "kill", 7),
    ("snapkeep", "plain", 0, "global", 5, "kill", 12),
    ("snapkeep", "plain", 0, "generator", 5, "kill", 12),
    ("snapkeep", "plain", 2, "global", 4, "kill", 7),
    ("snapkeep", "plain", 2, "generator", 5, "kill", 12),
    ("snapkeep", "stateful", 0, "generator", 4, "kill", 7),
    ("snapkeep", "stateful", 2, "generator", 5, "kill", 12),
    ("snapkeep", "plain", 0, "global", 4, "term", 7),
    ("ppe", "plain", 0, "global", 4, "kill", 7),
    ("ppe", "plain", 0, "generator", 4, "term", 6),
    ("swap", "plain", 0, "generator", 5, "kill", 12),
    ("swap", "plain", 2, "global", 4, "term", 11),  # resumes from its preemption snapshot
]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: "-".join(map(str, c)))
def test_interrupted_and_rerun_is_bit_identical(tmp_path, straight_dir, cell):
    shape, loader, workers, rng, every, how, at = cell
    if shape == "ppe":
        pytest.importorskip("pytorch_pfn_extras")
    if loader == "stateful":
        pytest.importorskip("torchdata")
    args = ("--shape", shape, "--loader", loader, "--workers", str(workers), "--rng", rng,
            "--every", str(every))
    straight = straight_dir(args, False)
    first = _run(tmp_path, [*args, f"--{how}-at", str(at)])
    assert first.returncode == (-signal.SIGKILL if how == "kill" else 143), first.stderr[-3000:]
    again = _run(tmp_path, list(args))
    assert again.returncode == 0, again.stderr[-3000:]
    _assert_identical(straight, tmp_path)


def test_torchrun_two_ranks_distributed_sampler_killed_mid_epoch(tmp_path, straight_dir):
    """Both ranks SIGKILL themselves inside iteration 7 (epochs of 3 batches a rank); the
    rerun resumes from iteration 4, one batch into the second epoch."""
    args = ("--shape", "ddp", "--every", "4")
    straight = straight_dir(args, True)
    first = _run(tmp_path, [*args, "--kill-at", "7"], torchrun=True)
    assert first.returncode != 0
    again = _run(tmp_path, list(args), torchrun=True)
    assert again.returncode == 0, again.stderr[-3000:]
    _assert_identical(straight, tmp_path, iterations=9)  # 19 samples a rank: 3 batches


def test_mid_epoch_resume_without_loaders_names_the_argument_and_exits_0(tmp_path):
    """Without ``loaders=`` the rerun says what to pass at start, replays a whole loader epoch
    from iteration 4 and so runs 4 bodies past the end: they run uncounted (one warning),
    and the loop ends with exit 0 instead of "Attempted to run a finalized manager"."""
    args = ["--no-loaders"]
    assert _run(tmp_path, [*args, "--kill-at", "7"]).returncode == -signal.SIGKILL
    again = _run(tmp_path, args)
    assert again.returncode == 0, again.stderr[-3000:]
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["iteration"] == 15 and len(final["seen"]) == 15 - 4 + 4
    assert sum("remaining run_iteration bodies run uncounted" in line
               for line in again.stderr.splitlines()) == 1
    hint = [line for line in again.stderr.splitlines()
            if line.startswith("resuming at") and "loaders={'train': loader}" in line]
    assert len(hint) == 1, again.stderr[-3000:]
    assert "resuming at iteration 4, 4 iterations into an epoch of 5" in hint[0]
