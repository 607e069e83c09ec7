"""Autoload says what it did, on stderr, once per job: the snapshot resumed from and its step
(or a fresh start and the directory), then each snapshot skipped with its reason; ``quiet=True``
silences it. Real processes: a plain script, and torchrun with 2 gloo ranks for
``snapshot(saver_rank=0)`` and ``SnapshotMode.SHARDED`` (whose incomplete directories are
named too). The fresh start under torchrun is checked by test_run_status.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

from snapkeep.distributed import MARKER_NAME
from snapkeep.training import extensions as ext
from support import zygote
from support.ranks import PRELOAD, rank_env

WORKER = Path(__file__).with_name("notice_worker.py")
TIMEOUT_S = 120
TEMPLATE = "'snapshot_iter_{.iteration}'"

needs_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")


def _run(mode: str, out: Path, iterations: int, *extra: str, nproc: int = 0) -> list[str]:
    """Run the worker (under torchrun with ``nproc`` ranks); return its ``snapkeep:`` stderr
    lines, after checking it finished."""
    argv = [mode, str(out), str(iterations), *extra]
    if nproc:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}", str(WORKER), *argv], env=rank_env(),
                              capture_output=True, text=True, timeout=TIMEOUT_S,
                              start_new_session=True)
    else:  # one process of its own, forked by the zygote that imported torch and snapkeep
        # once (tests/support/zygote.py; the one the ranks' first is forked by)
        done = zygote.run(zygote.shared(PRELOAD, rank_env(), "rank0"), str(WORKER), argv,
                          cwd=os.getcwd(), env=rank_env(), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(f"done {iterations}") == max(nproc, 1), done.stdout
    return [line for line in done.stderr.splitlines() if "snapkeep" in line]


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_plain_script_says_fresh_then_resumed_and_what_it_skipped(tmp_path):
    out = tmp_path / "out"
    assert _run("plain", out, 2) == [
        f"snapkeep: no snapshot of {TEMPLATE} in {out}, starting fresh"]
    _truncate(out / "snapshot_iter_2")
    lines = _run("plain", out, 3)
    assert lines[0] == f"snapkeep: resuming from snapshot_iter_1 (step 1) in {out}"
    assert len(lines) == 2 and lines[1].startswith(
        f"snapkeep: skipped snapshot_iter_2 (step 2): {out / 'snapshot_iter_2'}: size "), lines
    assert "truncated" in lines[1]


def test_quiet_silences_the_notice(tmp_path, capfd):
    from snapkeep import writing
    from snapkeep.training import ExtensionsManager

    for quiet in (False, True):
        model = torch.nn.Linear(2, 2)
        manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                                    iters_per_epoch=1, out_dir=str(tmp_path),
                                    writer=writing.SimpleWriter(out_dir=str(tmp_path)))
        manager.extend(ext.snapshot(autoload=True, quiet=quiet))
        capfd.readouterr()
        with manager.run_iteration():
            pass
        manager.finalize()
        err = capfd.readouterr().err
        assert ("snapkeep:" in err) is not quiet, err
    assert err == ""


def test_quiet_must_be_a_bool():
    with pytest.raises(TypeError, match="quiet must be True or False, got 'yes'"):
        ext.snapshot(autoload=True, quiet="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="quiet must be True or False, got 1"):
        ext.snapshot_object(torch.nn.Linear(1, 1), "m_{.iteration}", quiet=1)


@pytest.mark.slow
@needs_gloo
def test_torchrun_saver_rank_says_it_once_per_job(tmp_path):
    out = tmp_path / "out"
    _run("plain", out, 2, "quiet")  # the snapshots (one process: cheaper than torchrun)
    _truncate(out / "snapshot_iter_2")
    lines = _run("distributed", out, 3, nproc=2)
    assert lines[0] == f"snapkeep: resuming from snapshot_iter_1 (step 1) in {out}"
    assert len(lines) == 2, lines  # not once per rank
    assert lines[1].startswith("snapkeep: skipped snapshot_iter_2 (step 2): rank 0: "), lines
    assert "truncated" in lines[1]


@pytest.mark.slow
@needs_gloo
def test_torchrun_sharded_names_an_incomplete_directory_once(tmp_path):
    out = tmp_path / "out"
    assert _run("sharded", out, 2) == [  # one process, no torchrun
        f"snapkeep: no snapshot of {TEMPLATE} in {out}, starting fresh"]
    shutil.copytree(out / "snapshot_iter_2", out / "snapshot_iter_9")
    (out / "snapshot_iter_9" / MARKER_NAME).unlink()  # a save killed before its marker
    assert _run("sharded", out, 3, nproc=2) == [
        f"snapkeep: resuming from snapshot_iter_2 (step 2) in {out}",
        "snapkeep: skipped snapshot_iter_9 (step 9): incomplete sharded directory (no marker: "
        "a save was interrupted); removed"]
    assert not (out / "snapshot_iter_9").exists()
