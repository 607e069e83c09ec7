"""docs/migration.md's runnable examples run as written (in a fresh directory, twice: the second
run resumes from the first one's snapshots), as tests/test_readme.py does for the README."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("pytorch_pfn_extras")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migration.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
          if "manager.finalize()" in b]


def test_migration_guide_has_an_example_per_plugin_way() -> None:
    assert any("ppe.training.extensions.snapshot(writer=writer" in b for b in BLOCKS)
    assert any("snapkeep_extensions.snapshot(" in b for b in BLOCKS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_migration_example_runs_as_written(tmp_path: pathlib.Path, index: int) -> None:
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[index])
    outputs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=150)
        assert run.returncode == 0, run.stderr
        assert "Traceback" not in run.stderr, run.stderr
        outputs.append(run.stdout)
    lines = BLOCKS[index].splitlines()
    expected = [line[2:] for prev, line in zip(lines, lines[1:])
                if prev.startswith("print(") and line.startswith("# ")]
    assert expected
    for line in expected:
        assert line in outputs[0], (line, outputs[0])
    assert outputs[0] == outputs[1]  # the rerun resumes and ends in the same state
