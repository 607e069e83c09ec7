"""docs/migration.md shows both plug-in ways; its examples run as written through
tests/test_docs.py (every python block of docs/*.md, twice)."""

from __future__ import annotations

import pathlib

import pytest

from support.doc_examples import python_blocks

pytest.importorskip("pytorch_pfn_extras")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migration.md"
BLOCKS = [b for b in python_blocks(DOC.read_text()) if "manager.finalize()" in b]


def test_migration_guide_has_an_example_per_plugin_way() -> None:
    assert any("ppe.training.extensions.snapshot(writer=writer" in b for b in BLOCKS)
    assert any("snapkeep_extensions.snapshot(" in b for b in BLOCKS)
