"""Manifests are read through one function (``read_manifest``); a manifest that is valid JSON
but not a valid manifest (wrongly typed fields) makes its snapshot "unverified" with a warning
naming it: autoload never crashes on it and retention keeps running."""

from __future__ import annotations

import json
import logging

import pytest

from snapkeep._core.format.manifest import ManifestError, read_manifest
from snapkeep._core.storage import resolve_storage
from support.integration import assert_params, listing, make_run, train

BAD_FIELDS = [
    pytest.param({"metrics": [1, 2]}, id="metrics-list"),
    pytest.param({"size_bytes": "large"}, id="size-string"),
    pytest.param({"run_id": 7}, id="run_id-int"),
    pytest.param({"step": [3]}, id="step-list"),
]


def _spoil(out, step: int, fields) -> str:
    path = out / ".snapkeep" / f"snapshot_iter_{step}.json"
    body = json.loads(path.read_text())
    body.update(fields)
    path.write_text(json.dumps(body))
    return str(path)


@pytest.mark.parametrize("fields", BAD_FIELDS)
def test_read_manifest_refuses_wrong_types(tmp_path, fields):
    manager, _, model = make_run(tmp_path)
    train(manager, model, 1)
    manager.finalize()
    path = _spoil(tmp_path, 1, fields)
    storage, _ = resolve_storage(str(tmp_path))
    with pytest.raises(ManifestError, match="manifest .*snapshot_iter_1.json") as info:
        read_manifest(storage, path)
    assert isinstance(info.value, ValueError)
    assert read_manifest(storage, path + ".absent") is None


@pytest.mark.parametrize("fields", BAD_FIELDS)
def test_autoload_loads_it_as_unverified_with_a_warning(tmp_path, fields):
    manager, _, model = make_run(tmp_path)
    train(manager, model, 2)
    manager.finalize()
    path = _spoil(tmp_path, 2, fields)
    manager, _, model = make_run(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"manifest {path}.*unverified"):
        manager.start_extensions()
    assert manager.iteration == 2
    assert_params(model, 2)
    manager.finalize()


@pytest.mark.parametrize("fields", BAD_FIELDS)
def test_retention_keeps_running(tmp_path, fields, caplog):
    manager, _, model = make_run(tmp_path, n_retains=2)
    train(manager, model, 3)
    _spoil(tmp_path, 2, fields)
    with caplog.at_level(logging.ERROR, logger="snapkeep"), \
            pytest.warns(RuntimeWarning, match="snapshot_iter_2.json"):
        train(manager, model, 3)
    manager.finalize()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR
                and "retention" in r.getMessage()]  # no failed retention pass
    # this run committed snapshot_iter_2, so its unreadable metadata does not protect it
    assert listing(tmp_path) == [".snapkeep/snapshot_iter_5.json", ".snapkeep/snapshot_iter_6.json",
                                 "snapshot_iter_5", "snapshot_iter_6"]


def test_after_a_restart_an_unverified_snapshot_of_unknown_run_is_kept(tmp_path):
    manager, _, model = make_run(tmp_path, n_retains=3)
    train(manager, model, 3)
    manager.finalize()
    _spoil(tmp_path, 1, {"metrics": "oops"})
    manager, _, model = make_run(tmp_path, n_retains=2)
    with pytest.warns(RuntimeWarning, match="snapshot_iter_1.json"):
        train(manager, model, 2)
    manager.finalize()
    assert [p for p in listing(tmp_path) if not p.startswith(".")] == [
        "snapshot_iter_1", "snapshot_iter_4", "snapshot_iter_5"]
