"""Run lineage: a new experiment pointed at an old output directory is told so, and its
retention never deletes another run's snapshots; a resumed run keeps its run id."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from support.integration import listing, make_run, manifests_of, snapshots, train


def _run_ids(directory) -> dict[str, str | None]:
    out = {}
    for name in snapshots(directory):
        path = directory / manifests_of([name])[0]
        out[name] = json.loads(path.read_text())["run_id"] if path.exists() else None
    return out


def test_autoload_false_beside_another_run_warns_once_and_spares_its_snapshots(tmp_path):
    first, ext_a, model = make_run(tmp_path, autoload=False, n_retains=2)
    train(first, model, 5)
    first.finalize()
    assert snapshots(tmp_path) == ["snapshot_iter_4", "snapshot_iter_5"]

    second, ext_b, model = make_run(tmp_path, autoload=False, n_retains=2)
    with pytest.warns(UserWarning, match="already holds 2 snapshot") as record:
        assert second.iteration == 0
    assert len([w for w in record if "already holds" in str(w.message)]) == 1
    assert ext_a.run_id in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning while training
        train(second, model, 3)
    second.finalize()

    ids = _run_ids(tmp_path)
    assert ids == {"snapshot_iter_2": ext_b.run_id, "snapshot_iter_3": ext_b.run_id,
                   "snapshot_iter_4": ext_a.run_id, "snapshot_iter_5": ext_a.run_id}


def test_resume_adopts_the_run_id_and_prunes_its_own_lineage(tmp_path):
    first, ext_a, model = make_run(tmp_path, n_retains=2)
    train(first, model, 3)
    first.finalize()

    second, ext_b, model = make_run(tmp_path, n_retains=2)
    assert second.iteration == 3
    assert ext_b.run_id == ext_a.run_id
    train(second, model, 2)
    second.finalize()
    assert snapshots(tmp_path) == ["snapshot_iter_4", "snapshot_iter_5"]
    assert set(_run_ids(tmp_path).values()) == {ext_a.run_id}


def test_resume_from_ppe_files_prunes_them_as_part_of_the_lineage(tmp_path):
    first, _, model = make_run(tmp_path, autoload=False)
    train(first, model, 3)
    first.finalize()
    shutil.rmtree(tmp_path / ".snapkeep")  # as written by ppe: no manifests

    second, ext, model = make_run(tmp_path, n_retains=2)
    with pytest.warns(RuntimeWarning, match="no checksum manifest"):
        assert second.iteration == 3
    train(second, model, 2)
    second.finalize()
    assert listing(tmp_path) == sorted(["snapshot_iter_4", "snapshot_iter_5",
                                        *manifests_of(["snapshot_iter_4", "snapshot_iter_5"])])
    assert set(_run_ids(tmp_path).values()) == {ext.run_id}


def test_foreign_ppe_files_are_kept_when_not_resumed(tmp_path):
    torch.save({"not": "ours"}, tmp_path / "snapshot_iter_100")
    run, _, model = make_run(tmp_path, autoload=False, n_retains=1)
    with pytest.warns(UserWarning, match="run ids unknown"):
        train(run, model, 3)
    run.finalize()
    assert snapshots(tmp_path) == ["snapshot_iter_3", "snapshot_iter_100"]


def test_resume_through_a_manifest_less_newest_keeps_the_older_run_id(tmp_path):
    """A crash between a snapshot's commit and its manifest's leaves a newest file without a
    manifest; the resumed run still belongs to the lineage of the older snapshots."""
    first, ext_a, model = make_run(tmp_path, n_retains=3)
    train(first, model, 3)
    first.finalize()
    (tmp_path / manifests_of(["snapshot_iter_3"])[0]).unlink()

    second, ext_b, model = make_run(tmp_path, n_retains=3)
    with pytest.warns(RuntimeWarning, match="no checksum manifest"):
        assert second.iteration == 3
    assert ext_b.run_id == ext_a.run_id
    train(second, model, 3)
    second.finalize()
    assert snapshots(tmp_path) == ["snapshot_iter_4", "snapshot_iter_5", "snapshot_iter_6"]
