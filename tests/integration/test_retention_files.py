"""Retention through the snapshot extension, on real files: exact directory listings, best-N
across a restart, faults during deletion, the newest always kept, the saver rank only."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import snapkeep
from snapkeep._core.store.files import SnapshotStore
from snapkeep.retention import AnyOf, KeepBest, KeepEvery, KeepLatest
from snapkeep.training.extensions._snapshot import _Snapshot
from support.integration import (
    assert_params,
    listing,
    make_model,
    make_run,
    manifests_of,
    snapshots,
    train,
)


def _expect(*steps: int) -> list[str]:
    names = [f"snapshot_iter_{s}" for s in steps]
    return sorted(names + manifests_of(names))


@pytest.mark.parametrize(
    ("kwargs", "iterations", "kept"),
    [
        ({"n_retains": 3}, 10, (8, 9, 10)),
        ({"n_retains": 1}, 4, (4,)),
        ({"n_retains": -1}, 3, (1, 2, 3)),
        ({"n_retains": 0}, 3, (1, 2, 3)),
        ({"retention": KeepEvery(4)}, 10, (4, 8, 10)),
        ({"retention": KeepEvery(4), "n_retains": 2}, 10, (4, 8, 9, 10)),
        ({"retention": AnyOf(KeepEvery(5), KeepLatest(1))}, 12, (5, 10, 12)),
    ],
    ids=["n_retains=3", "n_retains=1", "n_retains=-1", "n_retains=0", "every-4",
         "every-4+n_retains=2", "any-of"],
)
def test_exact_listing_after_n_snapshots(tmp_path, kwargs, iterations, kept):
    manager, _, model = make_run(tmp_path, autoload=False, **kwargs)
    train(manager, model, iterations)
    manager.finalize()
    assert listing(tmp_path) == _expect(*kept)


LOSSES = [0.9, 0.2, 0.8, 0.7, 0.6, 0.1, 0.5, 0.4, 0.3, 0.95]


def test_keep_best_survives_a_restart(tmp_path):
    policy = KeepBest(2, "loss")
    manager, _, model = make_run(tmp_path, retention=policy)
    train(manager, model, 5, LOSSES)  # best so far: step 2 (0.2), step 5 (0.6)
    manager.finalize()
    assert snapshots(tmp_path) == ["snapshot_iter_2", "snapshot_iter_5"]

    # a new process: new manager and extension; the metrics come back from the manifests
    manager, ext, model = make_run(tmp_path, retention=policy)
    assert manager.iteration == 5
    train(manager, model, 4, LOSSES)  # step 6 (0.1) is best; steps 7..9 worse than step 2
    manager.finalize()
    assert listing(tmp_path) == _expect(2, 6, 9)  # best two + the newest


@pytest.mark.parametrize("writer_class", ["SimpleWriter", "ThreadWriter"])
def test_keep_best_with_a_metric_never_reported_stops_the_run_before_deleting(
        tmp_path, writer_class):
    writer = getattr(snapkeep.writing, writer_class)(out_dir=str(tmp_path))
    manager, _, model = make_run(tmp_path, writer=writer, autoload=False,
                                 retention=KeepBest(1, "val/loss"))
    train(manager, model, 1, LOSSES)  # one snapshot: retention has nothing to delete
    with pytest.raises(ValueError) as info:
        train(manager, model, 1, LOSSES)  # this save's retention would delete step 1
    manager.finalize()
    assert str(info.value).startswith(
        "KeepBest metric 'val/loss' is recorded by none of the 2 snapshot manifest(s); the "
        "metrics they record: 'loss'. Nothing was deleted.")
    assert listing(tmp_path) == _expect(1)  # step 2 was not written, step 1 not deleted


def test_keep_best_metric_reported_later_is_accepted(tmp_path):
    """A metric first recorded by a later snapshot (an evaluator that runs less often) is fine
    as long as retention has nothing to delete before it appears."""
    manager, _, model = make_run(tmp_path, autoload=False,
                                 retention=AnyOf(KeepLatest(3), KeepBest(1, "loss")))
    train(manager, model, 2)  # no 'loss' reported yet, nothing to delete
    train(manager, model, 3, LOSSES)  # steps 3..5 report 0.8, 0.7, 0.6
    manager.finalize()
    assert listing(tmp_path) == _expect(3, 4, 5)


class VanishingPolicy:
    """Keeps the newest only and, while retention is planning, deletes the files it is about to
    delete (another process cleaning up at the same moment)."""

    def __init__(self, directory):
        self.directory = directory
        self.vanished: list[str] = []

    def select(self, infos):
        ordered = sorted(infos, key=lambda s: s.key)
        for info in ordered[:-1]:
            for path in (self.directory / info.name, self.directory / manifests_of([info.name])[0]):
                if path.exists():
                    os.remove(path)
                    self.vanished.append(info.name)
        return {ordered[-1].name}


def test_file_vanishing_under_retention_is_not_fatal(tmp_path, caplog):
    policy = VanishingPolicy(tmp_path)
    manager, _, model = make_run(tmp_path, autoload=False, retention=policy)
    train(manager, model, 4)
    manager.finalize()
    assert policy.vanished  # the race happened
    assert listing(tmp_path) == _expect(4)
    assert "retention could not delete" not in caplog.text


class NoDeleteFileSystem(LocalFileSystem):
    """A local filesystem whose deletes fail (a read-only directory for a non-root user)."""

    cachable = False

    def rm_file(self, path):
        raise PermissionError(errno.EACCES, "Permission denied", path)


def test_failing_delete_is_logged_not_fatal(tmp_path, caplog):
    writer = snapkeep.writing.SimpleWriter(fs=NoDeleteFileSystem(), out_dir=str(tmp_path))
    manager, _, model = make_run(tmp_path, writer=writer, autoload=False, n_retains=1)
    with caplog.at_level(logging.WARNING, logger="snapkeep"):
        train(manager, model, 3)
    manager.finalize()
    assert manager.iteration == 3
    assert listing(tmp_path) == _expect(1, 2, 3)
    assert "retention could not delete" in caplog.text
    assert "snapshot_iter_1" in caplog.text and "Permission denied" in caplog.text


class KeepNothing:
    def select(self, infos):
        return set()


def test_newest_is_never_deleted_by_a_policy(tmp_path):
    manager, _, model = make_run(tmp_path, autoload=False, retention=KeepNothing())
    train(manager, model, 3)
    manager.finalize()
    assert listing(tmp_path) == _expect(3)


class NotTheSaver(_Snapshot):
    """A rank other than ``saver_rank`` (as ``_DistributedSnapshot`` on rank != saver_rank)."""

    def _is_saver(self) -> bool:
        return False


def test_retention_and_saving_only_on_the_saver_rank(tmp_path):
    manager, _, model = make_run(tmp_path, autoload=False)
    train(manager, model, 3)
    manager.finalize()
    before = listing(tmp_path)

    model = make_model()
    manager = snapkeep.training.ExtensionsManager(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 100, iters_per_epoch=10,
        writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    other = NotTheSaver(filename="snapshot_iter_{.iteration}", n_retains=1, autoload=True)
    manager.extend(other, trigger=(1, "iteration"))
    assert manager.iteration == 3  # a non-saver rank still loads
    assert other.loaded_entry.name == "snapshot_iter_3"
    assert_params(model, 3)
    train(manager, model, 2)
    manager.finalize()
    assert listing(tmp_path) == before  # and neither wrote nor deleted anything


def test_orphan_manifests_of_the_lineage_are_removed(tmp_path):
    """A kill between deleting a snapshot and deleting its manifest leaves the manifest; the
    next retention pass removes it, but never another run's manifests or other files."""
    manager, ext, model = make_run(tmp_path, n_retains=2)
    train(manager, model, 3)
    manager.finalize()
    manifests = tmp_path / ".snapkeep"
    ours = json.loads((manifests / "snapshot_iter_3.json").read_text())
    (manifests / "snapshot_iter_1.json").write_text(json.dumps(ours))  # the orphan
    theirs = dict(ours, run_id="another-run")
    (manifests / "snapshot_iter_0.json").write_text(json.dumps(theirs))
    (manifests / "notes.json").write_text("{}")

    manager, _, model = make_run(tmp_path, n_retains=2)
    train(manager, model, 1)
    manager.finalize()
    assert listing(tmp_path) == sorted(
        [*_expect(3, 4), ".snapkeep/snapshot_iter_0.json", ".snapkeep/notes.json"])


def test_a_manifest_committed_after_the_listing_is_not_an_orphan(tmp_path):
    """An async writer may commit the next snapshot while retention runs: its manifest appears
    after retention listed the snapshots, but its file exists, so it stays."""
    manager, ext, model = make_run(tmp_path, autoload=False, n_retains=2)
    train(manager, model, 2)
    storage, directory = manager.writer.storage_for(str(tmp_path))
    catalog = SnapshotStore(storage, directory, "snapshot_iter_{step}")
    listed = catalog.entries()  # retention's listing ...
    train(manager, model, 1)  # ... then snapshot 3 commits
    catalog._remove_orphan_manifests(listed, frozenset({ext.run_id}))
    manager.finalize()
    assert (tmp_path / ".snapkeep" / "snapshot_iter_3.json").exists()
