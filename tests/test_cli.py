"""The `snapkeep` command line: demo (in-process), ls, verify, inspect and bad options."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from snapkeep.cli import cli
from support.subprocess_util import default_sigint

pytest.importorskip("sklearn")

METRICS = ("iteration", "loss", "accuracy", "eval_loss")
SMALL = ["--model-size", "16", "--snapshot-interval", "40", "--seed", "1"]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def demo_json(*args: str) -> dict[str, Any]:
    result = invoke("demo", "--json", *args)
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


def listing(directory: Path) -> list[str]:
    """Every path under ``directory`` but the store's lock files."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.suffix != ".lock")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A finished demo run with snapshots at 40, 80 and 120 (all kept)."""
    out = tmp_path_factory.mktemp("demo") / "run"
    result = demo_json("--out", str(out), "--iterations", "120", "--n-retains", "0",
                       "--writer", "simple", *SMALL)
    return out, result


@pytest.fixture
def run_dir(demo_dir: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A private copy of the demo output, free to corrupt."""
    copy = tmp_path / "run"
    shutil.copytree(demo_dir[0], copy)
    return copy


# -- demo ------------------------------------------------------------------------------------


def test_demo_json_and_snapshots(demo_dir: tuple[Path, dict[str, Any]]) -> None:
    out, result = demo_dir
    assert result["iteration"] == 120 and result["iterations_run"] == 120
    assert result["resumed_from"] is None and result["snapshots"] == 3
    assert 0.0 <= result["accuracy"] <= 1.0 and result["loss"] > 0
    assert listing(out) == [
        ".snapkeep", ".snapkeep/snapshot_iter_120.json", ".snapkeep/snapshot_iter_40.json",
        ".snapkeep/snapshot_iter_80.json", ".snapkeep/status.json",  # extensions.preemption's
        "snapshot_iter_120", "snapshot_iter_40", "snapshot_iter_80",
    ]


def test_rerun_of_finished_run_reprints_metrics(
    run_dir: Path, demo_dir: tuple[Path, dict[str, Any]],
) -> None:
    result = invoke("demo", "--json", "--out", str(run_dir), "--iterations", "120",
                    "--n-retains", "0", *SMALL)
    assert result.exit_code == 0, result.output
    assert "resumed from snapshot_iter_120 (iteration 120)" in result.stdout
    assert "already at iteration 120 >= --iterations 120" in result.stdout
    again = json.loads(result.stdout.strip().splitlines()[-1])
    assert again["already_done"] is True and again["iterations_run"] == 0
    assert {k: again[k] for k in METRICS} == {k: demo_dir[1][k] for k in METRICS}


@pytest.mark.parametrize("writer", ["simple", "thread", "thread-queue"])
def test_continuing_a_shorter_run_matches_a_straight_run(
    tmp_path: Path, demo_dir: tuple[Path, dict[str, Any]], writer: str,
) -> None:
    out = str(tmp_path / "run")
    first = demo_json("--out", out, "--iterations", "80", "--writer", writer, *SMALL)
    assert first["iteration"] == 80
    second = demo_json("--out", out, "--iterations", "120", "--writer", writer, *SMALL)
    assert second["resumed_from"] == "snapshot_iter_80"
    assert second["iterations_run"] == 40
    assert {k: second[k] for k in METRICS} == {k: demo_dir[1][k] for k in METRICS}


def test_demo_refuses_a_snapshot_of_another_model_and_deletes_nothing(run_dir: Path) -> None:
    before = listing(run_dir)
    result = invoke("demo", "--out", str(run_dir), "--iterations", "200", "--model-size", "32")
    assert result.exit_code == 1
    assert "StateMismatchError" in result.output and "snapshot_iter_120" in result.output
    assert listing(run_dir) == before


# -- ls / verify / inspect ---------------------------------------------------------------------


def rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.strip().splitlines()[1:]]


def test_ls_lists_by_step_with_status(run_dir: Path) -> None:
    result = invoke("ls", str(run_dir))
    assert result.exit_code == 0, result.output
    table = rows(result.output)
    assert [(r[0], r[3], r[4]) for r in table] == [
        ("40", "ok", "snapshot_iter_40"), ("80", "ok", "snapshot_iter_80"),
        ("120", "ok", "snapshot_iter_120")]


def test_verify_all_ok(run_dir: Path) -> None:
    result = invoke("verify", str(run_dir))
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert [line.split()[:2] for line in lines[:3]] == [
        ["OK", "snapshot_iter_40"], ["OK", "snapshot_iter_80"], ["OK", "snapshot_iter_120"]]
    assert lines[-1] == ("3 snapshots, 0 corrupt or refused; autoload would resume from "
                         "snapshot_iter_120")


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_exits_1_on_a_corrupted_snapshot_and_deletes_nothing(run_dir: Path) -> None:
    flip_byte(run_dir / "snapshot_iter_80")
    before = listing(run_dir)
    result = invoke("verify", str(run_dir))
    assert result.exit_code == 1
    statuses = [line.split()[:2] for line in result.output.strip().splitlines()[:3]]
    assert statuses == [["OK", "snapshot_iter_40"], ["CORRUPT", "snapshot_iter_80"],
                        ["OK", "snapshot_iter_120"]]
    assert "checksum" in result.output
    assert result.output.strip().splitlines()[-1].startswith("3 snapshots, 1 corrupt or refused")
    assert listing(run_dir) == before
    table = rows(invoke("ls", str(run_dir)).output)
    assert [r[3] for r in table] == ["ok", "corrupt", "ok"]


def test_snapshots_without_manifest(run_dir: Path) -> None:
    (run_dir / ".snapkeep" / "snapshot_iter_40.json").unlink()
    (run_dir / ".snapkeep" / "snapshot_iter_120.json").unlink()
    path = run_dir / "snapshot_iter_120"
    path.write_bytes(path.read_bytes()[:1000])  # truncated, and nothing records its checksum
    table = rows(invoke("ls", str(run_dir)).output)
    assert [" ".join(r[3:-1]) for r in table] == ["no manifest", "ok", "no manifest"]
    result = invoke("verify", str(run_dir))
    assert result.exit_code == 1
    assert [line.split()[:2] for line in result.output.strip().splitlines()[:3]] == [
        ["UNVERIFIED", "snapshot_iter_40"], ["OK", "snapshot_iter_80"],
        ["CORRUPT", "snapshot_iter_120"]]


def test_verify_of_a_directory_without_snapshots_fails(tmp_path: Path) -> None:
    result = invoke("verify", str(tmp_path))
    assert result.exit_code == 1
    assert "no snapshots matching 'snapshot_iter_{step}'" in result.output  # ppe's default


def test_template_option(run_dir: Path) -> None:
    for path in run_dir.glob("snapshot_iter_*"):
        path.rename(run_dir / path.name.replace("snapshot_iter_", "ckpt-"))
    assert "no snapshots" in invoke("ls", str(run_dir)).output
    table = rows(invoke("ls", str(run_dir), "--template", "ckpt-{.iteration}").output)
    assert [(r[0], r[-1]) for r in table] == [("40", "ckpt-40"), ("80", "ckpt-80"),
                                              ("120", "ckpt-120")]


def test_inspect_shows_keys_tensors_and_bytes(run_dir: Path) -> None:
    result = invoke("inspect", str(run_dir / "snapshot_iter_120"))
    assert result.exit_code == 0, result.output
    keys = {line.split()[0] for line in result.output.splitlines()[2:-2]}
    assert {"models", "optimizers", "state_objects", "ppe_version", "extensions"} <= keys
    models = next(line.split() for line in result.output.splitlines()
                  if line.startswith("models "))
    assert models[1] == "6"  # three Linear layers: weight + bias each
    assert "manager state at iteration 120" in result.output
    assert "weights_only=True" in result.output


def test_inspect_refuses_unsafe_pickles_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "unsafe.pt"
    torch.save({"when": datetime.date(2024, 1, 2), "w": torch.zeros(3)}, path)
    refused = invoke("inspect", str(path))
    assert refused.exit_code == 1 and "weights_only=False" in refused.output
    assert "pass --unsafe" in refused.output
    allowed = invoke("inspect", "--unsafe", str(path))
    assert allowed.exit_code == 0, allowed.output
    assert "weights_only=False" in allowed.output


def test_inspect_checks_the_manifest(run_dir: Path) -> None:
    good = invoke("inspect", str(run_dir / "snapshot_iter_40"))
    assert good.exit_code == 0 and "checksum: ok (xxh3_128" in good.output
    flip_byte(run_dir / "snapshot_iter_80")  # still loads: only its values changed
    bad = invoke("inspect", str(run_dir / "snapshot_iter_80"))
    assert bad.exit_code == 1
    assert "checksum: CORRUPT" in bad.output and "does not match its checksum" in bad.output


@pytest.mark.parametrize("damage", ["truncate", "text"])
def test_inspect_of_a_broken_file(run_dir: Path, damage: str) -> None:
    path = run_dir / "snapshot_iter_40"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:500])
    else:
        path.write_text("hello world\n")
    result = invoke("inspect", str(path))
    assert result.exit_code == 1 and "not a readable torch or safetensors file" in result.output


def test_demo_refuses_a_snapshot_of_another_seed(run_dir: Path) -> None:
    before = listing(run_dir)
    result = invoke("demo", "--out", str(run_dir), "--iterations", "200", "--model-size", "16",
                    "--seed", "2")
    assert result.exit_code == 1
    assert "seed=1, this run 2" in result.output
    assert listing(run_dir) == before


# -- bad options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["demo", "--writer", "bogus"], ["'--writer'", "'bogus' is not one of", "thread-queue"]),
        (["demo", "--model-size", "huge"], ["'--model-size'", "small, medium, large"]),
        (["demo", "--model-size", "0"], ["'--model-size'", ">= 1"]),
        (["demo", "--iterations", "0"], ["'--iterations'", "x>=1"]),
        (["demo", "--snapshot-interval", "often"],
         ["'--snapshot-interval'", "not a valid integer"]),
        (["demo", "--n-retains", "-1"], ["'--n-retains'"]),
        (["demo", "--nope"], ["No such option", "--nope"]),
        (["ls"], ["Missing argument 'DIR'"]),
        (["ls", "/nonexistent/snapkeep-dir"], ["'DIR'", "is not a directory"]),
        (["verify", "/nonexistent/snapkeep-dir"], ["'DIR'", "is not a directory"]),
        (["inspect", "/nonexistent/file"], ["'FILE'", "is not a file"]),
        (["ls", ".", "--template", "{"], ["'--template'", "malformed"]),
        (["frobnicate"], ["No such command 'frobnicate'"]),
    ],
)
def test_bad_options_are_usage_errors_naming_the_option(
    args: list[str], expected: list[str],
) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.output
    for text in expected:
        assert text in result.output


def test_help_lists_commands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for name in ("demo", "ls", "verify", "inspect"):
        assert name in result.output


# -- messages (issue 13) -----------------------------------------------------------------------


def test_out_naming_a_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a directory")
    result = CliRunner().invoke(cli, ["demo", "--out", str(path), *SMALL])
    assert result.exit_code == 2
    assert "'--out'" in result.output and "exists and is not a directory" in result.output
    assert "Errno" not in result.output and path.read_text() == "not a directory"


def test_one_snapshot_is_singular(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = invoke("demo", "--out", str(out), "--iterations", "40", *SMALL)
    assert result.exit_code == 0, result.output
    assert "; 1 snapshot, kept snapshot_iter_40" in result.output
    assert "3 snapshot" not in invoke("verify", str(out)).output
    assert invoke("verify", str(out)).output.splitlines()[-1].startswith("1 snapshot, 0 corrupt")


def test_model_size_help_is_lower_case() -> None:
    output = invoke("demo", "--help").output
    assert "hidden width preset (small=128" in output and "Hidden width" not in output


@pytest.mark.timeout(300)  # the demo in a subprocess: slow on a loaded machine
def test_ctrl_c_on_the_demo_says_how_to_resume(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import threading

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapkeep.cli", "demo", "--out", str(out), "--iterations",
         "1000000", "--model-size", "16", "--snapshot-interval", "20", "--log-interval", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=default_sigint)
    started = threading.Event()

    def watch() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("iter "):  # a progress line: training is running
                started.set()
        started.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        assert started.wait(90), "the demo printed no progress line"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=10)
    assert proc.returncode == 130, stderr
    assert "Run the same command again to resume" in stderr and str(out) in stderr
    assert "Aborted!" not in stderr


def test_inspect_checks_a_file_of_a_committed_checkpoint_dir_against_its_marker(
        tmp_path: Path) -> None:
    """``snapkeep inspect checkpoint-N/optimizer.pt``: the file has no manifest, but its
    directory's commit marker records its checksum: it is verified against that (before: "no
    manifest (unverified)"), and a changed byte is CORRUPT (exit 1)."""
    from snapkeep._core.store.marked_dirs import commit_checkpoint

    checkpoint = tmp_path / "out" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    torch.save({"state": {0: {"exp_avg": torch.arange(64.0)}}}, checkpoint / "optimizer.pt")
    commit_checkpoint(checkpoint, step=4)
    result = CliRunner().invoke(cli, ["inspect", str(checkpoint / "optimizer.pt")])
    assert result.exit_code == 0, result.output
    assert "checksum: ok (xxh3_128 " in result.output
    assert f"recorded by the commit marker of {checkpoint}" in result.output, result.output
    data = bytearray((checkpoint / "optimizer.pt").read_bytes())
    spot = bytes(data).index(torch.arange(64.0).numpy().tobytes()) + 17
    data[spot] ^= 0x40  # a value of the tensor: the file still loads
    (checkpoint / "optimizer.pt").write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["inspect", str(checkpoint / "optimizer.pt")])
    assert result.exit_code == 1 and "CORRUPT" in result.output, result.output
