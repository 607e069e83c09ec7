"""`snapkeep.load_latest`: the newest verified snapshot's state without a manager, with autoload's
fallback, warnings and errors (local files; tests/storage/test_tools_on_backends.py runs it on
memory:// and S3)."""

from __future__ import annotations

import datetime
import pathlib
import warnings
from pathlib import Path

import pytest
import torch

import snapkeep
from snapkeep import writing


def write(out: Path, steps: list[int], template: str = "snapshot_iter_{}") -> None:
    writer = writing.SimpleWriter(out_dir=str(out))
    for step in steps:
        writer(template.format(step), str(out), {"w": torch.full((3,), float(step))}, step=step)
    writer.finalize()


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_loads_the_newest_by_step_not_mtime(tmp_path: Path) -> None:
    write(tmp_path, [100, 20, 3])  # the newest by mtime is step 3
    state = snapkeep.load_latest(tmp_path)
    assert torch.equal(state["w"], torch.full((3,), 100.0))


def test_none_when_there_are_no_snapshots(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("other files do not count")
    assert snapkeep.load_latest(tmp_path) is None
    write(tmp_path, [5])
    assert snapkeep.load_latest(tmp_path, template="ckpt_{.iteration}") is None


def test_template_and_map_location(tmp_path: Path) -> None:
    write(tmp_path, [1, 2], template="ckpt-{}.pt")
    state = snapkeep.load_latest(str(tmp_path), template="ckpt-{.iteration}.pt",
                                 map_location=torch.device("meta"))
    assert state["w"].device.type == "meta"


def test_falls_back_past_a_corrupt_snapshot_with_a_warning_at_the_call_site(
    tmp_path: Path,
) -> None:
    write(tmp_path, [1, 2])
    flip_byte(tmp_path / "snapshot_iter_2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = snapkeep.load_latest(tmp_path)
    assert torch.equal(state["w"], torch.full((3,), 1.0))
    assert len(caught) == 1
    assert "skipping snapshot snapshot_iter_2 (step 2)" in str(caught[0].message)
    assert caught[0].category is RuntimeWarning
    assert pathlib.Path(caught[0].filename).resolve() == pathlib.Path(__file__).resolve()


def test_manifestless_file_loads_with_a_warning(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "snapshot_iter_7")  # as ppe writes it
    with pytest.warns(RuntimeWarning, match="has no checksum manifest"):
        state = snapkeep.load_latest(tmp_path)
    assert torch.equal(state["w"], torch.ones(2))


def test_no_valid_snapshot_is_an_error_naming_each_file(tmp_path: Path) -> None:
    write(tmp_path, [1, 2])
    for step in (1, 2):
        flip_byte(tmp_path / f"snapshot_iter_{step}")
    before = sorted(p.name for p in tmp_path.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(snapkeep.NoValidSnapshotError) as info:
            snapkeep.load_latest(tmp_path)
    assert "snapshot_iter_1" in str(info.value) and "snapshot_iter_2" in str(info.value)
    assert "Move them away to start fresh" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_unsafe_snapshot_is_refused_without_falling_back(tmp_path: Path) -> None:
    write(tmp_path, [1])
    torch.save({"when": datetime.date(2024, 1, 2)}, tmp_path / "snapshot_iter_2")
    with pytest.raises(snapkeep.UnsafeSnapshotError, match="weights_only=False"):
        snapkeep.load_latest(tmp_path)
    with pytest.warns(RuntimeWarning, match="no checksum manifest"):
        state = snapkeep.load_latest(tmp_path, weights_only=False)
    assert state["when"] == datetime.date(2024, 1, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"out_dir": 3}, TypeError, "out_dir must be a path"),
        ({"template": None}, TypeError, "template must be a str"),
        ({"template": "{"}, ValueError, "malformed"),
        ({"weights_only": "yes"}, TypeError, "weights_only must be True or False"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    out_dir = kwargs.pop("out_dir", tmp_path)
    with pytest.raises(error, match=match):
        snapkeep.load_latest(out_dir, **kwargs)


def test_missing_directory_is_a_first_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="snapkeep"):
        assert snapkeep.load_latest(tmp_path / "not" / "yet") is None
    assert [r.getMessage() for r in caplog.records] == [
        f"load_latest: {tmp_path / 'not' / 'yet'} does not exist: no snapshot to resume"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        snapkeep.load_latest(tmp_path / "file")


def test_files_of_another_template_are_named_with_the_template_that_matches(
        tmp_path: Path) -> None:
    for step in (100, 200):
        torch.save({"w": step}, tmp_path / f"{step}.pt")
    with pytest.warns(RuntimeWarning, match=r"\['100.pt', '200.pt'\] would match the template "
                                            r"'\{.iteration\}.pt'"):
        assert snapkeep.load_latest(tmp_path) is None
    with pytest.warns(RuntimeWarning, match="no checksum manifest"):  # written by torch.save
        assert snapkeep.load_latest(tmp_path, template="{.iteration}.pt") == {"w": 200}
