"""``ls``/``verify``/``prune`` on a directory with an invalid manifest warn (the snapshot is
treated as unverified). The warning used to be printed in Python's format, naming a line of
click's (``.../click/core.py:911: RuntimeWarning: ...`` followed by ``return callback(*args,
**kwargs)``): the user's command has no source line. It is now one ``Warning: ...`` line."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from snapkeep import writing
from snapkeep.cli import cli

#: what the bounded record parser says of a negative step
OUT_OF_RANGE = "field 'step' is out of range [0, 2**63) (-"


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["prune", "--keep-latest", "1"]])
def test_a_tool_warning_is_one_line_naming_the_manifest(tmp_path: Path, command: list[str]) -> None:
    out = tmp_path / "run"
    writer = writing.SimpleWriter(out_dir=str(out))
    for step in (1, 2):
        writer(f"snapshot_iter_{step}", str(out), {"w": torch.ones(2)}, step=step)
    writer.finalize()
    manifest = out / ".snapkeep" / "snapshot_iter_2.json"
    manifest.write_text(manifest.read_text().replace('"step": 2', '"step": -2'))

    shown_before = warnings.showwarning
    result = CliRunner().invoke(cli, [command[0], str(out), *command[1:]],
                                catch_exceptions=False)
    assert warnings.showwarning is shown_before  # restored after the command
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, "no warning shown"
    assert all(line.startswith("Warning: manifest ") for line in lines), lines
    assert any(str(manifest) in line and OUT_OF_RANGE in line for line in lines)
    assert "click" not in result.stderr and "callback" not in result.stderr


def test_json_output_says_why_a_manifest_is_not_used(tmp_path: Path) -> None:
    """With ``--json`` the warning is not part of the output: the status detail carries the
    reason (it was empty in ``ls``, and ``verify`` said 'no checksum manifest' for a file that
    has one)."""
    out = tmp_path / "run"
    writer = writing.SimpleWriter(out_dir=str(out))
    writer("snapshot_iter_1", str(out), {"w": torch.ones(2)}, step=1)
    writer.finalize()
    manifest = out / ".snapkeep" / "snapshot_iter_1.json"
    manifest.write_text(manifest.read_text().replace('"step": 1', '"step": -1'))
    for command, status in (("ls", "no manifest"), ("verify", "unverified")):
        result = CliRunner().invoke(cli, [command, str(out), "--json"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        (entry,) = json.loads(result.stdout)["snapshots"]
        assert entry["status"] == status
        assert entry["detail"].startswith("invalid checksum manifest: "), entry
        assert str(manifest) in entry["detail"] and OUT_OF_RANGE in entry["detail"]
