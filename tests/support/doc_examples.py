"""Running a documentation example as written (README.md, docs/*.md): the block is a standalone
script run in a fresh directory twice -- snapshot examples resume on the second run and must
print the same -- and a ``# expected`` comment line right after a ``print(...)`` line must
appear in what the first run printed."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text (```py and ```text blocks are not run)."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def expected_lines(block: str) -> list[str]:
    """The ``# ...`` comment lines that follow a ``print(...)`` line, without the ``# ``."""
    lines = block.splitlines()
    return [line[2:] for prev, line in zip(lines, lines[1:])
            if prev.startswith("print(") and line.startswith("# ")]


def run_example_twice(block: str, tmp_path: pathlib.Path, *, where: str,
                      exact_lines: bool = True, require_expected: bool = True) -> None:
    """Run ``block`` twice in ``tmp_path``; fail (naming ``where``) unless both runs exit 0,
    print no traceback, print every expected line (a whole line with ``exact_lines``, else a
    substring; at least one with ``require_expected``) and print the same."""
    script = tmp_path / "example.py"
    script.write_text(block)
    outputs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=150)
        assert run.returncode == 0, (where, run.stderr)
        assert "Traceback" not in run.stderr, (where, run.stderr)
        outputs.append(run.stdout)
    expected = expected_lines(block)
    assert expected or not require_expected, f"{where} checks no output"
    printed = outputs[0].splitlines() if exact_lines else outputs[0]
    for line in expected:
        assert line in printed, (where, line, outputs[0])
    assert outputs[0] == outputs[1], where  # the rerun resumes and ends in the same state
