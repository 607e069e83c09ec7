"""``python -m snapkeep`` behaves as the ``snapkeep`` command (its click entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

import snapkeep
from snapkeep.cli import cli

SRC = Path(__file__).resolve().parents[1] / "src"


def _python_m(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "snapkeep", *args], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=120, check=False,
    )


def test_python_m_snapkeep_runs_the_cli(tmp_path: Path) -> None:
    version = _python_m("--version", cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert snapkeep.__version__ in version.stdout
    assert version.stdout.startswith("snapkeep")  # prog name as the console script's

    help_out = _python_m("--help", cwd=tmp_path)
    assert help_out.returncode == 0, help_out.stderr
    assert help_out.stdout.startswith("Usage: snapkeep [OPTIONS] COMMAND")
    commands = sorted(cli.list_commands(None))  # type: ignore[arg-type]
    assert commands and all(f"  {name} " in help_out.stdout for name in commands)


def test_python_m_snapkeep_verify_exit_status_and_output(tmp_path: Path) -> None:
    with snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)) as writer:
        writer("snapshot_iter_3", "", {"w": torch.ones(2)})
    ok = _python_m("verify", str(tmp_path), cwd=tmp_path)
    expected = CliRunner().invoke(cli, ["verify", str(tmp_path)], prog_name="snapkeep")
    assert (ok.returncode, ok.stdout) == (expected.exit_code, expected.stdout)
    assert ok.returncode == 0 and "snapshot_iter_3" in ok.stdout

    (tmp_path / "snapshot_iter_3").write_bytes(b"torn")
    bad = _python_m("verify", str(tmp_path), cwd=tmp_path)
    assert bad.returncode == 1, (bad.stdout, bad.stderr)
    assert "snapshot_iter_3" in bad.stdout + bad.stderr

    usage = _python_m("no-such-command", cwd=tmp_path)
    assert usage.returncode == 2 and "No such command" in usage.stderr
