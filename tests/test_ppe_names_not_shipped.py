"""``import snapkeep as ppe``: every public ppe (0.9.0) name snapkeep does not ship raises an
AttributeError that says so and points to the plug-in path; names ppe lacks too get Python's
ordinary error (issue 17 item 6)."""

from __future__ import annotations

import importlib
import inspect

import pytest

import snapkeep
import snapkeep as ppe
from snapkeep._not_shipped import NOT_SHIPPED

MODULES = sorted(NOT_SHIPPED)
CASES = [(module, name) for module in MODULES for name in sorted(NOT_SHIPPED[module])]


@pytest.mark.parametrize(("module", "name"), CASES, ids=[f"{m}.{n}" for m, n in CASES])
def test_a_not_shipped_name_says_so_and_points_to_the_plug_in_path(module, name):
    mod = importlib.import_module(module)
    with pytest.raises(AttributeError) as info:
        getattr(mod, name)
    message = str(info.value)
    assert message.startswith(f"{module} has no {name!r}: snapkeep does not ship ppe's {name} ")
    assert "pytorch_pfn_extras" + module[len("snapkeep"):] + f".{name}" in message
    assert "snapkeep.training.extensions.snapshot(...)" in message
    assert "writer=snapkeep.writing.ThreadWriter(...)" in message
    assert not hasattr(mod, name)


def test_ppe_mnist_example_names():
    """The ppe names of ppe's example/mnist.py (and its neighbours) that snapkeep lacks."""
    for reach in (lambda: ppe.nn.ensure, lambda: ppe.writing.TensorBoardWriter, lambda: ppe.to,
                  lambda: ppe.cuda, lambda: ppe.handler, lambda: ppe.runtime,
                  lambda: ppe.training.Trainer,
                  lambda: ppe.training.extensions.PlotReport):
        with pytest.raises(AttributeError, match="snapkeep does not ship ppe's"):
            reach()
    # what it uses that snapkeep ships still works
    assert ppe.training.ExtensionsManager and ppe.training.extensions.snapshot
    assert ppe.reporting.report and ppe.writing.ThreadWriter


@pytest.mark.parametrize("module", MODULES)
def test_unknown_names_get_the_ordinary_error(module):
    with pytest.raises(AttributeError) as info:
        _ = importlib.import_module(module).no_such_name
    assert str(info.value) == f"module {module!r} has no attribute 'no_such_name'"


def _ppe_public(ppe_module):
    """ppe's own public names: not typing helpers or other libraries' modules it imported."""
    out = set()
    for name in dir(ppe_module):
        if name.startswith("_"):
            continue
        obj = getattr(ppe_module, name)
        if inspect.ismodule(obj) and not obj.__name__.startswith("pytorch_pfn_extras"):
            continue
        if getattr(obj, "__module__", None) in ("typing", "typing_extensions") \
                or name in {"TYPE_CHECKING", "overload"}:
            continue
        out.add(name)
    return out


@pytest.mark.parametrize("module", MODULES)
def test_every_public_ppe_name_is_shipped_or_explained(module):
    """Against the installed ppe (0.9.0): nothing of these modules is silently missing."""
    pytest.importorskip("pytorch_pfn_extras")
    ppe_module = importlib.import_module("pytorch_pfn_extras" + module[len("snapkeep"):])
    mine = importlib.import_module(module)
    public = _ppe_public(ppe_module)
    if module == "snapkeep.training.extensions":  # ppe's implementation modules
        public = {n for n in public if importlib.util.find_spec(
            f"pytorch_pfn_extras.training.extensions.{n}") is None or n == "snapshot_writers"}
    shipped = {n for n in public if hasattr(mine, n) or (
        hasattr(mine, "__path__") and importlib.util.find_spec(f"{module}.{n}") is not None)}
    notebook = {"PrintReportNotebook", "ProgressBarNotebook"}  # in ppe only with IPython
    assert public - shipped - notebook == NOT_SHIPPED[module] - notebook
    assert snapkeep.__name__ == "snapkeep"
