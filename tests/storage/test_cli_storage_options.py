"""`snapkeep ls/verify/inspect` on an S3 URL with `-o KEY=VALUE` storage options (moto server)."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from click.testing import CliRunner

from snapkeep import writing
from snapkeep.cli import cli
from support.storage_backends import BUCKET, MotoServer, s3_options

pytestmark = pytest.mark.s3


def _flags(options: dict) -> list[str]:
    flags = []
    for key, value in options.items():
        if isinstance(value, dict):
            flags += _flags({f"{key}.{k}": v for k, v in value.items()})
        else:
            flags += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return flags


def test_ls_verify_inspect_on_s3_with_storage_options(moto_server: MotoServer) -> None:
    options = s3_options(moto_server.endpoint)
    url = f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:8]}"
    writer = writing.SimpleWriter(out_dir=url, storage_options=options)
    for step in (10, 20):
        writer(f"snapshot_iter_{step}", url, {"w": torch.full((64,), float(step))}, step=step)
    writer.finalize()
    runner = CliRunner()
    flags = _flags(options)

    listed = runner.invoke(cli, ["ls", url, *flags])
    assert listed.exit_code == 0, listed.output
    lines = [line.split() for line in listed.output.splitlines()[1:]]
    assert [(row[0], row[-1]) for row in lines] == [("10", "snapshot_iter_10"),
                                                   ("20", "snapshot_iter_20")]
    assert all("ok" in row for row in lines)

    verified = runner.invoke(cli, ["verify", url, *flags])
    assert verified.exit_code == 0, verified.output
    assert "2 snapshots, 0 corrupt or refused" in verified.output

    inspected = runner.invoke(cli, ["inspect", f"{url}/snapshot_iter_20", *flags])
    assert inspected.exit_code == 0, inspected.output
    assert "w" in inspected.output and "1" in inspected.output


def test_malformed_storage_option_is_a_usage_error_naming_it(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["ls", str(tmp_path), "-o", "endpoint_url"])
    assert result.exit_code == 2
    assert "--storage-option" in result.output and "KEY=VALUE" in result.output


def test_storage_failures_are_one_clear_line(moto_server: MotoServer) -> None:
    url = f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:8]}"
    runner = CliRunner()
    result = runner.invoke(cli, ["ls", url, *_flags(s3_options(moto_server.endpoint)),
                                 "-o", "bogus_key=1"])
    assert result.exit_code == 3  # storage trouble, not a failed check
    assert "cannot read s3://" in result.output and "storage options" in result.output
    assert "Traceback" not in result.output
