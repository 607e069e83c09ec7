"""snapkeep.Checkpointer under torch.distributed: FSDP2 (fully_shard) state on 2 gloo ranks goes
through DCP as sharded snapshots; the loop killed with SIGKILL on every rank at a random step and
rerun ends bit-identical to an uninterrupted run (issue 20's done-when, sharded)."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
import torch

from support import ranks
from support.killing import assert_identical

WORKER = Path(__file__).with_name("checkpointer_worker.py")
ITERS = 14
BOUND_S = 240.0
MARKER = ".snapkeep-commit.json"


def _kill_after(tmp: Path, out: Path, report: Path, step: int) -> None:
    procs = ranks.start(WORKER, 2, [str(tmp / f"init-kill-{step}"), str(out), str(report),
                                    str(ITERS)])
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            words = line.split()
            if len(words) == 2 and words[0] == "step" and int(words[1]) >= step \
                    and any((d / MARKER).is_file() for d in out.glob("ckpt_*")):
                # past `step`, and a snapshot is committed: save() returns once staged, so
                # the step-2 commit may still run when "step 3" is printed (seen under load)
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        ranks.finish(procs, BOUND_S)


@pytest.mark.slow
@pytest.mark.timeout(4 * BOUND_S)
def test_fsdp2_plain_loop_killed_at_a_random_step_ends_bit_identical(tmp_path: Path) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    for d in (reference, killed):
        d.mkdir()
    ranks.run(WORKER, 2, [str(tmp_path / "init-ref"), str(reference / "ckpt"), str(reference),
                          str(ITERS)], timeout_s=BOUND_S)
    seed = random.randrange(2 ** 32)
    step = random.Random(seed).randrange(3, ITERS - 1)
    _kill_after(tmp_path, killed / "ckpt", killed, step)
    assert not (killed / "final.pt").exists(), f"seed {seed}: the kill came too late"
    outputs = ranks.run(WORKER, 2, [str(tmp_path / "init-rerun"), str(killed / "ckpt"),
                                    str(killed), str(ITERS)], timeout_s=BOUND_S)
    assert all(f"step {ITERS}" in o for o in outputs), outputs
    resumed = [int(line.split()[-1]) for o in outputs for line in o.splitlines()
               if line.startswith("resumed at")]
    assert len(resumed) == 2 and resumed[0] == resumed[1] >= 2, outputs  # a resume, not a restart
    assert_identical(torch.load(reference / "final.pt", weights_only=True),
             torch.load(killed / "final.pt", weights_only=True), f"seed {seed}, kill at {step}")
    listing = sorted(os.listdir(killed / "ckpt"))
    assert listing == [".snapkeep", f"ckpt_{ITERS - 2}", f"ckpt_{ITERS}"], listing
    assert sorted(os.listdir(killed / "ckpt" / f"ckpt_{ITERS}")) == [
        ".metadata", ".snapkeep-commit.json", ".snapkeep-in-progress", "__0_0.distcp",
        "__1_0.distcp"]  # the in-progress mark stays: the sweep's proof that snapkeep wrote it


@pytest.mark.timeout(2 * BOUND_S)
def test_a_held_directory_is_refused_on_every_rank(tmp_path: Path) -> None:
    import snapkeep

    with snapkeep.Checkpointer(tmp_path / "ckpt", sharded=True):  # another job holds it
        outputs = ranks.run(WORKER, 2, [str(tmp_path / "init"), str(tmp_path / "ckpt"),
                                        str(tmp_path), "0"], timeout_s=BOUND_S)
    assert "refused: StoreLockedError" in outputs[0], outputs
    assert "refused: RankFailedError" in outputs[1], outputs
    outputs = ranks.run(WORKER, 2, [str(tmp_path / "init2"), str(tmp_path / "ckpt"),
                                    str(tmp_path), "0"], timeout_s=BOUND_S)
    assert all("opened" in o for o in outputs), outputs  # released: free again


RETENTION_WORKER = Path(__file__).with_name("checkpointer_retention_worker.py")


def _other_runs_snapshots(out: Path, steps: list[int]) -> None:
    """Committed sharded snapshots of another run under the Checkpointer's template (as a
    manager's SHARDED extension writes them: a run id, and a ``val_loss`` metric)."""
    from snapkeep.distributed import ShardedJob, ShardedSaver, ShardedStore
    from snapkeep.store import resolve_storage, step_template

    storage, path = resolve_storage(str(out))
    storage.makedirs(path)
    saver = ShardedSaver(ShardedStore(storage, path, step_template("ckpt_{step}")), None)
    try:
        for step in steps:
            saver.save({"w": torch.ones(3)}, ShardedJob(
                name=f"ckpt_{step}", step=step, run_id="a-manager-run",
                metrics={"val_loss": 0.5}, version="test"))
            saver.wait()
    finally:
        saver.close()


def _committed(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if (p / MARKER).is_file())


@pytest.mark.timeout(2 * BOUND_S)
def test_retention_deletes_only_the_checkpointers_own_snapshots(tmp_path: Path) -> None:
    """As the single-file Checkpointer's (store.retain with its lineage): another run's
    snapshots under the same template are never deleted, nor counted."""
    out = tmp_path / "ckpt"
    _other_runs_snapshots(out, [1, 2])
    outputs = ranks.run(RETENTION_WORKER, 2, [str(tmp_path / "init"), str(out), "latest",
                                              "3,4,5"], timeout_s=BOUND_S)
    assert all("done" in o for o in outputs), outputs
    assert _committed(out) == ["ckpt_1", "ckpt_2", "ckpt_5"], outputs


@pytest.mark.timeout(2 * BOUND_S)
def test_a_keep_best_metric_no_manifest_records_deletes_nothing_and_is_named(
        tmp_path: Path) -> None:
    """KeepBest by a metric none of the Checkpointer's manifests records: the save whose
    retention would delete is refused before anything is written (the engine session's
    retention input check, as the manager's): ValueError naming the metrics its manifests do
    record (another run's do not count) on rank 0, RankFailedError naming rank 0 on the
    others; nothing is deleted. (Before: a log line after each commit, every snapshot kept.)"""
    out = tmp_path / "ckpt"
    _other_runs_snapshots(out, [1, 2])
    outputs = ranks.run(RETENTION_WORKER, 2, [str(tmp_path / "init"), str(out),
                                              "best:val_loss", "3,4,5"], timeout_s=BOUND_S)
    assert all("done" in o for o in outputs), outputs
    assert "refused at step 4: ValueError: KeepBest metric 'val_loss' is recorded by none of " \
           "the 2 snapshot manifest(s); the metrics they record: none. Nothing was deleted." \
           in outputs[0], outputs
    assert "refused at step 4: RankFailedError" in outputs[1], outputs
    assert _committed(out) == ["ckpt_1", "ckpt_2", "ckpt_3"], outputs
