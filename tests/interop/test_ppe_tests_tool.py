"""tools/ppe_tests.py changes ppe's test files in their imports only."""

from __future__ import annotations

import importlib.util
import pathlib

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "ppe_tests.py"


def _tool():
    spec = importlib.util.spec_from_file_location("ppe_tests_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rewrite_changes_imports_only():
    source = (
        "import pytorch_pfn_extras as ppe\n"
        "import pytorch_pfn_extras\n"
        "from pytorch_pfn_extras import training, writing\n"
        "from pytorch_pfn_extras.training import extensions\n"
        "    from pytorch_pfn_extras.training.extensions import _snapshot\n"
        "x = 'pytorch_pfn_extras.writing'  # strings stay\n"
        "ppe.training.ExtensionsManager\n"
    )
    assert _tool().rewrite_imports(source) == (
        "import snapkeep as ppe\n"
        "import snapkeep as pytorch_pfn_extras\n"
        "from snapkeep import training, writing\n"
        "from snapkeep.training import extensions\n"
        "    from snapkeep.training.extensions import _snapshot\n"
        "x = 'pytorch_pfn_extras.writing'  # strings stay\n"
        "ppe.training.ExtensionsManager\n"
    )


def test_prepare_copies_selected_tests_with_rewritten_imports(tmp_path):
    tool = _tool()
    root = tmp_path / "src" / tool.TESTS_PREFIX
    (root / "training_tests" / "triggers_tests").mkdir(parents=True)
    (root / "training_tests" / "test_manager.py").write_text("import pytorch_pfn_extras as ppe\n")
    (root / "training_tests" / "triggers_tests" / "test_t.py").write_text(
        "from pytorch_pfn_extras.training import triggers\n")
    (root / "test_other.py").write_text("import pytorch_pfn_extras as ppe\n")  # not selected
    out = tmp_path / "out"
    written = tool.prepare(root, out)
    assert sorted(p.relative_to(out).as_posix() for p in written) == [
        "training_tests/test_manager.py", "training_tests/triggers_tests/test_t.py"]
    assert (out / "training_tests/test_manager.py").read_text() == "import snapkeep as ppe\n"


def test_patch_targets_only_on_request():
    source = 'name = "pytorch_pfn_extras.writing.StandardWriter.create_worker"\n'
    tool = _tool()
    assert tool.rewrite_imports(source) == source
    assert tool.rewrite_imports(source, patch_targets=True) == (
        'name = "snapkeep.writing.StandardWriter.create_worker"\n')
