"""A snapshot file copied under another step's name (``snapshot_iter_2`` copied to
``snapshot_iter_9``) must not be resumed silently: "latest" is the step in the name, but the
file holds iteration 2. Found by the breaker session: autoload loads the copy, the manager goes
back to iteration 2, and since the copy has no manifest of this run, retention never deletes it,
so every restart goes back to iteration 2 again; ``snapkeep verify`` also reports "autoload would
resume from snapshot_iter_9". Real files."""

from __future__ import annotations

import shutil

import snapkeep
from support.integration import make_run, train


def test_a_snapshot_copied_under_a_newer_steps_name_is_not_resumed(tmp_path):
    manager, _, model = make_run(tmp_path)
    manager.start_extensions()
    train(manager, model, 3)
    manager.finalize()
    shutil.copy(tmp_path / "snapshot_iter_2", tmp_path / "snapshot_iter_9")

    manager, _, model = make_run(tmp_path)
    try:
        manager.start_extensions()
    except snapkeep.StateMismatchError as e:  # refusing it, naming the file, is acceptable
        assert "snapshot_iter_9" in str(e)
    else:  # skipping it (with a warning) and resuming the newest consistent one is too
        assert manager.iteration == 3
    finally:
        manager.finalize()


def test_a_snapshot_copied_with_its_manifest_under_another_name_fails_verification(tmp_path,
                                                                                    capfd):
    manager, _, model = make_run(tmp_path)
    manager.start_extensions()
    train(manager, model, 3)
    manager.finalize()
    shutil.copy(tmp_path / "snapshot_iter_2", tmp_path / "snapshot_iter_9")
    shutil.copy(tmp_path / ".snapkeep" / "snapshot_iter_2.json",
                tmp_path / ".snapkeep" / "snapshot_iter_9.json")

    manager, _, model = make_run(tmp_path)
    try:
        capfd.readouterr()
        manager.start_extensions()
        notice = capfd.readouterr().err.splitlines()
        assert notice[0] == f"snapkeep: resuming from snapshot_iter_3 (step 3) in {tmp_path}"
        assert notice[1].startswith("snapkeep: skipped snapshot_iter_9 (step 9): ")
        assert "records the snapshot 'snapshot_iter_2'" in notice[1] and len(notice) == 2
        assert manager.iteration == 3  # the newest consistent snapshot
    finally:
        manager.finalize()


def test_verify_agrees_with_autoload_on_a_misnamed_copy(tmp_path):
    from click.testing import CliRunner

    from snapkeep.cli import cli

    manager, _, model = make_run(tmp_path)
    manager.start_extensions()
    train(manager, model, 3)
    manager.finalize()
    shutil.copy(tmp_path / "snapshot_iter_2", tmp_path / "snapshot_iter_9")  # no manifest
    result = CliRunner().invoke(cli, ["verify", str(tmp_path), "--json"])
    assert result.exit_code == 1, result.output
    import json

    report = json.loads(result.output)
    status = {s["name"]: s["status"] for s in report["snapshots"]}
    assert status["snapshot_iter_9"] == "corrupt" and status["snapshot_iter_3"] == "ok"
    assert report["newest_loadable"] == "snapshot_iter_3"
