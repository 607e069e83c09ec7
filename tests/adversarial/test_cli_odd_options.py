"""CLI options and directories that used to end in a traceback or a misleading hint:

- ``diff --atol nan`` / ``--atol inf``: click's ``FloatRange(min=0)`` let them through; with
  ``--json`` the output died in ``json.dumps(allow_nan=False)`` (a traceback, exit 1).
- ``ls``/``verify --template 'snap_{.iteration}/x'`` (fields in a directory part, which plain
  snapshots may use): the sharded listing's ``ValueError`` came out as a storage error (exit 3,
  "cannot read DIR ... check the path and its permissions").
- ``ls`` with the wrong ``--template`` on snapshots whose manifests record no step (written by
  ppe's snapshot extension with a snapkeep writer) suggested ``--template 'snapshot_iter_1'``, a
  file name that matches one file, instead of the template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from snapkeep import writing
from snapkeep.cli import cli


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _write(out: Path, names: list[str], *, with_step: bool) -> None:
    writer = writing.SimpleWriter(out_dir=str(out))
    for step, name in enumerate(names, start=1):
        extra = {"step": step} if with_step else {}  # ppe's extension passes no step
        writer(name, str(out), {"w": torch.full((2,), float(step))}, **extra)
    writer.finalize()


@pytest.mark.parametrize("atol", ["nan", "inf"])
@pytest.mark.parametrize("as_json", [[], ["--json"]], ids=["text", "json"])
def test_diff_refuses_a_non_finite_atol_as_a_usage_error(
    tmp_path: Path, atol: str, as_json: list[str],
) -> None:
    _write(tmp_path, ["a", "b"], with_step=True)
    result = _invoke("diff", str(tmp_path / "a"), str(tmp_path / "b"), f"--atol={atol}",
                     *as_json)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "'--atol'" in result.stderr and "not a finite number" in result.stderr


def test_a_template_with_fields_in_a_directory_part_is_not_a_storage_error(
    tmp_path: Path,
) -> None:
    _write(tmp_path, ["snapshot_iter_1"], with_step=True)
    template = "snap_{.iteration}/x"
    listed = _invoke("ls", str(tmp_path), "--template", template, "--json")
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)["snapshots"] == []
    verified = _invoke("verify", str(tmp_path), "--template", template)
    assert verified.exit_code == 1, verified.output  # no snapshot of the template: a failed check
    assert "cannot read" not in verified.output and "no snapshots matching" in verified.output


def test_ls_names_the_template_of_manifests_without_a_step(tmp_path: Path) -> None:
    _write(tmp_path, ["snapshot_iter_5", "snapshot_iter_10"], with_step=False)
    result = _invoke("ls", str(tmp_path), "--template", "model_{.iteration}", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["other_templates"] == ["snapshot_iter_{step}"]
    listed = _invoke("ls", str(tmp_path), "--template", "snapshot_iter_{.iteration}", "--json")
    assert [e["name"] for e in json.loads(listed.stdout)["snapshots"]] == [
        "snapshot_iter_5", "snapshot_iter_10"]
