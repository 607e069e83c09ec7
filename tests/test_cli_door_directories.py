"""The CLI on a Lightning ``dirpath`` with Lightning's default names (``epoch=E-step=S.ckpt``
and a ``last.ckpt`` alias), without ``-t``: ``ls`` and ``verify`` list them with the step (not
the epoch) in the step column, ``-t '*.ckpt'`` (the pattern the Lightning resume line prints)
is accepted, and ``prune`` keeps the newest and the alias. (971f8e4: exit 2, "holds snapshots
of 3 templates"; ``-t '*.ckpt'`` matched nothing.) The other doors' directories are the
matrix's CLI scenario (tests/doors/test_matrix.py)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from click.testing import CliRunner

from snapkeep.cli import cli

pytest.importorskip("lightning")

from snapkeep.lightning import SnapkeepCheckpointIO  # noqa: E402

STEPS = ((0, 3), (1, 6), (2, 9))  # (epoch, step): the step is never the epoch


@pytest.fixture
def dirpath(tmp_path: pathlib.Path) -> pathlib.Path:
    io = SnapkeepCheckpointIO()
    for epoch, step in STEPS:
        io.save_checkpoint({"global_step": step, "epoch": epoch,
                            "state_dict": {"w": torch.full((2,), float(step))}},
                           str(tmp_path / f"epoch={epoch}-step={step}.ckpt"))
    io.link(str(tmp_path / "epoch=2-step=9.ckpt"), str(tmp_path / "last.ckpt"))
    io.close()
    return tmp_path


@pytest.mark.parametrize("flags", [[], ["-t", "*.ckpt"], ["-t", "epoch={epoch}-step={step}.ckpt"],
                                   ["-t", "epoch={.epoch}-step={.iteration}.ckpt"]])
def test_ls_shows_each_checkpoint_with_its_step(dirpath: pathlib.Path,
                                                flags: list[str]) -> None:
    result = CliRunner().invoke(cli, ["ls", str(dirpath), *flags, "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert [(s["name"], s["step"]) for s in body["snapshots"]] == [
        (f"epoch={e}-step={s}.ckpt", s) for e, s in STEPS]
    if flags[-1:] != ["epoch={.epoch}-step={.iteration}.ckpt"]:  # inferred in the store's spelling
        assert body["template"] == "epoch={epoch}-step={step}.ckpt"
    text = CliRunner().invoke(cli, ["ls", str(dirpath), *flags])
    assert text.exit_code == 0, text.output
    rows = [line.split() for line in text.output.splitlines()[1:]]
    assert [(int(r[0]), r[-1]) for r in rows] == [(s, f"epoch={e}-step={s}.ckpt")
                                                  for e, s in STEPS]


def test_verify_checks_every_checkpoint(dirpath: pathlib.Path) -> None:
    result = CliRunner().invoke(cli, ["verify", str(dirpath)])
    assert result.exit_code == 0, result.output
    assert "3 snapshots, 0 corrupt" in result.output
    assert "autoload would resume from epoch=2-step=9.ckpt" in result.output
    data = bytearray((dirpath / "epoch=2-step=9.ckpt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (dirpath / "epoch=2-step=9.ckpt").write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["verify", str(dirpath), "-t", "*.ckpt"])
    assert result.exit_code == 1 and "epoch=2-step=9.ckpt" in result.output, result.output


def test_prune_keeps_the_newest_and_the_alias(dirpath: pathlib.Path) -> None:
    result = CliRunner().invoke(cli, ["prune", str(dirpath), "--keep-latest", "1", "--yes"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dirpath.iterdir() if p.is_file()) == [
        "epoch=2-step=9.ckpt", "last.ckpt"]


def test_a_pattern_matching_nothing_is_a_usage_error_saying_what_to_pass(
        dirpath: pathlib.Path) -> None:
    result = CliRunner().invoke(cli, ["ls", str(dirpath), "-t", "*.pt"])
    assert result.exit_code == 2 and "named like '*.pt'" in result.output, result.output
