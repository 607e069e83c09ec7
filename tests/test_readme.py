"""The README's runnable examples run as written (in a fresh directory, twice: the second run
resumes from the first one's snapshots)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
          if "manager.finalize()" in b]


def test_readme_has_runnable_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.timeout(180)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_as_written(tmp_path: pathlib.Path, index: int) -> None:
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[index])
    outputs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=150)
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout)
    # a "# expected output" comment right after a print must match what it printed
    lines = BLOCKS[index].splitlines()
    expected = [line[2:] for prev, line in zip(lines, lines[1:])
                if prev.startswith("print(") and line.startswith("# ")]
    for line in expected:
        assert line in outputs[0], (line, outputs[0])
    assert outputs[0] == outputs[1]  # the rerun resumes and ends in the same state
