"""Every JSON record snapkeep reads answers a hostile file with a snapkeep result or error.

A record (a run status, a manifest, a commit marker, a sharded snapshot's marker, an owner record
of the memory tier, the lock's holder line, a safetensors header) is a file anyone with write
access to the directory may have written. Before: ``snapkeep status`` on a status with
``time_unix_s`` 1e300, a NaN time, a pid of 2**70 or a 100,000-deep array died with a
traceback (exit 1 for every state, so a job script could not tell a preemption); a lock holder
line with an out-of-range time raised OverflowError instead of StoreLockedError; an owner record
of the memory tier with a pid of 2**70 made ``owner_alive`` raise OverflowError.

Each reader is fed (a) the issue's cases and (b) valid records with one field replaced by a
hostile value (hypothesis): it returns, or raises only its documented error.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapkeep._core.distributed.sharded_store import ShardedManifest
from snapkeep._core.errors import ManifestError, SnapshotCorruptError, StoreLockedError
from snapkeep._core.format.codec import load_safetensors
from snapkeep._core.format.json_records import RecordError, parse_json
from snapkeep._core.format.manifest import Manifest
from snapkeep._core.session.run_status import RunStatus
from snapkeep._core.store.lock import StoreLock, lock_path
from snapkeep._core.store.marked_dirs import CheckpointMarker, is_marker
from snapkeep._core.tiers.memory_store import owner_alive, owners, write_owner
from snapkeep.cli import cli

try:
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]


class Raw:
    """JSON text put into a record verbatim (tokens and shapes ``json.dumps`` cannot make)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r})"


def dumps(value: Any) -> str:
    """``value`` as JSON text, :class:`Raw` parts verbatim."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


DEEP = Raw("[" * 100_000 + "]" * 100_000)
#: The issue's values and their kin: out of every range a field could have.
HOSTILE_VALUES = [
    Raw("1e300"), Raw("-1e300"), Raw("1e400"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"),
    2**70, -(2**70), 2**63, -1, Raw("9" * 400), 0.5, True, None, "", "x" * 100_000,
    Raw('"\\ud800"'), "\x1b]0;pwned\x07", [], {}, [1, [2, [3]]], {"a": {"b": {}}}, DEEP,
]

hostile = st.one_of(
    st.sampled_from(HOSTILE_VALUES),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.integers(min_value=1, max_value=3000).map(lambda n: Raw("[" * n + "]" * n)),
)


def with_field(record: dict[str, Any], data: st.DataObject) -> str:
    """``record`` as JSON text with one of its fields (or a new one) hostile."""
    body = dict(record)
    key = data.draw(st.sampled_from([*record, "extra"]))
    body[key] = data.draw(hostile)
    return dumps(body)


# -- the run status and `snapkeep status` ----------------------------------------------------------
STATUS = {"format": 1, "state": "preempted", "step": 5, "time_unix_s": 1700000000.0,
          "reason": "SIGTERM", "snapshots": ["snapshot_iter_5"], "world_size": 1, "pid": 4242,
          "host": "node-1", "start_token": ""}


@contextlib.contextmanager
def status_dir(text: str | bytes) -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        (out / ".snapkeep").mkdir()
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
        (out / ".snapkeep" / "status.json").write_bytes(data)
        yield out


def status_cli(text: str | bytes) -> tuple[int, str]:
    with status_dir(text) as out:
        result = CliRunner().invoke(cli, ["status", str(out)])
        json_result = CliRunner().invoke(cli, ["status", str(out), "--json"])
    for r in (result, json_result):  # a snapkeep answer, never a traceback
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exc_info
        assert r.exit_code == result.exit_code
    if result.exit_code in (0, 75):
        json.loads(json_result.stdout)  # strict JSON out
        assert "\x1b" not in result.output
    return result.exit_code, result.output


@pytest.mark.parametrize(("field", "value", "said"), [
    ("time_unix_s", Raw("1e300"), "field 'time_unix_s' must be a number in [0, 2.53402e+11)"),
    ("time_unix_s", Raw("NaN"), "NaN is not a JSON number"),
    ("pid", 2**70, "integer of 22 digits (at most 20)"),
    ("pid", 2**40, "field 'pid' must be an int in [0, 2147483648)"),
    ("extra", DEEP, "nested deeper than 32"),
    ("step", 2**64, "field 'step' must be an int in [0, 9223372036854775808)"),
    ("world_size", 0, "field 'world_size' must be an int in [1, 2147483648)"),
    ("state", "paused", "field 'state' must be one of"),
    ("snapshots", Raw('["\\ud800"]'), "is not valid Unicode"),
], ids=["time-1e300", "time-nan", "pid-2**70", "pid-2**40", "deep-array", "step-2**64",
        "world-0",
        "unknown-state", "lone-surrogate"])
def test_status_out_of_range_values_are_an_invalid_status_exit_1(field: str, value: Any,
                                                                 said: str) -> None:
    code, output = status_cli(dumps({**STATUS, field: value}))
    assert code == 1 and "invalid status file" in output and said in output, output
    assert "snapkeep ls" in output  # what to do next


def test_a_deep_array_as_the_whole_status_is_invalid() -> None:
    code, output = status_cli(DEEP.text)
    assert code == 1 and "nested deeper than" in output, output


def test_a_valid_preempted_status_exits_75_and_prints_no_control_characters() -> None:
    assert status_cli(dumps(STATUS))[0] == 75
    code, output = status_cli(dumps({**STATUS, "reason": "\x1b]0;pwned\x07 SIGTERM"}))
    assert code == 75 and "\\x1b]0;pwned\\x07 SIGTERM" in output, output


def test_a_hostile_preemption_record_is_shown_bounded_never_a_traceback() -> None:
    """The deadline's record (``preemption``) in a status: numbers that are strings, huge or
    not finite read as 'unknown'; long strings are cut; a non-object is an invalid status."""
    hostile = {"committed_to": "x" * 10_000, "remaining_s": "abc", "deadline_from": ["a"] * 50,
               "durable_estimate_s": 1e308}
    code, output = status_cli(dumps({**STATUS, "preemption": hostile}))
    # not "storage": the step is not durable, exit 79 as documented
    assert code == 79 and "unknown left" in output and "x" * 41 not in output, output
    code, output = status_cli(dumps({**STATUS, "preemption": [1, 2]}))
    assert code == 1 and "field 'preemption' must be an object" in output, output


def test_a_status_that_is_too_large_or_not_a_file_is_invalid(tmp_path: pathlib.Path) -> None:
    code, output = status_cli(b" " * (2 << 20))
    assert code == 1 and "invalid status file" in output, output
    (tmp_path / ".snapkeep").mkdir()
    os.mkfifo(tmp_path / ".snapkeep" / "status.json")
    result = CliRunner().invoke(cli, ["status", str(tmp_path)])
    assert result.exit_code == 1 and "invalid status file" in result.output, result.output


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_status_any_hostile_field_exit_code_as_documented(data: st.DataObject) -> None:
    text = with_field(STATUS, data)
    try:
        RunStatus.from_bytes(text.encode("utf-8", "surrogatepass"))
    except ValueError:
        pass
    code, _ = status_cli(text)
    assert code in (1, 75)


# -- manifests, markers, owner records, the lock's holder, safetensors headers ---------------------
MANIFEST = {"format": "snapkeep.manifest/1", "name": "ckpt_3", "size_bytes": 10,
            "checksum": "0" * 32, "algorithm": "xxh3_128", "step": 3, "created_unix_s": 1.0,
            "snapkeep_version": "1", "run_id": "r", "metrics": {"loss": 0.5},
            "blobs": {"1" * 32: 4}, "blob_area": ".snapkeep/blobs/k"}
MARKER = {"format": "snapkeep.hf-checkpoint/1", "step": 4, "algorithm": "xxh3_128",
          "files": {"model.safetensors": {"size_bytes": 10, "checksum": "0" * 32}},
          "run_id": "r", "metrics": {}, "created_unix_s": 1.0, "snapkeep_version": "1"}
SHARDED = {"format": "snapkeep.sharded/1", "name": "ckpt_2", "world_size": 2, "step": 2,
           "algorithm": "xxh3_128", "files": {".metadata": {"size_bytes": 3, "checksum": "ab",
                                                             "rank": 0}}}
OWNER = {"pid": os.getpid(), "host": socket.gethostname(), "time": 1.0, "rank": 0, "world": 1}
HOLDER = {"pid": 4242, "host": "node-1", "since_unix_s": 1700000000.0}


def _encoded(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def test_the_record_formats_used_here_are_the_real_ones() -> None:
    """The hostile variants start from records each reader accepts (else the property tests
    would test only refusals)."""
    assert Manifest.from_bytes(_encoded(dumps(MANIFEST))).step == 3
    assert CheckpointMarker.from_bytes(_encoded(dumps(MARKER))).step == 4
    assert is_marker(_encoded(dumps(MARKER)))
    sharded = json.loads(ShardedManifest(name="x", world_size=1, files={}).to_bytes())
    assert sharded["format"] == SHARDED["format"], sharded
    assert ShardedManifest.from_bytes(_encoded(dumps(SHARDED))).world_size == 2


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_manifest_and_marker_readers_answer_only_with_their_errors(data: st.DataObject) -> None:
    for record, read, errors in (
            (MANIFEST, Manifest.from_bytes, ManifestError),
            (MARKER, CheckpointMarker.from_bytes, SnapshotCorruptError),
            (SHARDED, ShardedManifest.from_bytes, ValueError)):
        text = _encoded(with_field(record, data))
        try:
            read(text)
        except errors:
            pass
        assert is_marker(text) in (True, False)


@pytest.fixture
def tier(tmp_path: pathlib.Path) -> Iterator[tuple[pathlib.Path, str]]:
    """A memory tier directory of this user with one owner record (its path)."""
    root = tmp_path / "tiers"
    root.mkdir(mode=0o700)
    path = write_owner(str(root), "job", 0)
    yield pathlib.Path(path).parent, path


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_owner_records_of_the_memory_tier_are_read_or_skipped(
        tier: tuple[pathlib.Path, str], data: st.DataObject) -> None:
    directory, path = tier
    pathlib.Path(path).write_bytes(_encoded(with_field(OWNER, data)))
    for record in owners(str(directory)):  # a malformed record is skipped (logged)
        assert owner_alive(record) in (True, False)


def test_an_owner_record_with_a_pid_of_2_to_the_70_is_skipped(
        tier: tuple[pathlib.Path, str]) -> None:
    directory, path = tier
    pathlib.Path(path).write_text(dumps({**OWNER, "pid": 2**70}))
    assert owners(str(directory)) == []


@pytest.mark.skipif(fcntl is None, reason="flock only")
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_hostile_lock_holder_line_still_gives_store_locked_error(
        tmp_path: pathlib.Path, data: st.DataObject) -> None:
    text = _encoded(with_field(HOLDER, data))[:4096]
    _locked_by_another(tmp_path, text)


def test_a_lock_holder_time_of_1e300_names_an_unknown_time(tmp_path: pathlib.Path) -> None:
    message = _locked_by_another(tmp_path, _encoded(dumps({**HOLDER, "since_unix_s":
                                                           Raw("1e300")})))
    assert "pid 4242 on host node-1, since unknown time" in message, message


def _locked_by_another(tmp_path: pathlib.Path, holder_line: bytes) -> str:
    """The StoreLockedError message of a lock file holding ``holder_line`` and held (flock) by
    another open file, as by another process."""
    path = pathlib.Path(lock_path(str(tmp_path)))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, holder_line)
        with pytest.raises(StoreLockedError) as raised:
            StoreLock.acquire(str(tmp_path), "out", what="t_{step}")
        return str(raised.value)
    finally:
        os.close(fd)
        path.unlink()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_hostile_safetensors_header_is_a_value_error(data: st.DataObject) -> None:
    header = _encoded(with_field({"__metadata__": {"snapkeep.layout": "nested/1"},
                                  "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                                 data))
    blob = struct.pack("<Q", len(header)) + header + b"\0" * 4
    try:
        load_safetensors(blob)
    except ValueError:
        pass


def test_the_empty_dicts_metadata_of_a_safetensors_file_is_checked() -> None:
    from safetensors.torch import save

    for empty in ("[" * 5000 + "]" * 5000, "5", '[1, 2]', '["w/x"]'):
        blob = save({"w": torch.zeros(1)}, metadata={"snapkeep.layout": "nested/1",
                                                    "snapkeep.empty_dicts": empty})
        with pytest.raises(ValueError):
            load_safetensors(blob)


# -- the parser itself -----------------------------------------------------------------------------
@pytest.mark.parametrize("text", [DEEP.text, "1e400", "NaN", '["\\ud800"]', "9" * 30, "\xff",
                                  "[" * 33 + "]" * 33])
def test_parse_json_refuses_with_record_error(text: str) -> None:
    with pytest.raises(RecordError):
        parse_json(text.encode("utf-8", "surrogateescape"), max_bytes=1 << 20)


def test_parse_json_is_linear_on_unterminated_strings() -> None:
    """Before a regex pre-scan was dropped, 20 KB of ``"\\`` took seconds: 1 MiB is parsed at
    once now (json's C scanner; bounded work whatever the content)."""
    with pytest.raises(RecordError):
        parse_json(b'"\\' * (1 << 19), max_bytes=1 << 20)


def test_a_log_report_state_with_a_deep_log_is_a_value_error_and_nan_is_kept() -> None:
    """LogReport's saved log (a JSON string inside the snapshot): a 100,000-deep array raised
    RecursionError out of load_state_dict; ppe's NaN values still load."""
    from snapkeep.training import extensions

    report = extensions.LogReport()
    summary = report.state_dict()["_summary"]
    with pytest.raises(ValueError, match="nested deeper than"):
        report.load_state_dict({"_summary": summary, "_log": DEEP.text})
    report.load_state_dict({"_summary": summary, "_log": '[{"loss": NaN}]'})
    assert report.state_dict()["_log"] == '[{"loss": NaN}]'
