"""The documentation site's runnable examples run as written.

Every ```python block of docs/*.md is a standalone script: it runs in a fresh directory, twice
(snapshot examples resume on the second run and must print the same), and a ``# expected``
comment line right after a ``print(...)`` line must appear in what it printed. Fragments that
are not meant to run use ```text or ```sh. Every public error class has a troubleshooting
section, and the on-disk format page lists every manifest field.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

import snapkeep.errors
from snapkeep._core.format.manifest import Manifest
from support.doc_examples import python_blocks, run_example_twice

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
BLOCKS = [(page.name, i, block)
          for page in sorted(DOCS.glob("*.md"))
          for i, block in enumerate(python_blocks(page.read_text()))]


def test_docs_have_runnable_examples() -> None:
    assert {page for page, _, _ in BLOCKS} >= {"index.md", "writers.md"}


@pytest.mark.timeout(400)  # two runs of up to 150 s each (doc_examples), on a loaded machine
@pytest.mark.parametrize(("page", "index", "block"), BLOCKS,
                         ids=[f"{page}-{i}" for page, i, _ in BLOCKS])
def test_docs_example_runs_as_written(tmp_path: pathlib.Path, page: str, index: int,
                                      block: str) -> None:
    run_example_twice(block, tmp_path, where=f"{page} block {index}")


def test_every_public_error_class_is_in_troubleshooting() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    headings = set(re.findall(r"^## (\w+)$", text, flags=re.M))
    assert set(snapkeep.errors.__all__) <= headings


def test_the_format_page_lists_every_manifest_field() -> None:
    text = (DOCS / "format.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    assert rows == {f.name for f in dataclasses.fields(Manifest)} | {"format"}


def test_the_tests_the_docs_cite_exist() -> None:
    root = DOCS.parent
    text = "\n".join(page.read_text() for page in DOCS.glob("*.md"))
    files = set(re.findall(r"`(tests/[\w/]+\.py)`", text))
    assert files, "the guarantees page cites no test file"
    assert sorted(f for f in files if not (root / f).is_file()) == []
    defined = "\n".join((root / f).read_text() for f in files)
    for name in set(re.findall(r"`(test_\w+)\*?`", text)):
        assert re.search(rf"def {name}", defined), name


#: An inline code span of the plain-loop page naming the Checkpointer, its save handle or the
#: commit record: ``ckpt.load(into=state)``, ``handle.wait(timeout_s)``, ``record.size_bytes``.
_API_SPAN = re.compile(r"`(ckpt|handle|record)\.(\w+)(?:\((.*?)\))?`")


def test_the_plain_loop_page_names_only_real_fields_and_arguments(tmp_path: pathlib.Path) -> None:
    """Every ``ckpt.X(...)``, ``handle.X`` and ``record.X`` the plain-loop page names exists on a
    real Checkpointer, its save handle and the record ``handle.wait()`` returns, and every
    keyword it passes is a parameter (before: the page said ``wait()`` returns "path, size,
    checksum, write time" and ``record.size`` raised AttributeError)."""
    import inspect

    import torch

    from snapkeep import Checkpointer

    text = (DOCS / "plain-loop.md").read_text()
    spans = _API_SPAN.findall(text)
    assert {owner for owner, _, _ in spans} == {"ckpt", "handle", "record"}, spans
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path) as ckpt:
        handle = ckpt.save(1, {"model": model})
        record = handle.wait(60)
        objects = {"ckpt": ckpt, "handle": handle, "record": record}
        for owner, name, args in spans:
            value = getattr(objects[owner], name, None)
            assert value is not None or hasattr(objects[owner], name), f"{owner}.{name}"
            if args is None or not args:
                continue
            parameters = inspect.signature(value).parameters
            for keyword in re.findall(r"\b(\w+)=", args):
                assert keyword in parameters, f"{owner}.{name}({keyword}=...)"
    assert record.size_bytes > 0 and record.path.endswith("ckpt_1") and record.step == 1
