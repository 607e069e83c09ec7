"""Numbers a manifest cannot hold, or holds beyond a float's range.

- A NaN or infinite metric (a diverged loss passed as ``metrics=``) was written into the
  manifest as the non-JSON tokens ``NaN``/``Infinity``; ``snapkeep ls --json`` then died with a
  traceback (``json.dumps(allow_nan=False)``). Now such metrics are left out when written and
  dropped when an older manifest holding them is read.
- An integer beyond a float's range in a number field (``created_unix_s``, a metric) raised a
  bare ``OverflowError`` out of manifest validation: autoload and every CLI command crashed
  instead of treating the manifest as invalid.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import snapkeep
from snapkeep import writing
from snapkeep.cli import cli

HUGE_INT = "9" * 400  # valid JSON; no float can hold it


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _strict_json(path: Path) -> Any:
    def refuse(token: str) -> None:
        raise ValueError(f"non-JSON token {token} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _write(out: Path, steps: list[int], metrics: dict[str, float] | None = None) -> None:
    writer = writing.SimpleWriter(out_dir=str(out))
    for step in steps:
        writer(f"snapshot_iter_{step}", str(out), {"w": torch.full((3,), float(step))},
               step=step, metrics=metrics or {})
    writer.finalize()


def test_non_finite_metrics_are_left_out_of_the_manifest(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _write(out, [1], metrics={"loss": float("nan"), "gnorm": float("inf"), "acc": 0.5})
    manifest = _strict_json(out / ".snapkeep" / "snapshot_iter_1.json")
    assert manifest["metrics"] == {"acc": 0.5}

    result = _invoke("ls", str(out), "--json")
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["snapshots"]
    assert entry["status"] == "ok" and entry["metrics"] == {"acc": 0.5}


def test_an_older_manifest_with_nan_metrics_still_verifies(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _write(out, [1], metrics={"loss": 0.25, "acc": 0.5})
    path = out / ".snapkeep" / "snapshot_iter_1.json"
    text = path.read_text()
    text = text.replace('"acc": 0.5', '"acc": NaN').replace('"loss": 0.25', '"loss": -Infinity')
    path.write_text(text)  # as snapkeep 0.1.0 wrote a diverged run's metrics
    with pytest.raises(ValueError):
        _strict_json(path)

    for command in ("ls", "verify"):
        result = _invoke(command, str(out), "--json")
        assert result.exit_code == 0, result.output
        (entry,) = json.loads(result.stdout)["snapshots"]
        assert entry["status"] == "ok", entry  # the checksum is still checked
    assert json.loads(_invoke("ls", str(out), "--json").stdout)["snapshots"][0]["metrics"] == {}
    state = snapkeep.load_latest(str(out))
    assert torch.equal(state["w"], torch.full((3,), 1.0))


@pytest.mark.parametrize("field", ["created_unix_s", "metrics"])
def test_an_integer_beyond_float_range_is_an_invalid_manifest_not_a_crash(
    tmp_path: Path, field: str,
) -> None:
    out = tmp_path / "run"
    _write(out, [1, 2], metrics={"loss": 0.5})
    path = out / ".snapkeep" / "snapshot_iter_2.json"
    text = path.read_text()
    if field == "created_unix_s":
        text = re.sub(r'"created_unix_s": [0-9.e+]+', f'"created_unix_s": {HUGE_INT}', text)
    else:
        text = text.replace('"loss": 0.5', f'"loss": {HUGE_INT}')
    assert HUGE_INT in text
    path.write_text(text)

    # refused as it is parsed (json_records: integers of at most 20 digits)
    with pytest.warns(RuntimeWarning, match=r"integer of 400 digits \(at most 20\)"):
        state = snapkeep.load_latest(str(out))  # unverified, but complete: loaded
    assert torch.equal(state["w"], torch.full((3,), 2.0))
    for command in ("ls", "verify"):
        result = _invoke(command, str(out), "--json")
        assert result.exit_code == 0, result.output
        statuses = {e["name"]: e["status"] for e in json.loads(result.stdout)["snapshots"]}
        assert statuses["snapshot_iter_1"] == "ok"
        assert statuses["snapshot_iter_2"] in ("no manifest", "unverified")
    result = _invoke("prune", str(out), "--keep-best", "1", "--metric", "loss", "--json")
    assert result.exit_code == 0, result.output
