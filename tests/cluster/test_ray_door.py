"""``snapkeep.ray`` without a cluster: what it refuses outside a Ray Train worker, and the
reference a Ray checkpoint holds (what ``reference_of`` accepts and refuses). The end-to-end
behaviour (a real TorchTrainer, a killed worker) is ``test_ray.py``."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")

import snapkeep  # noqa: E402
import snapkeep.ray  # noqa: E402
from snapkeep.ray import REFERENCE_NAME, SnapshotReference, reference_of  # noqa: E402


@pytest.mark.parametrize("call", ["report", "resume"])
def test_outside_a_ray_worker_the_door_refuses_naming_itself(tmp_path: pathlib.Path,
                                                             call: str) -> None:
    model = torch.nn.Linear(2, 2)
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(RuntimeError, match=rf"snapkeep.ray.{call} must be called inside a "
                                               r"Ray Train worker.*checkpointer\.(save|load)"):
            if call == "report":
                snapkeep.ray.report(ckpt, 1, {"model": model})
            else:
                snapkeep.ray.resume(ckpt, {"model": model})
        assert ckpt.all_steps() == []  # nothing was saved


def _checkpoint(tmp_path: pathlib.Path, text: str | None) -> ray.train.Checkpoint:
    folder = tmp_path / "ray-checkpoint"
    folder.mkdir()
    if text is not None:
        (folder / REFERENCE_NAME).write_text(text)
    return ray.train.Checkpoint.from_directory(str(folder))


def test_a_reference_round_trips(tmp_path: pathlib.Path) -> None:
    made = SnapshotReference(directory="/shared/run/snapshots", name="ckpt_8", step=8,
                             world_size=2, version=snapkeep.__version__)
    read = reference_of(_checkpoint(tmp_path, made.to_json()))
    assert read == made
    assert read.path == "/shared/run/snapshots/ckpt_8"


@pytest.mark.parametrize(("text", "message"), [
    (None, f"holds no {REFERENCE_NAME}: it was not reported by snapkeep.ray.report"),
    ("{not json", "is not a snapkeep reference"),
    (json.dumps({"format": "snapkeep.ray/1", "directory": "/d", "name": "ckpt_1", "step": True,
                 "world_size": 2, "version": "0"}), "is not a snapkeep.ray/1 reference"),
    (json.dumps({"format": "other", "directory": "/d", "name": "ckpt_1", "step": 1,
                 "world_size": 2, "version": "0"}), "is not a snapkeep.ray/1 reference"),
    ("x" * (70 * 1024), "unreadable"),
], ids=["missing", "not-json", "bool-step", "other-format", "oversized"])
def test_reference_of_refuses_what_report_did_not_write(tmp_path: pathlib.Path,
                                                        text: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        reference_of(_checkpoint(tmp_path, text))


def test_reference_of_refuses_a_fifo_without_blocking(tmp_path: pathlib.Path) -> None:
    checkpoint = _checkpoint(tmp_path, None)
    os.mkfifo(tmp_path / "ray-checkpoint" / REFERENCE_NAME)
    with pytest.raises(ValueError, match="unreadable"):
        reference_of(checkpoint)


def test_reference_of_names_its_argument() -> None:
    with pytest.raises(TypeError, match="checkpoint must be a ray.train.Checkpoint"):
        reference_of("/some/dir")  # type: ignore[arg-type]


def test_the_cluster_page_shows_the_example_test_ray_runs() -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    page = (root / "docs" / "cluster.md").read_text()
    assert '--8<-- "docs/examples/ray_train.py"' in page
    example = (root / "docs" / "examples" / "ray_train.py").read_text()
    for call in ("snapkeep.ray.resume(ckpt, state)", "snapkeep.ray.report(ckpt, step, state",
                 "FailureConfig(max_failures=", "CheckpointConfig(num_to_keep="):
        assert call in example
        assert call.split("(")[0] in page


def _run(directory: pathlib.Path, steps: list[int], sharded: bool = False) -> torch.nn.Linear:
    """Snapshots of a model at ``steps`` (its weight filled with the step)."""
    model = torch.nn.Linear(2, 2)
    with snapkeep.Checkpointer(directory, sharded=sharded) as ckpt:
        for step in steps:
            with torch.no_grad():
                model.weight.fill_(step)
            ckpt.save(step, {"model": model})
    return model


def _reference(directory: pathlib.Path, step: int) -> SnapshotReference:
    return SnapshotReference(directory=str(directory), name=f"ckpt_{step}", step=step,
                             world_size=1, version=snapkeep.__version__)


def _fresh() -> torch.nn.Linear:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    return model


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_resume_from_loads_the_step_ray_names_or_a_newer_committed_one(
        tmp_path: pathlib.Path, sharded: bool) -> None:
    """A kill after a commit and before Ray registered its report leaves Ray one step behind:
    snapkeep's newer committed snapshot is resumed (sharded: as after a Ray run, in one
    process)."""
    _run(tmp_path, [4, 8], sharded)
    for named in (8, 4):
        model = _fresh()
        with snapkeep.Checkpointer(tmp_path, sharded=sharded) as ckpt:
            assert snapkeep.ray.resume_from(ckpt, {"model": model}, _reference(tmp_path, named)) \
                == 8
        assert torch.equal(model.weight, torch.full((2, 2), 8.0))
    model = _fresh()
    with snapkeep.Checkpointer(tmp_path / "first") as ckpt:  # no reference, no snapshot
        assert snapkeep.ray.resume_from(ckpt, {"model": model}, None) is None


@pytest.mark.parametrize("case", ["other-directory", "deleted"])
def test_resume_from_refuses_before_loading(tmp_path: pathlib.Path, case: str) -> None:
    _run(tmp_path, [4])
    reference = _reference(tmp_path / "elsewhere", 4) if case == "other-directory" \
        else _reference(tmp_path, 8)
    model = _fresh()
    error = ValueError if case == "other-directory" else snapkeep.errors.NoValidSnapshotError
    message = "but checkpointer writes to" if case == "other-directory" \
        else r"names step 8 .* holds no committed snapshot at or after it \(steps there: \[4\]\)"
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(error, match=message):
            snapkeep.ray.resume_from(ckpt, {"model": model}, reference)
    assert torch.equal(model.weight, torch.full((2, 2), -1.0))  # nothing was loaded


def test_resume_from_never_goes_behind_the_step_ray_names(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The snapshot Ray names is corrupt: the load falls back to an older one, which is named
    as behind what Ray recorded (raised, not trained on)."""
    _run(tmp_path, [4, 8])
    data = bytearray((tmp_path / "ckpt_8").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "ckpt_8").write_bytes(bytes(data))
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(snapkeep.errors.NoValidSnapshotError,
                           match=r"at and after step 8 .* step 4 was loaded instead"):
            snapkeep.ray.resume_from(ckpt, {"model": _fresh()}, _reference(tmp_path, 8))
    assert "skipped ckpt_8 (step 8)" in capsys.readouterr().err
