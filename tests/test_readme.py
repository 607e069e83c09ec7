"""The README's runnable examples run as written (in a fresh directory, twice: the second run
resumes from the first one's snapshots); see tests/support/doc_examples.py."""

from __future__ import annotations

import pathlib

import pytest

from support.doc_examples import python_blocks, run_example_twice

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = [b for b in python_blocks(README.read_text()) if "manager.finalize()" in b]


def test_readme_has_runnable_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.timeout(400)  # two runs of up to 150 s each (doc_examples), on a loaded machine
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_as_written(tmp_path: pathlib.Path, index: int) -> None:
    run_example_twice(BLOCKS[index], tmp_path, where=f"README block {index}", exact_lines=False,
                      require_expected=False)
