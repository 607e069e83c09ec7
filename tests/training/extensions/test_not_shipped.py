"""ppe extensions snapkeep does not ship raise an AttributeError that points to the plug-in path;
names ppe lacks too get Python's ordinary AttributeError."""

from __future__ import annotations

import importlib

import pytest

import snapkeep
from snapkeep._not_shipped import NOT_SHIPPED as NOT_SHIPPED_IN
from snapkeep.training import extensions

NOT_SHIPPED = NOT_SHIPPED_IN["snapkeep.training.extensions"]

SHIPPED = {"Evaluator", "FailOnNonNumber", "LRScheduler", "LogReport", "PrintReport",
           "PrintReportCLI", "ProgressBar", "ProgressBarCLI", "SnapshotMode", "observe_lr",
           "observe_value", "snapshot", "snapshot_object"}
# snapkeep's own additions (distributed and preemption), beside ppe's names
SNAPKEEP_ONLY = {"EXIT_CODE_PREEMPTED", "Preemption", "preemption", "sharded_snapshot",
                 "MemoryTier", "memory_tier"}


@pytest.mark.parametrize("name", sorted(NOT_SHIPPED))
def test_not_shipped_extension_names_itself_and_the_plug_in_path(name):
    with pytest.raises(AttributeError) as info:
        getattr(extensions, name)
    message = str(info.value)
    assert f"ppe's {name}" in message
    assert "ExtensionsManager" in message and "snapkeep.training.extensions.snapshot" in message
    assert not hasattr(snapkeep.training.extensions, name)


@pytest.mark.parametrize("name", ["LogReportt", "Trainer", "foo"])
def test_unknown_names_get_the_ordinary_error(name):
    with pytest.raises(AttributeError) as info:
        getattr(extensions, name)
    assert str(info.value) == (
        f"module 'snapkeep.training.extensions' has no attribute {name!r}")


def test_star_import_exports_only_shipped_names():
    namespace: dict[str, object] = {}
    exec("from snapkeep.training.extensions import *", namespace)
    assert set(namespace) - {"__builtins__"} == SHIPPED | SNAPKEEP_ONLY
    assert set(extensions.__all__) == SHIPPED | SNAPKEEP_ONLY


def test_every_public_ppe_extension_is_shipped_or_explained():
    """Against the installed ppe (0.9.0): nothing of its public surface is silently missing."""
    ppe_extensions = pytest.importorskip("pytorch_pfn_extras.training.extensions")
    public = {n for n in dir(ppe_extensions) if not n.startswith("_")}
    # ppe's implementation modules (log_report, evaluator, ...) are not extension names
    modules = {n for n in public if importlib.util.find_spec(
        f"pytorch_pfn_extras.training.extensions.{n}") is not None} - {"snapshot_writers"}
    # the notebook variants exist in ppe only when IPython is installed
    notebook = {"PrintReportNotebook", "ProgressBarNotebook"}
    assert public - modules - notebook == (SHIPPED | NOT_SHIPPED) - notebook
    assert not SHIPPED & NOT_SHIPPED
