"""The CLI's commands and `snapkeep.load_latest` on local, memory:// and S3 (moto server)
storage: exit codes, JSON schemas (docs/schemas), corrupt and foreign files."""

from __future__ import annotations

import json
import pathlib
import warnings
from typing import Any

import jsonschema
import pytest
import torch
from click.testing import CliRunner, Result

import snapkeep
from snapkeep import writing
from snapkeep.cli import cli
from support.storage_backends import Backend

SCHEMAS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "schemas"


def flags(options: dict[str, Any]) -> list[str]:
    out = []
    for key, value in options.items():
        if isinstance(value, dict):
            out += flags({f"{key}.{k}": v for k, v in value.items()})
        else:
            out += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


def run(backend: Backend, *args: str) -> Result:
    return CliRunner().invoke(cli, [*args, *flags(backend.storage_options)],
                              catch_exceptions=False)


def body(result: Result, schema: str) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(result.stdout)
    jsonschema.validate(parsed, json.loads((SCHEMAS / f"{schema}.schema.json").read_text()))
    return parsed


def write(backend: Backend, steps: list[int]) -> None:
    writer = writing.SimpleWriter(**backend.writer_kwargs())
    for step in steps:
        writer(f"snapshot_iter_{step}", backend.out_dir,
               {"w": torch.full((8,), float(step)), "b": torch.arange(3)}, step=step,
               metrics={"loss": 1.0 / step})
    writer.finalize()


def corrupt(backend: Backend, name: str) -> None:
    data = bytearray(backend.read(name))
    data[len(data) // 2] ^= 0xFF
    backend.overwrite(name, bytes(data))


def url(backend: Backend, name: str) -> str:
    """A file's URL as a user types it (``s3://bucket/run/name``; a plain path locally)."""
    storage, _ = backend.storage()
    return storage.url(backend.path(name))


def snapshot_names(backend: Backend) -> list[str]:
    return [n for n in backend.raw_names() if n.startswith("snapshot_iter_")]


def test_ls_and_verify(backend: Backend) -> None:
    write(backend, [1, 2, 3])
    listed = body(run(backend, "ls", backend.out_dir, "--json"), "ls")
    assert [(s["name"], s["status"]) for s in listed["snapshots"]] == [
        ("snapshot_iter_1", "ok"), ("snapshot_iter_2", "ok"), ("snapshot_iter_3", "ok")]
    ok = run(backend, "verify", backend.out_dir, "--json")
    assert ok.exit_code == 0 and body(ok, "verify")["newest_loadable"] == "snapshot_iter_3"
    corrupt(backend, "snapshot_iter_3")
    bad = run(backend, "verify", backend.out_dir, "--json")
    assert bad.exit_code == 1
    parsed = body(bad, "verify")
    assert [s["status"] for s in parsed["snapshots"]] == ["ok", "ok", "corrupt"]
    assert parsed["newest_loadable"] == "snapshot_iter_2"
    assert body(run(backend, "ls", backend.out_dir, "--json"), "ls")["snapshots"][2][
        "status"] == "corrupt"


def test_ls_of_another_template(backend: Backend) -> None:
    write(backend, [5])
    result = run(backend, "ls", backend.out_dir, "-t", "ckpt-{.iteration}", "--json")
    assert result.exit_code == 0
    assert body(result, "ls")["other_templates"] == ["snapshot_iter_{step}"]


def test_inspect_good_corrupt_foreign_and_empty(backend: Backend) -> None:
    write(backend, [1, 2])
    good = run(backend, "inspect", url(backend, "snapshot_iter_1"), "--json")
    assert good.exit_code == 0, good.output
    parsed = body(good, "inspect")
    assert parsed["checksum"]["status"] == "ok" and parsed["total"]["tensors"] == 2
    corrupt(backend, "snapshot_iter_2")
    assert run(backend, "inspect", url(backend, "snapshot_iter_2")).exit_code == 1
    backend.overwrite("foreign.bin", b"PK\x03\x04 not really a zip")
    foreign = run(backend, "inspect", url(backend, "foreign.bin"))
    assert foreign.exit_code == 1 and "not a readable torch or safetensors file" in foreign.output
    backend.overwrite("empty.pt", b"")
    empty = run(backend, "inspect", url(backend, "empty.pt"))
    assert empty.exit_code == 1 and "is empty (0 bytes)" in empty.output


def test_diff(backend: Backend) -> None:
    write(backend, [1, 2])
    same = run(backend, "diff", url(backend, "snapshot_iter_1"), url(backend, "snapshot_iter_1"))
    assert same.exit_code == 0
    other = run(backend, "diff", url(backend, "snapshot_iter_1"),
                url(backend, "snapshot_iter_2"), "--json")
    assert other.exit_code == 1
    parsed = body(other, "diff")
    assert {t["key"]: t["max_abs_diff"] for t in parsed["tensors"]} == {"w": 1.0, "b": 0.0}
    assert parsed["metadata"]["b"]["metrics"] == {"loss": 0.5}


def test_prune(backend: Backend) -> None:
    write(backend, [1, 2, 3, 4])
    dry = body(run(backend, "prune", backend.out_dir, "--keep-latest", "2", "--json"), "prune")
    assert [d["name"] for d in dry["delete"]] == ["snapshot_iter_1", "snapshot_iter_2"]
    assert len(snapshot_names(backend)) == 4
    corrupt(backend, "snapshot_iter_4")
    done = run(backend, "prune", backend.out_dir, "--keep-best", "1", "--metric", "loss",
               "--yes", "--json")
    assert done.exit_code == 0
    parsed = body(done, "prune")
    # best loss is step 4 (corrupt, newest: kept); the newest valid one (3) is never deleted
    assert parsed["newest_valid"] == "snapshot_iter_3"
    assert parsed["deleted"] == ["snapshot_iter_1", "snapshot_iter_2"]
    assert snapshot_names(backend) == ["snapshot_iter_3", "snapshot_iter_4"]
    assert backend.raw_names(".snapkeep") == ["snapshot_iter_3.json", "snapshot_iter_4.json"]


def test_convert(backend: Backend) -> None:
    write(backend, [1])
    src, dst = url(backend, "snapshot_iter_1"), url(backend, "model.safetensors")
    result = run(backend, "convert", src, dst)
    assert result.exit_code == 0, result.output
    assert backend.read("model.safetensors")[8:9] == b"{"
    back = run(backend, "convert", dst, url(backend, "back.pt"))
    assert back.exit_code == 0, back.output
    assert run(backend, "diff", src, url(backend, "back.pt")).exit_code == 0
    corrupt(backend, "snapshot_iter_1")
    refused = run(backend, "convert", src, url(backend, "again.pt"))
    assert refused.exit_code == 1 and "does not match its checksum manifest" in refused.output
    assert "again.pt" not in backend.raw_names()


def test_load_latest(backend: Backend) -> None:
    options = backend.storage_options or None
    write(backend, [1, 2])
    state = snapkeep.load_latest(backend.out_dir, storage_options=options)
    assert torch.equal(state["w"], torch.full((8,), 2.0))
    corrupt(backend, "snapshot_iter_2")
    with pytest.warns(RuntimeWarning, match="skipping snapshot snapshot_iter_2"):
        state = snapkeep.load_latest(backend.out_dir, storage_options=options)
    assert torch.equal(state["w"], torch.full((8,), 1.0))
    corrupt(backend, "snapshot_iter_1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(snapkeep.NoValidSnapshotError):
            snapkeep.load_latest(backend.out_dir, storage_options=options)
    assert snapkeep.load_latest(backend.out_dir, template="other_{.iteration}",
                                storage_options=options) is None
