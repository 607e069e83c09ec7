"""Manifests are untrusted input: a versioned schema, bounded reads of regular files only; a bad
one is a ManifestError (the snapshot unverified), never a crash, a hang or disabled retention."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import snapkeep
from snapkeep._core.errors import ManifestError, SnapshotError
from snapkeep._core.format.manifest import (
    FORMAT,
    MAX_MANIFEST_BYTES,
    Manifest,
    manifest_path,
    read_manifest,
)
from snapkeep._core.storage import resolve_storage

GOOD = {"format": FORMAT, "name": "snapshot_iter_1", "size_bytes": 10,
        "checksum": "0" * 32, "algorithm": "xxh3_128", "step": 1, "created_unix_s": 1.5,
        "snapkeep_version": "0.1", "run_id": "abc", "metrics": {"loss": 0.5}}

BAD_FIELDS = [
    ({"size_bytes": "10"}, "size_bytes"),
    ({"size_bytes": -1}, "size_bytes"),
    ({"size_bytes": True}, "size_bytes"),
    ({"size_bytes": 1.5}, "size_bytes"),
    ({"checksum": 123}, "checksum"),
    ({"checksum": "zz"}, "checksum"),
    ({"checksum": "A" * 32}, "checksum"),
    ({"algorithm": "md5"}, "algorithm"),
    ({"step": "3"}, "step"),
    ({"step": 1.5}, "step"),
    ({"step": -2}, "step"),
    ({"name": 7}, "name"),
    ({"name": ""}, "name"),
    ({"name": "a/b"}, "name"),
    ({"run_id": 5}, "run_id"),
    ({"run_id": ["x"]}, "run_id"),
    ({"metrics": [1, 2]}, "metrics"),
    ({"metrics": {"loss": "low"}}, "metrics"),
    ({"metrics": {"loss": None}}, "metrics"),
    ({"metrics": {str(i): 1.0 for i in range(2000)}}, "metrics"),
    ({"created_unix_s": "yesterday"}, "created_unix_s"),
    ({"snapkeep_version": "v" * 5000}, "snapkeep_version"),
    ({"format": "snapkeep.manifest/2"}, "format"),
    ({"format": None}, "format"),
    ({"checksum": None}, "checksum"),
]


def _write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_a_valid_manifest_round_trips_and_absence_is_none(tmp_path):
    storage, d = resolve_storage(str(tmp_path))
    path = os.path.join(d, "m.json")
    assert read_manifest(storage, path) is None
    manifest = Manifest.from_bytes(json.dumps(GOOD).encode())
    _write(path, manifest.to_bytes())
    assert read_manifest(storage, path) == manifest
    # fields of a later minor version are ignored
    _write(path, json.dumps({**GOOD, "added_later": [1]}).encode())
    assert read_manifest(storage, path) == manifest


@pytest.mark.parametrize(("change", "field"), BAD_FIELDS)
def test_wrongly_typed_fields_are_a_manifest_error_naming_the_field(tmp_path, change, field):
    storage, d = resolve_storage(str(tmp_path))
    path = os.path.join(d, "m.json")
    _write(path, json.dumps({**GOOD, **change}).encode())
    with pytest.raises(ManifestError, match=f"{path}.*{field}") as info:
        read_manifest(storage, path)
    assert isinstance(info.value, SnapshotError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("data", [
    b"", b"\xff\xfe", b"[1, 2]", b"null", b'"text"', b"{" * 100_000, b'{"format": 1',
    json.dumps({k: v for k, v in GOOD.items() if k != "checksum"}).encode(),
])
def test_not_a_manifest_is_a_manifest_error(tmp_path, data):
    storage, d = resolve_storage(str(tmp_path))
    path = os.path.join(d, "m.json")
    _write(path, data)
    with pytest.raises(ManifestError, match="m.json"):
        read_manifest(storage, path)


def test_an_oversized_manifest_is_refused_after_a_bounded_read(tmp_path):
    storage, d = resolve_storage(str(tmp_path))
    path = os.path.join(d, "m.json")
    body = {**GOOD, "padding": "x" * (MAX_MANIFEST_BYTES + 10)}
    _write(path, json.dumps(body).encode())
    with pytest.raises(ManifestError, match="limit"):
        read_manifest(storage, path)


def _make_special(kind: str, path: str, tmp_path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "device":
        os.symlink("/dev/zero", path)
    elif kind == "symlink_to_fifo":
        os.mkfifo(tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", path)


SPECIAL = ["fifo", "directory", "device", "symlink_to_fifo"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SPECIAL)
def test_special_files_are_refused_without_blocking(tmp_path, kind):
    storage, d = resolve_storage(str(tmp_path))
    path = os.path.join(d, "m.json")
    _make_special(kind, path, tmp_path)
    with pytest.raises(ManifestError, match="not a regular file"):
        read_manifest(storage, path)


def _train(out, iterations, *, n_retains=-1, autoload=False):
    model = torch.nn.Linear(2, 2)
    writer = snapkeep.writing.SimpleWriter()
    manager = snapkeep.training.ExtensionsManager(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 100, iters_per_epoch=1,
        writer=writer, out_dir=str(out))
    manager.extend(snapkeep.training.extensions.snapshot(n_retains=n_retains, autoload=autoload),
                   trigger=(1, "iteration"))
    if autoload:
        manager.start_extensions()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "out_dir already holds snapshots"
            manager.start_extensions()
    for _ in range(iterations):
        with manager.run_iteration():
            pass
    return manager


BAD_MANIFESTS = {
    "metrics_list": lambda p, tmp: _write(p, json.dumps({**_read(p), "metrics": [1]}).encode()),
    "size_string": lambda p, tmp: _write(p, json.dumps({**_read(p), "size_bytes": "9"}).encode()),
    "run_id_number": lambda p, tmp: _write(p, json.dumps({**_read(p), "run_id": 3}).encode()),
    "fifo": lambda p, tmp: (os.unlink(p), os.mkfifo(p)),
    "symlink_to_fifo": lambda p, tmp: (os.unlink(p), _make_special("symlink_to_fifo", p, tmp)),
}


def _read(path) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(BAD_MANIFESTS))
def test_autoload_treats_a_bad_manifest_as_unverified_never_crashes(tmp_path, kind):
    _train(tmp_path, 2).finalize()
    storage, d = resolve_storage(str(tmp_path))
    newest = os.path.join(d, "snapshot_iter_2")
    BAD_MANIFESTS[kind](manifest_path(storage, newest), tmp_path)
    with pytest.warns(RuntimeWarning, match="snapshot_iter_2"):
        manager = _train(tmp_path, 0, autoload=True)
    assert manager.iteration == 2
    manager.finalize()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["metrics_list", "size_string", "fifo"])
def test_a_bad_manifest_does_not_disable_retention(tmp_path, kind):
    manager = _train(tmp_path, 2, n_retains=2)
    storage, d = resolve_storage(str(tmp_path))
    BAD_MANIFESTS[kind](manifest_path(storage, os.path.join(d, "snapshot_iter_1")), tmp_path)
    for _ in range(3):
        with manager.run_iteration():
            pass
    manager.finalize()
    names = [n for n in os.listdir(tmp_path) if n.startswith("snapshot_iter_")]
    assert "snapshot_iter_2" not in names and "snapshot_iter_3" not in names
    assert {"snapshot_iter_4", "snapshot_iter_5"} <= set(names)


@pytest.mark.timeout(120)
def test_a_fifo_named_like_a_snapshot_is_never_listed_nor_opened(tmp_path):
    from snapkeep._core.store.files import SnapshotStore as Catalog

    _train(tmp_path, 1).finalize()
    os.mkfifo(tmp_path / "snapshot_iter_9")  # newest by name; reading it would block forever
    storage, d = resolve_storage(str(tmp_path))
    assert [e.name for e in Catalog(storage, d, "snapshot_iter_{step}").entries()] == \
        ["snapshot_iter_1"]
    with pytest.raises(OSError, match="FIFO"):
        storage.open_read(os.path.join(d, "snapshot_iter_9"))
    manager = _train(tmp_path, 0, autoload=True)
    assert manager.iteration == 1
    manager.finalize()
