"""tools/structure_report.py measures what it says: on a small package built here, each figure
is the known one; its trace of a real save and resume sees the writer and the store."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import textwrap

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "structure_report.py"
SRC = TOOL.parents[1] / "src"


def _tool():
    spec = importlib.util.spec_from_file_location("structure_report_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FILES = {
    "__init__.py": "from snapkeep.pub import api\n",
    "pub.py": "from snapkeep._home import api, _helper\n__all__ = ['api']\n",  # facade
    "_home.py": """
        def api():
            return _helper()

        def _helper():
            return 1
        """,
    "_shim.py": "'''moved'''\nfrom snapkeep._home import api\n__all__ = ['api']\n",
    "_mixed.py": """
        from snapkeep._home import _helper, api

        def g():
            return _helper()
        """,
    "_c.py": "from snapkeep._d import dee\n\ndef cee():\n    return dee\n",
    "_d.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from snapkeep._e import e
        from snapkeep._c import cee

        def dee():
            from snapkeep._e import e
            return cee, e
        """,
    "_e.py": "from snapkeep._d import dee\n\ndef e():\n    return dee\n",
    "_ops.py": """
        def verify(storage, manifest):
            digest = digest_file(storage)
            if digest != manifest.checksum:
                raise ValueError

        def record(storage):
            return digest_file(storage)

        def newest(entries):
            for entry in reversed(entries):
                if entry.ok:
                    return entry
            return None

        def newest_sorted(entries):
            ordered = sorted(entries, reverse=True)
            for entry in ordered:
                return entry

        def delete(storage, path):
            for target in (path, manifest_path(storage, path)):
                storage.remove(target)

        def remove_marker(storage, path):
            storage.remove(marker_path(path))
        """,
    "_objs.py": """
        class Box:
            def __init__(self):
                self._v = 1

            def merge(self, other):
                return self._v + other._v

        def peek(box):
            return box._v
        """,
    "sub/__init__.py": "from snapkeep.sub._impl import thing\n",
    "sub/_impl.py": "thing = 1\n",
}


@pytest.fixture
def package(tmp_path: pathlib.Path) -> pathlib.Path:
    for name, text in FILES.items():
        path = tmp_path / "snapkeep" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_each_figure_on_a_known_package(package, capsys):
    assert _tool().main(["--src", str(package), "--json", "--no-trace"]) == 0
    report = json.loads(capsys.readouterr().out)
    re_exports = {r["module"]: (r["kind"], r["pure_shim"], r["names"])
                  for r in report["re_exports"]["modules"]}
    assert re_exports == {
        "snapkeep": ("package", True, 1), "snapkeep.pub": ("public", True, 2),
        "snapkeep._shim": ("private", True, 1), "snapkeep._mixed": ("private", False, 1),
        "snapkeep.sub": ("package", True, 1)}
    assert report["re_exports"]["private_modules_reexporting"] == 2
    assert report["re_exports"]["pure_private_shims"] == 1
    assert sorted(report["private_imports"]["names"]) == [
        "snapkeep._mixed: from snapkeep._home import _helper",
        "snapkeep.pub: from snapkeep._home import _helper"]
    reaches = report["private_imports"]
    assert reaches["reaches"] == ["snapkeep._objs:7 ._v", "snapkeep._objs:10 ._v"]
    assert reaches["reaches_other_class"] == ["snapkeep._objs:10 ._v"]  # merge's is Box's own
    assert (reaches["private_attribute_reaches"],
            reaches["private_attribute_reaches_other_class"]) == (2, 1)
    strict = report["cycles"]["strict"]
    # _c <-> _d at module level; _d -> _e only inside a function or under TYPE_CHECKING
    assert strict["component_members"] == [["snapkeep._c", "snapkeep._d"]]
    assert strict["elementary_cycles"] == 1
    assert report["copies"]["functions"] == {
        "verify": ["snapkeep._ops.verify"],
        "fallback": ["snapkeep._ops.newest", "snapkeep._ops.newest_sorted"],
        "delete": ["snapkeep._ops.delete"]}


def test_the_trace_sees_a_real_save_and_resume():
    trace = _tool().trace(SRC)
    assert {"writing/_parallel.py", "_core/save/saver.py",
            "_core/save/commit.py"} <= set(trace["save"])
    assert "_core/store/files.py" in trace["resume"] and "_core/store/lock.py" in trace["resume"]
    assert trace["save_files"] == len(trace["save"]) <= trace["save_iteration_files"]
