"""Only ``_core/distributed`` talks to torch.distributed inside the core (DESIGN.md)."""

from __future__ import annotations

import ast
import pathlib

CORE = pathlib.Path(__file__).resolve().parents[2] / "src" / "snapkeep" / "_core"


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_core_distributed_imports_torch_distributed() -> None:
    importers = sorted(str(p.relative_to(CORE)) for p in CORE.rglob("*.py")
                       if any(n.startswith("torch.distributed") for n in _imports(p)))
    assert importers, "the distributed engine is expected to import torch.distributed"
    assert [p for p in importers if not p.startswith("distributed/")] == []
