"""File names that only look like a template's: digits of other scripts, numbers beyond a float.

``\\d`` in the template's regular expression matched any Unicode digit, and ``float`` reads
them: a file named ``snapshot_iter_\\u0663`` (Arabic-Indic three) or ``snapshot_iter_\\uff13``
(fullwidth three), which no writer makes, counted as step 3. It tied with the real
``snapshot_iter_3``, won: ``load_latest`` loaded it (unverified), and ``snapkeep prune
--keep-latest 1 --yes`` deleted the real, verified snapshot and its manifest, keeping the impostor.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import snapkeep
from snapkeep import writing
from snapkeep._core.format.naming import FilenameTemplate
from snapkeep.cli import cli

ALIASES = ["snapshot_iter_\u0663", "snapshot_iter_\uff13", "snapshot_iter_\u09e9"]


@pytest.mark.parametrize("alias", ALIASES)
def test_a_foreign_digit_name_is_not_a_step(tmp_path: Path, alias: str) -> None:
    out = tmp_path / "run"
    writer = writing.SimpleWriter(out_dir=str(out))
    for step in (2, 3):
        writer(f"snapshot_iter_{step}", str(out), {"w": torch.full((3,), float(step))}, step=step)
    writer.finalize()
    shutil.copy(out / "snapshot_iter_2", out / alias)  # older content under a "step 3" name
    expected = sorted(p.name for p in out.iterdir()) + [".snapkeep/snapshot_iter_3.json"]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the real snapshot verifies: nothing to warn about
        state = snapkeep.load_latest(str(out))
    assert torch.equal(state["w"], torch.full((3,), 3.0))

    result = CliRunner().invoke(cli, ["prune", str(out), "--keep-latest", "1", "--yes"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    left = sorted(p.name for p in out.iterdir()) + [
        f".snapkeep/{p.name}" for p in (out / ".snapkeep").iterdir() if "iter_3" in p.name]
    assert left == [n for n in expected if n != "snapshot_iter_2"], left


@pytest.mark.parametrize(("name", "key"), [
    ("snapshot_iter_12", (12.0,)),
    ("snapshot_iter_\u0661\u0662", None),
    ("snapshot_iter_" + "9" * 400, None),  # an object-store key can be that long
])
def test_only_ascii_digits_within_float_range_parse(name: str, key: tuple[float, ...] | None,
                                                    ) -> None:
    template = FilenameTemplate("snapshot_iter_{step}")
    assert template.parse(name) == key
    assert template.step_of(name) == (None if key is None else int(key[0]))
