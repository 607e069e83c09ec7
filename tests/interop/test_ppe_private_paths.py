"""ppe's private import paths that code written against ppe uses keep resolving after the import
switch. ``snapkeep.training.extensions._snapshot`` is the one module that keeps them (its block
labelled ppe compatibility); each name is the object snapkeep's own code uses under its public
name, so a ppe caller gets the real thing, not a copy."""

from __future__ import annotations

import importlib

import pytest

from snapkeep.training.extensions import _distributed, _find, _snapshot_extension

PPE_PRIVATE_PATHS = [
    ("snapkeep.training.extensions._snapshot", "_find_snapshot_files", _find.find_snapshot_files),
    ("snapkeep.training.extensions._snapshot", "_find_latest_snapshot",
     _find.find_latest_snapshot),
    ("snapkeep.training.extensions._snapshot", "_find_stale_snapshots",
     _find.find_stale_snapshots),
    ("snapkeep.training.extensions._snapshot", "_Snapshot", _snapshot_extension.SnapshotExtension),
    ("snapkeep.training.extensions._snapshot", "_DistributedSnapshot",
     _distributed.DistributedSnapshotExtension),
]


@pytest.mark.parametrize(("module", "name", "home"), PPE_PRIVATE_PATHS,
                         ids=[f"{m}.{n}" for m, n, _ in PPE_PRIVATE_PATHS])
def test_ppe_private_path_resolves_to_the_public_object(module: str, name: str, home: object):
    assert getattr(importlib.import_module(module), name) is home


@pytest.mark.parametrize(("cls", "ppe_name"), [
    (_snapshot_extension.SnapshotExtension, "_Snapshot"),
    (_distributed.DistributedSnapshotExtension, "_DistributedSnapshot"),
])
def test_snapshot_classes_keep_ppe_names_as_default_extension_names(cls: type, ppe_name: str):
    # the default extension name keys the extension's state in a manager's state dict (as ppe)
    assert cls.__name__ == cls.__qualname__ == ppe_name


def test_snapshot_returns_the_class_ppe_code_checks_with_isinstance():
    from snapkeep.training.extensions._snapshot import _Snapshot, snapshot

    ext = snapshot()
    assert isinstance(ext, _Snapshot) and type(ext).__name__ == "_Snapshot"
    assert ext.default_name == "_Snapshot"
