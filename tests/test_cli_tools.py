"""`snapkeep diff`, `prune`, `convert` and `--json` on local files: exit codes, JSON schemas
(docs/schemas), hostile files."""

from __future__ import annotations

import json
import os
import pathlib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from click.testing import CliRunner, Result

import snapkeep
from snapkeep import writing
from snapkeep.cli import cli

SCHEMAS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "schemas"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def as_json(result: Result, schema: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(result.stdout)
    jsonschema.validate(body, json.loads((SCHEMAS / f"{schema}.schema.json").read_text()))
    return body


def state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 3), float(step)), "b": torch.arange(3)},
            "iteration": step}


def write(out: Path, steps: list[int], metrics: dict[int, float] | None = None) -> None:
    writer = writing.SimpleWriter(out_dir=str(out))
    for step in steps:
        extra = {"metrics": {"val/loss": metrics[step]}} if metrics else {}
        writer(f"snapshot_iter_{step}", str(out), state(step), step=step, **extra)
    writer.finalize()


def names(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    write(out, [10, 20, 30, 40], metrics={10: 0.5, 20: 0.2, 30: 0.4, 40: 0.3})
    return out


# -- --json on ls / verify / inspect --------------------------------------------------------------


def test_ls_json(run: Path) -> None:
    body = as_json(invoke("ls", str(run), "--json"), "ls")
    assert [(s["name"], s["step"], s["status"]) for s in body["snapshots"]] == [
        (f"snapshot_iter_{n}", n, "ok") for n in (10, 20, 30, 40)]
    assert body["snapshots"][1]["metrics"] == {"val/loss": 0.2}
    assert body["other_templates"] == []


def test_a_checkpointer_directory_is_answered_in_the_checkpointers_spelling(
        tmp_path: Path) -> None:
    """Issue 31: the CLI speaks the store's template language: a Checkpointer user who asks for
    another template is told ``ckpt_{step}``, never ppe's ``{.iteration}``."""
    import snapkeep

    with snapkeep.Checkpointer(tmp_path, template="ckpt_{step}") as ck:
        for step in (3, 5):
            ck.save(step, {"w": torch.full((2,), float(step))})
    result = invoke("ls", str(tmp_path), "-t", "zz_{step}")
    assert result.exit_code == 0, result.output
    assert "--template 'ckpt_{step}'" in result.output and ".iteration" not in result.output
    bad = invoke("ls", str(tmp_path), "-t", "zz_*")
    assert bad.exit_code == 2 and "e.g. 'ckpt_{step}'" in bad.output, bad.output
    body = as_json(invoke("ls", str(tmp_path), "--json"), "ls")
    assert body["template"] == "ckpt_{step}" and [e["step"] for e in body["snapshots"]] == [3, 5]


def test_ls_of_another_template_names_the_recorded_templates(run: Path) -> None:
    result = invoke("ls", str(run), "--template", "ckpt_{.iteration}")
    assert result.exit_code == 0
    assert "no snapshots matching 'ckpt_{.iteration}'" in result.output
    assert "--template 'snapshot_iter_{step}'" in result.output  # in the store's spelling
    body = as_json(invoke("ls", str(run), "-t", "ckpt_{.iteration}", "--json"), "ls")
    assert body["snapshots"] == [] and body["other_templates"] == ["snapshot_iter_{step}"]
    # the recorded template spelled as ppe writes it is the same template, not another one
    body = as_json(invoke("ls", str(run), "-t", "snapshot_iter_{.iteration}", "--json"), "ls")
    assert len(body["snapshots"]) == 4 and body["other_templates"] == []


def test_verify_json_and_exit_codes(run: Path) -> None:
    ok = invoke("verify", str(run), "--json")
    assert ok.exit_code == 0
    body = as_json(ok, "verify")
    assert body["bad"] == 0 and body["newest_loadable"] == "snapshot_iter_40"
    flip_byte(run / "snapshot_iter_40")
    bad = invoke("verify", str(run), "--json")
    assert bad.exit_code == 1
    body = as_json(bad, "verify")
    assert [s["status"] for s in body["snapshots"]] == ["ok", "ok", "ok", "corrupt"]
    assert body["newest_loadable"] == "snapshot_iter_30" and body["exit_code"] == 1


def test_verify_agrees_with_autoload_on_an_unsafe_manifestless_file(tmp_path: Path) -> None:
    import datetime

    torch.save({"when": datetime.date(2024, 1, 2)}, tmp_path / "snapshot_iter_5")
    result = invoke("verify", str(tmp_path), "--json")
    assert result.exit_code == 1
    body = as_json(result, "verify")
    assert body["snapshots"][0]["status"] == "unsafe" and body["newest_loadable"] is None
    assert "weights_only=False" in body["snapshots"][0]["detail"]


def test_inspect_json(run: Path) -> None:
    result = invoke("inspect", str(run / "snapshot_iter_20"), "--json")
    assert result.exit_code == 0, result.output
    body = as_json(result, "inspect")
    assert body["checksum"]["status"] == "ok" and body["format"] == "torch"
    assert body["keys"] == [{"key": "model", "tensors": 2, "bytes": 12 * 4 + 3 * 8},
                            {"key": "iteration", "tensors": 0, "bytes": 0}]


# -- hostile files -------------------------------------------------------------------------------


def deep_pickle(path: Path, depth: int) -> None:
    """A torch.save zip whose pickle nests lists ``depth`` deep (built without recursion)."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save({"a": torch.zeros(2)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    payload = b"\x80\x02" + b"]" * (depth + 1) + b"a" * depth + b"."
    with zipfile.ZipFile(path, "w") as out:
        for name in source.namelist():
            out.writestr(name, payload if name.endswith("data.pkl") else source.read(name))


@pytest.mark.parametrize("command", ["inspect", "diff", "convert"])
def test_a_deeply_nested_pickle_is_a_clear_error(tmp_path: Path, command: str) -> None:
    path = tmp_path / "deep.pt"
    deep_pickle(path, 100_000)
    args = {"inspect": [str(path)], "diff": [str(path), str(path)],
            "convert": [str(path), str(tmp_path / "out.pt")]}[command]
    result = invoke(command, *args)
    assert result.exit_code == 1
    assert "deeper than 1000 levels" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out.pt").exists()


def test_verify_of_a_deep_manifestless_pickle_says_corrupt_or_loads(tmp_path: Path) -> None:
    deep_pickle(tmp_path / "snapshot_iter_1", 100_000)
    result = invoke("verify", str(tmp_path))
    assert result.exit_code in (0, 1) and "Traceback" not in result.output


@pytest.mark.parametrize("command", ["inspect", "diff"])
def test_an_empty_file_is_a_clear_message(tmp_path: Path, command: str) -> None:
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    result = invoke(command, *([str(path)] * (1 if command == "inspect" else 2)))
    assert result.exit_code == 1
    assert "is empty (0 bytes): not a snapshot" in result.output
    assert "EOFError" not in result.output


def test_verify_of_an_empty_manifestless_file(tmp_path: Path) -> None:
    (tmp_path / "snapshot_iter_3").write_bytes(b"")
    result = invoke("verify", str(tmp_path), "--json")
    assert result.exit_code == 1
    row = as_json(result, "verify")["snapshots"][0]
    assert row["status"] == "corrupt" and "empty or truncated" in row["detail"]


@pytest.mark.timeout(120)  # a hang guard: a FIFO read never returns
@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("command", ["inspect", "diff", "convert"])
def test_a_fifo_or_directory_as_file_never_blocks(tmp_path: Path, kind: str,
                                                  command: str) -> None:
    path = tmp_path / "thing"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    args = {"inspect": [str(path)], "diff": [str(path), str(path)],
            "convert": [str(path), str(tmp_path / "out.pt")]}[command]
    result = CliRunner().invoke(cli, [command, *args])
    assert result.exit_code == 2, result.output
    expected = "FIFO, socket or device" if kind == "fifo" else "directory"
    assert expected in result.output and "is not a file" in result.output


@pytest.mark.timeout(120)  # a hang guard: a FIFO read never returns
def test_verify_of_a_fifo_named_like_a_snapshot_never_blocks(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "snapshot_iter_7")
    result = invoke("verify", str(tmp_path), "--json")
    assert result.exit_code == 1  # nothing verifiable: a FIFO is never listed as a snapshot
    assert as_json(result, "verify")["snapshots"] == []


def test_a_corrupt_zip_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    torch.save({"w": torch.zeros(100)}, path)
    data = bytearray(path.read_bytes())
    data[-30:] = b"\0" * 30  # the zip's end-of-central-directory record
    path.write_bytes(bytes(data))
    result = invoke("inspect", str(path))
    assert result.exit_code == 1
    assert "not a readable torch or safetensors file" in result.output


# -- diff ----------------------------------------------------------------------------------------


def test_diff_equal_and_different(run: Path, tmp_path: Path) -> None:
    same = invoke("diff", str(run / "snapshot_iter_10"), str(run / "snapshot_iter_10"))
    assert same.exit_code == 0 and same.output.startswith("equal: 2 of 2 common tensors equal")
    other = invoke("diff", str(run / "snapshot_iter_10"), str(run / "snapshot_iter_30"), "--json")
    assert other.exit_code == 1
    body = as_json(other, "diff")
    assert body["equal"] is False
    w = next(t for t in body["tensors"] if t["key"] == "model/w")
    assert w["max_abs_diff"] == 20.0 and w["a"] == {"shape": [4, 3], "dtype": "float32"}
    assert body["values"] == [{"key": "iteration", "a": "10", "b": "30"}]
    assert body["metadata"]["a"]["step"] == 10 and body["metadata"]["b"]["step"] == 30
    assert body["metadata"]["b"]["metrics"] == {"val/loss": 0.4}


def test_diff_shapes_dtypes_and_keys(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(3), "x": torch.zeros(2), "n": torch.tensor([float("nan")])},
               tmp_path / "a.pt")
    torch.save({"w": torch.zeros(4), "x": torch.zeros(2, dtype=torch.float64),
                "n": torch.tensor([float("nan")]), "extra": 1}, tmp_path / "b.pt")
    result = invoke("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--json")
    assert result.exit_code == 1
    body = as_json(result, "diff")
    rows = {t["key"]: t for t in body["tensors"]}
    assert rows["w"]["equal"] is False and rows["w"]["max_abs_diff"] is None
    assert rows["x"]["equal"] is False and rows["x"]["max_abs_diff"] == 0.0
    assert rows["n"]["equal"] is True  # NaN at the same position in both
    assert body["only_in_b"] == ["extra"] and body["only_in_a"] == []
    text = invoke("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")).output
    assert "tensor w: shape [3] != [4]" in text and "tensor x: dtype float32 != float64" in text
    assert "only in B: extra" in text


def test_diff_of_two_rng_states_is_one_row_per_generator(tmp_path: Path) -> None:
    """Two Checkpointer snapshots whose tensors are equal but whose RNG states differ: one row
    per generator state (which element first, how many differ), not one per element (the
    fresh-user trial counted 1,247 lines)."""
    import random

    for name, seed in (("a", 1), ("b", 2)):
        random.seed(seed)
        torch.manual_seed(0)
        with snapkeep.Checkpointer(tmp_path / name) as ckpt:
            ckpt.save(1, {"m": torch.nn.Linear(2, 2)})
    result = invoke("diff", str(tmp_path / "a" / "ckpt_1"), str(tmp_path / "b" / "ckpt_1"))
    assert result.exit_code == 1
    rows = [line for line in result.output.splitlines() if line.startswith("value rng/python")]
    assert len(rows) == 1 and "elements differ)" in rows[0], result.output
    assert len(result.output.splitlines()) < 10, result.output
    body = as_json(invoke("diff", str(tmp_path / "a" / "ckpt_1"),
                          str(tmp_path / "b" / "ckpt_1"), "--json"), "diff")
    assert [v["key"] for v in body["values"] if v["key"].startswith("rng/python")] == [
        "rng/python/1"]


def test_diff_atol(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(3)}, tmp_path / "a.pt")
    torch.save({"w": torch.full((3,), 1e-4)}, tmp_path / "b.pt")
    assert invoke("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")).exit_code == 1
    assert invoke("diff", "--atol", "1e-3", str(tmp_path / "a.pt"),
                  str(tmp_path / "b.pt")).exit_code == 0


# -- prune ---------------------------------------------------------------------------------------


def test_prune_is_a_dry_run_by_default(run: Path) -> None:
    before = names(run)
    result = invoke("prune", str(run), "--keep-latest", "2")
    assert result.exit_code == 0
    assert "would delete" in result.output and "pass --yes to delete" in result.output
    assert names(run) == before
    body = as_json(invoke("prune", str(run), "--keep-latest", "2", "--json"), "prune")
    assert body["dry_run"] is True and body["deleted"] == []
    assert [d["name"] for d in body["delete"]] == ["snapshot_iter_10", "snapshot_iter_20"]


def test_prune_deletes_snapshots_with_their_manifests(run: Path) -> None:
    result = invoke("prune", str(run), "--keep-latest", "2", "--yes", "--json")
    assert result.exit_code == 0
    body = as_json(result, "prune")
    assert body["deleted"] == ["snapshot_iter_10", "snapshot_iter_20"]
    assert names(run) == [".snapkeep/snapshot_iter_30.json", ".snapkeep/snapshot_iter_40.json",
                          "snapshot_iter_30", "snapshot_iter_40"]


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        (["--keep-every", "20"], [20, 40]),
        (["--keep-best", "1", "--metric", "val/loss"], [20, 40]),
        (["--keep-best", "1", "--metric", "val/loss", "--mode", "max"], [10, 40]),
        (["--keep-best", "2", "--metric", "val/loss", "--keep-latest", "1"], [20, 40]),
        (["--keep-latest", "1", "--keep-every", "30"], [30, 40]),
    ],
)
def test_prune_policies(run: Path, options: list[str], kept: list[int]) -> None:
    body = as_json(invoke("prune", str(run), *options, "--yes", "--json"), "prune")
    assert body["keep"] == [f"snapshot_iter_{n}" for n in kept]
    assert [p for p in names(run) if not p.startswith(".")] == sorted(
        f"snapshot_iter_{n}" for n in kept)


@pytest.mark.parametrize("options", [["--keep-best", "1", "--metric", "val_loss"],
                                     ["--keep-best", "1", "--metric", "val_loss",
                                      "--keep-latest", "1"],
                                     ["--keep-best", "1", "--metric", "val_loss",
                                      "--keep-latest", "9"]])
def test_prune_refuses_a_metric_no_manifest_records(run: Path, options: list[str]) -> None:
    before = names(run)
    for extra in ([], ["--yes"], ["--yes", "--json"]):
        result = CliRunner().invoke(cli, ["prune", str(run), *options, *extra])
        assert result.exit_code == 2, result.output
        assert "KeepBest metric 'val_loss' is recorded by none of the 4 snapshot manifest(s); " \
               "the metrics they record: 'val/loss'. Nothing was deleted." in result.output
    assert names(run) == before


def test_prune_dry_run_lists_exactly_what_yes_deletes(run: Path) -> None:
    (run / "snapshot_iter_30").unlink()  # its manifest is now an orphan
    options = ["--keep-best", "1", "--metric", "val/loss", "--mode", "max"]
    before = names(run)
    dry = invoke("prune", str(run), *options)
    assert dry.exit_code == 0 and names(run) == before
    assert dry.output.splitlines() == [
        "keep          snapshot_iter_10  (step 10)",
        "would delete  snapshot_iter_20  (step 20)",
        "keep          snapshot_iter_40  (step 40)",
        f"would delete  {run / '.snapkeep' / 'snapshot_iter_30.json'}  (manifest without a "
        "snapshot)",
        "would delete 1 snapshot, kept 2; pass --yes to delete",
    ]
    body = as_json(invoke("prune", str(run), *options, "--json"), "prune")
    assert [d["name"] for d in body["delete"]] == ["snapshot_iter_20"]
    assert body["orphan_manifests"] == [str(run / ".snapkeep" / "snapshot_iter_30.json")]
    done = invoke("prune", str(run), *options, "--yes")
    assert done.exit_code == 0
    assert [line.replace("deleted     ", "would delete") for line in done.output.splitlines()
            ][:-1] == dry.output.splitlines()[:-1]
    # gone: exactly the listed snapshot (with its manifest) and the listed orphan manifest
    assert sorted(set(before) - set(names(run))) == [
        ".snapkeep/snapshot_iter_20.json", ".snapkeep/snapshot_iter_30.json",
        "snapshot_iter_20"]


def test_prune_never_deletes_the_newest_valid_snapshot(run: Path) -> None:
    flip_byte(run / "snapshot_iter_40")
    body = as_json(invoke("prune", str(run), "--keep-latest", "1", "--yes", "--json"), "prune")
    assert body["newest_valid"] == "snapshot_iter_30"
    assert body["keep"] == ["snapshot_iter_30", "snapshot_iter_40"]
    assert (run / "snapshot_iter_30").exists()


def test_prune_and_verify_skip_a_misnamed_copy_as_autoload_does(tmp_path: Path) -> None:
    """``cp snapshot_iter_20 snapshot_iter_90``: its manager state says iteration 20, so every
    reader skips it (issue 17); prune protects the snapshot autoload resumes from, verify
    names it."""
    run = tmp_path / "run"
    writer = writing.SimpleWriter(out_dir=str(run))
    for step in (20, 40):  # a manager's state records the iteration it was saved at
        writer(f"snapshot_iter_{step}", str(run), {**state(step), "_start_iteration": step},
               step=step)
    writer.finalize()
    (run / "snapshot_iter_90").write_bytes((run / "snapshot_iter_20").read_bytes())
    verify = as_json(invoke("verify", str(run), "--json"), "verify")
    assert verify["newest_loadable"] == "snapshot_iter_40"
    body = as_json(invoke("prune", str(run), "--keep-latest", "1", "--json"), "prune")
    assert body["newest_valid"] == "snapshot_iter_40"
    assert body["keep"] == ["snapshot_iter_40", "snapshot_iter_90"]


def test_prune_keeps_an_unsafe_snapshot_autoload_stops_at(run: Path) -> None:
    """Autoload refuses an unsafe snapshot and never falls back past it, so prune protects it
    (not an older valid one autoload would never reach) and names no newest valid one."""
    import datetime

    torch.save({"when": datetime.date(2024, 1, 2)}, run / "snapshot_iter_50")
    (run / "snapshot_iter_60").write_bytes(b"junk")
    body = as_json(invoke("prune", str(run), "--keep-latest", "1", "--yes", "--json"), "prune")
    assert body["newest_valid"] is None
    assert body["keep"] == ["snapshot_iter_50", "snapshot_iter_60"]
    assert (run / "snapshot_iter_50").exists()
    verify = as_json(invoke("verify", str(run), "--json"), "verify")
    assert verify["newest_loadable"] is None


def test_prune_removes_orphan_manifests(run: Path) -> None:
    (run / "snapshot_iter_10").unlink()
    body = as_json(invoke("prune", str(run), "--keep-latest", "5", "--yes", "--json"), "prune")
    assert body["orphan_manifests"] == [str(run / ".snapkeep" / "snapshot_iter_10.json")]
    assert not (run / ".snapkeep" / "snapshot_iter_10.json").exists()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ([], "give at least one policy"),
        (["--keep-best", "2"], "--keep-best needs --metric"),
        (["--metric", "loss"], "only used with --keep-best"),
        (["--keep-latest", "0"], "'--keep-latest'"),
        (["--keep-best", "1", "--metric", "m", "--mode", "avg"], "'--mode'"),
    ],
)
def test_prune_usage_errors(run: Path, options: list[str], expected: str) -> None:
    result = CliRunner().invoke(cli, ["prune", str(run), *options])
    assert result.exit_code == 2 and expected in result.output


# -- convert -------------------------------------------------------------------------------------


def test_convert_torch_to_safetensors_and_back(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    result = invoke("convert", str(tmp_path / "model.pt"), str(tmp_path / "model.safetensors"))
    assert result.exit_code == 0, result.output
    assert "read back equal" in result.output
    assert (tmp_path / "model.safetensors").read_bytes()[8:9] == b"{"
    assert (tmp_path / ".snapkeep" / "model.safetensors.json").exists()
    inspected = as_json(invoke("inspect", str(tmp_path / "model.safetensors"), "--json"),
                        "inspect")
    assert inspected["format"] == "safetensors" and inspected["checksum"]["status"] == "ok"
    back = invoke("convert", str(tmp_path / "model.safetensors"), str(tmp_path / "back.pt"))
    assert back.exit_code == 0, back.output
    assert invoke("diff", str(tmp_path / "model.pt"), str(tmp_path / "back.pt")).exit_code == 0


def test_convert_refuses_a_state_safetensors_cannot_hold(run: Path, tmp_path: Path) -> None:
    result = invoke("convert", str(run / "snapshot_iter_10"), str(tmp_path / "x.safetensors"))
    assert result.exit_code == 1
    assert "'iteration' is not a tensor but a int" in result.output
    assert "--key model to convert" in result.output  # this snapshot's own model sub-tree
    assert not (tmp_path / "x.safetensors").exists()


def test_convert_and_diff_a_sub_tree_with_key(run: Path, tmp_path: Path) -> None:
    dst = tmp_path / "model.safetensors"
    result = invoke("convert", "--key", "model", str(run / "snapshot_iter_10"), str(dst))
    assert result.exit_code == 0, result.output
    torch.save(state(10)["model"], tmp_path / "model.pt")
    assert invoke("diff", str(dst), str(tmp_path / "model.pt")).exit_code == 0
    only_w = invoke("diff", "--key", "model/w", str(run / "snapshot_iter_10"),
                    str(run / "snapshot_iter_20"), "--json")
    assert [t["key"] for t in json.loads(only_w.stdout)["tensors"]] == ["<root>"]
    missing = CliRunner().invoke(cli, ["convert", "--key", "model/nope",
                                       str(run / "snapshot_iter_10"), str(tmp_path / "n.pt")])
    assert missing.exit_code == 2
    assert "'--key'" in missing.output and "'nope' is not under model (there: 'w', 'b')" \
        in missing.output


def test_diff_key_b_compares_a_snapshots_sub_tree_with_an_exported_state(
        run: Path, tmp_path: Path) -> None:
    torch.save(state(10)["model"], tmp_path / "model.pt")  # an exported state_dict
    same = invoke("diff", "--key", "model", "--key-b", "", str(run / "snapshot_iter_10"),
                  str(tmp_path / "model.pt"))
    assert same.exit_code == 0, same.output
    other = invoke("diff", "--key", "model", "--key-b", "", str(run / "snapshot_iter_20"),
                   str(tmp_path / "model.pt"), "--json")
    assert other.exit_code == 1
    differing = {t["key"] for t in json.loads(other.stdout)["tensors"] if not t["equal"]}
    assert differing == {"w"}  # b is arange(3) at every step
    # without --key-b the same path applies to both: B has no 'model'
    assert invoke("diff", "--key", "model", str(run / "snapshot_iter_10"),
                  str(tmp_path / "model.pt")).exit_code == 2
    wrong = invoke("diff", "--key", "model", "--key-b", "nope", str(run / "snapshot_iter_10"),
                   str(tmp_path / "model.pt"))
    assert wrong.exit_code == 2 and "'--key-b'" in wrong.output


def test_convert_refuses_a_corrupt_source(run: Path, tmp_path: Path) -> None:
    flip_byte(run / "snapshot_iter_10")
    result = invoke("convert", str(run / "snapshot_iter_10"), str(tmp_path / "x.pt"))
    assert result.exit_code == 1 and "does not match its checksum manifest" in result.output
    assert not (tmp_path / "x.pt").exists()


def test_convert_does_not_replace_dst_unless_forced(run: Path, tmp_path: Path) -> None:
    dst = tmp_path / "x.pt"
    dst.write_bytes(b"keep me")
    result = CliRunner().invoke(cli, ["convert", str(run / "snapshot_iter_10"), str(dst)])
    assert result.exit_code == 2 and "--force" in result.output
    assert dst.read_bytes() == b"keep me"
    forced = invoke("convert", "--force", str(run / "snapshot_iter_10"), str(dst))
    assert forced.exit_code == 0, forced.output
    assert invoke("diff", str(run / "snapshot_iter_10"), str(dst)).exit_code == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_a_dcp_checkpoint_to_one_file(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    saved = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": torch.tensor(7)}
    dcp.save(saved, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = invoke("convert", str(tmp_path / "dcp"), str(tmp_path / "one.pt"))
    assert result.exit_code == 0, result.output
    loaded = torch.load(tmp_path / "one.pt", weights_only=True)
    assert torch.equal(loaded["model"]["w"], saved["model"]["w"])
    assert int(loaded["step"]) == 7
    hint = CliRunner().invoke(cli, ["inspect", str(tmp_path / "dcp")])
    assert hint.exit_code == 2 and "holds a DCP checkpoint: 'snapkeep convert" in hint.output


def test_help_has_the_exit_code_table() -> None:
    for args in (["--help"], ["prune", "--help"], ["diff", "--help"]):
        output = invoke(*args).output
        assert "Exit codes:" in output and "3  storage error" in output


def test_convert_hints_the_key_of_the_model_in_a_checkpointer_snapshot(tmp_path: Path) -> None:
    """The hint names a sub-tree of this snapshot that converts (before: ``--key models/main``,
    a manager snapshot's path, which a Checkpointer snapshot does not have: exit 2)."""
    model = torch.nn.Linear(2, 2)
    with snapkeep.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(1, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    refused = invoke("convert", str(tmp_path / "c" / "ckpt_1"), str(tmp_path / "m.safetensors"))
    assert refused.exit_code == 1 and "--key state/model" in refused.output, refused.output
    done = invoke("convert", str(tmp_path / "c" / "ckpt_1"), str(tmp_path / "m.safetensors"),
                  "--key", "state/model")
    assert done.exit_code == 0, done.output
    inspected = as_json(invoke("inspect", str(tmp_path / "m.safetensors"), "--json"), "inspect")
    assert inspected["format"] == "safetensors"


def test_template_discovery_never_reads_a_manifest_whole_that_grew_after_its_size(
        run: Path) -> None:
    """A manifest that passes a size check and then grows (another writer appends to it) is
    read at most 1 MiB + 1 bytes and skipped: the listing never reads an attacker-sized file
    whole. The storage here says every file is 10 bytes, as a check made before the growth
    would, and records how much each read returned."""
    import fsspec

    from snapkeep._cli_files import recorded_templates
    from snapkeep.store import MANIFEST_DIR, Storage

    reads: list[int] = []

    class SizeSaidBeforeTheGrowth(Storage):
        def size(self, path: str) -> int:
            return 10

        def read_bytes(self, path: str, *, max_bytes: int | None = None) -> bytes:
            try:
                data = super().read_bytes(path, max_bytes=max_bytes)
            except OSError:
                reads.append(-1)  # refused at the bound
                raise
            reads.append(len(data))
            return data

    manifests = run / MANIFEST_DIR
    good = next(manifests.glob("*.json"))
    (manifests / "grown_iter_10.json").write_text(good.read_text() + " " * (64 << 20))
    storage = SizeSaidBeforeTheGrowth(fsspec.filesystem("file"))
    assert recorded_templates(storage, str(run)) == ["snapshot_iter_{step}"]
    assert -1 in reads and max(reads) <= 1 << 20  # the 64 MiB one refused, never read whole
