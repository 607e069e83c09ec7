"""The snapshot extension's arguments, with observable results: exact directory listings,
loaded state equal to the saved state (after checking that it differed), errors that name the
argument and leave every saved snapshot in place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from snapkeep import writing
from snapkeep._core.errors import SnapshotStorageError
from snapkeep.training import PRIORITY_SNAPSHOT, ExtensionsManager
from snapkeep.training import extensions as ext

MANIFESTS = ".snapkeep"


class Run:
    """A small model, its optimizer and a manager writing into ``out``."""

    def __init__(
        self, out: Path | str, *, seed: int = 0, iters_per_epoch: int = 2, max_epochs: int = 10,
        writer: Any = None,
    ) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.manager = ExtensionsManager(
            self.model, self.optimizer, max_epochs, iters_per_epoch=iters_per_epoch,
            out_dir=str(out), writer=writer,
        )

    def train(self, iterations: int, *, fail_at: int | None = None) -> None:
        for _ in range(iterations):
            with self.manager.run_iteration():
                if fail_at is not None and self.manager.iteration + 1 == fail_at:
                    raise RuntimeError("loss is nan")
                self.optimizer.zero_grad()
                self.model(torch.ones(4, 3)).pow(2).sum().backward()
                self.optimizer.step()


def listing(directory: Path | str) -> list[str]:
    """Names in ``directory``, without the store's lock file (``.snapkeep/*.lock``)."""
    return sorted(n for n in os.listdir(directory) if not n.endswith(".lock"))


def snapshots_and_manifests(directory: Path) -> tuple[list[str], list[str]]:
    names = [n for n in listing(directory) if n != MANIFESTS]
    manifests = listing(directory / MANIFESTS) if (directory / MANIFESTS).exists() else []
    return names, manifests


def contents(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (recursively) and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def tensors_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            tensors_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


# -- defaults --------------------------------------------------------------------------------------
def test_default_trigger_and_priority(tmp_path):
    snapshot = ext.snapshot()
    assert snapshot.trigger == (1, "epoch")
    assert snapshot.priority == PRIORITY_SNAPSHOT
    assert ext.snapshot_object(torch.nn.Linear(1, 1), "m_{.iteration}").priority \
        == PRIORITY_SNAPSHOT

    run = Run(tmp_path, iters_per_epoch=3)
    run.manager.extend(snapshot)  # default trigger: once per epoch
    run.train(7)
    run.manager.finalize()
    assert snapshots_and_manifests(tmp_path) == (
        ["snapshot_iter_3", "snapshot_iter_6"],
        ["snapshot_iter_3.json", "snapshot_iter_6.json"],
    )


def test_snapshot_runs_after_other_extensions_of_the_iteration(tmp_path):
    run = Run(tmp_path)

    def stamp(manager: ExtensionsManager) -> None:  # priority below the snapshot's
        with torch.no_grad():
            run.model.weight.fill_(float(manager.iteration))

    run.manager.extend(stamp, trigger=(1, "iteration"), priority=PRIORITY_SNAPSHOT - 50)
    run.manager.extend(ext.snapshot_object(run.model, "model_{.iteration}"),
                       trigger=(1, "iteration"))
    run.train(2)
    for iteration in (1, 2):
        saved = torch.load(tmp_path / f"model_{iteration}", weights_only=True)
        assert torch.equal(saved["weight"], torch.full((2, 3), float(iteration)))


# -- filename --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("filename", "expected"),
    [
        ("snap_e{0.epoch}_i{0.iteration}.pt",
         ["snap_e0_i1.pt", "snap_e1_i2.pt", "snap_e1_i3.pt", "snap_e2_i4.pt"]),
        (lambda m: f"cb_{m.iteration:03d}", ["cb_001", "cb_002", "cb_003", "cb_004"]),
        ("sub/it_{.iteration}", ["sub"]),
    ],
    ids=["template", "callable", "sub-directory"],
)
def test_filename_is_formatted_with_the_manager(tmp_path, filename, expected):
    run = Run(tmp_path, iters_per_epoch=2)
    run.manager.extend(ext.snapshot(filename=filename), trigger=(1, "iteration"))
    run.train(4)
    run.manager.finalize()
    assert [n for n in listing(tmp_path) if n != MANIFESTS] == expected
    if expected == ["sub"]:
        assert [n for n in listing(tmp_path / "sub") if n != MANIFESTS] == [
            "it_1", "it_2", "it_3", "it_4"]


# -- savefun / writer ------------------------------------------------------------------------------
def test_savefun_and_writer_together_is_a_type_error():
    def savefun(obj: Any, f: Any) -> None:
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="savefun and writer"):
        ext.snapshot(savefun=savefun, writer=writing.SimpleWriter())
    with pytest.raises(TypeError, match="savefun and writer"):
        ext.snapshot_object(torch.nn.Linear(1, 1), "x", savefun=savefun,
                            writer=writing.SimpleWriter())


def test_savefun_is_called_in_torch_save_order(tmp_path):
    calls: list[tuple[type, bool]] = []

    def savefun(obj: Any, f: Any, **kwargs: Any) -> None:
        calls.append((type(obj), hasattr(f, "write") or isinstance(f, (str, os.PathLike))))
        torch.save(obj, f)

    run = Run(tmp_path)
    run.manager.extend(ext.snapshot_object(run.model, "m_{.iteration}", savefun=savefun),
                       trigger=(1, "iteration"))
    run.train(1)
    assert len(calls) == 1
    obj_type, file_like = calls[0]
    assert issubclass(obj_type, dict) and file_like  # savefun(obj, file), as torch.save
    assert torch.equal(torch.load(tmp_path / "m_1", weights_only=True)["bias"], run.model.bias)


# -- condition -------------------------------------------------------------------------------------
def test_condition_skips_snapshots(tmp_path):
    run = Run(tmp_path)
    run.manager.extend(ext.snapshot(condition=lambda: run.manager.iteration % 2 == 0),
                       trigger=(1, "iteration"))
    run.train(5)
    assert snapshots_and_manifests(tmp_path)[0] == ["snapshot_iter_2", "snapshot_iter_4"]


def test_condition_must_be_callable():
    with pytest.raises(TypeError, match="condition must be a callable"):
        ext.snapshot(condition=True)


# -- snapshot_on_error -----------------------------------------------------------------------------
@pytest.mark.parametrize("writer_class", [writing.SimpleWriter, writing.ThreadWriter])
def test_snapshot_on_error_saves_the_state_of_the_failed_loop(tmp_path, writer_class):
    writer = writer_class(out_dir=str(tmp_path))
    run = Run(tmp_path, writer=writer)
    run.manager.extend(ext.snapshot(snapshot_on_error=True), trigger=(100, "iteration"))
    with pytest.raises(RuntimeError, match="loss is nan"):
        run.train(5, fail_at=3)
    # written under its own name (mid-iteration state; see the on-error tests below)
    assert snapshots_and_manifests(tmp_path) == (
        ["snapshot_iter_2.on-error"], ["snapshot_iter_2.on-error.json"])
    state = torch.load(tmp_path / "snapshot_iter_2.on-error", weights_only=True)
    assert state["_start_iteration"] == 2
    assert tensors_equal(state["models"]["main"], run.model.state_dict())
    writer.finalize()


class _BatchNormRun(Run):
    """A model with BatchNorm: forward updates running statistics before the loss is known, so
    a failure after forward leaves mid-iteration state (as a NaN loss does in real training)."""

    def __init__(self, out: Path | str, *, writer: Any = None) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.manager = ExtensionsManager(self.model, self.optimizer, 10, iters_per_epoch=2,
                                         out_dir=str(out), writer=writer)

    def train(self, iterations: int, *, fail_at: int | None = None) -> None:
        for _ in range(iterations):
            with self.manager.run_iteration():
                self.optimizer.zero_grad()
                loss = self.model(torch.randn(4, 3)).pow(2).sum()
                if fail_at is not None and self.manager.iteration + 1 == fail_at:
                    raise RuntimeError("loss is nan")  # after forward, before the step
                loss.backward()
                self.optimizer.step()


@pytest.mark.parametrize("writer_class", [writing.SimpleWriter, writing.ThreadWriter])
def test_on_error_snapshot_never_replaces_or_outranks_a_clean_one(tmp_path, writer_class):
    run = _BatchNormRun(tmp_path, writer=writer_class(out_dir=str(tmp_path)))
    run.manager.extend(ext.snapshot(snapshot_on_error=True, n_retains=1),
                       trigger=(1, "iteration"))
    with pytest.raises(RuntimeError, match="loss is nan"):
        run.train(5, fail_at=3)
    run.manager.finalize()
    clean_bytes = (tmp_path / "snapshot_iter_2").read_bytes()
    clean = torch.load(tmp_path / "snapshot_iter_2", weights_only=True)
    on_error = torch.load(tmp_path / "snapshot_iter_2.on-error", weights_only=True)
    # both exist; they differ (forward of iteration 3 updated the running statistics)
    assert snapshots_and_manifests(tmp_path) == (
        ["snapshot_iter_2", "snapshot_iter_2.on-error"],
        ["snapshot_iter_2.json", "snapshot_iter_2.on-error.json"])
    key = "1.running_mean"
    assert not torch.equal(clean["models"]["main"][key], on_error["models"]["main"][key])

    resumed = _BatchNormRun(tmp_path, writer=writer_class(out_dir=str(tmp_path)))
    snapshot = ext.snapshot(autoload=True, n_retains=1)
    resumed.manager.extend(snapshot, trigger=(1, "iteration"))
    resumed.manager.start_extensions()
    assert snapshot.loaded_entry is not None and snapshot.loaded_entry.name == "snapshot_iter_2"
    assert torch.equal(resumed.model.state_dict()[key], clean["models"]["main"][key])
    resumed.train(1)  # retention (n_retains=1) never deletes the on-error snapshot
    resumed.manager.finalize()
    assert (tmp_path / "snapshot_iter_2.on-error").exists()
    assert sorted(snapshots_and_manifests(tmp_path)[0]) == [
        "snapshot_iter_2.on-error", "snapshot_iter_3"]
    assert clean_bytes != (tmp_path / "snapshot_iter_3").read_bytes()


def test_autoload_never_resumes_from_an_on_error_snapshot_alone(tmp_path):
    run = _BatchNormRun(tmp_path, writer=writing.SimpleWriter(out_dir=str(tmp_path)))
    run.manager.extend(ext.snapshot(snapshot_on_error=True), trigger=(100, "iteration"))
    with pytest.raises(RuntimeError, match="loss is nan"):
        run.train(5, fail_at=3)
    run.manager.finalize()
    assert (tmp_path / "snapshot_iter_2.on-error").exists()
    resumed = _BatchNormRun(tmp_path, writer=writing.SimpleWriter(out_dir=str(tmp_path)))
    snapshot = ext.snapshot(autoload=True)
    resumed.manager.extend(snapshot, trigger=(100, "iteration"))
    resumed.manager.start_extensions()
    assert snapshot.loaded_entry is None and resumed.manager.iteration == 0


def test_without_snapshot_on_error_nothing_is_saved(tmp_path):
    run = Run(tmp_path)
    run.manager.extend(ext.snapshot(), trigger=(100, "iteration"))
    with pytest.raises(RuntimeError, match="loss is nan"):
        run.train(5, fail_at=3)
    assert listing(tmp_path) == [".snapkeep"]  # only the store's lock file
    assert listing(tmp_path / ".snapkeep") == []


# -- n_retains -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n_retains", "iterations", "kept"),
    [
        (3, 11, [9, 10, 11]),  # by step: iteration 10 is newer than 9 (not by name order)
        (1, 4, [4]),
        (5, 3, [1, 2, 3]),
        (-1, 4, [1, 2, 3, 4]),
        (0, 3, [1, 2, 3]),
    ],
)
@pytest.mark.parametrize("writer_class", [writing.SimpleWriter, writing.ThreadQueueWriter])
def test_n_retains_keeps_the_newest_by_step(tmp_path, n_retains, iterations, kept, writer_class):
    run = Run(tmp_path, writer=writer_class(out_dir=str(tmp_path)))
    run.manager.extend(ext.snapshot(n_retains=n_retains), trigger=(1, "iteration"))
    run.train(iterations)
    run.manager.finalize()
    assert snapshots_and_manifests(tmp_path) == (
        sorted(f"snapshot_iter_{i}" for i in kept),
        sorted(f"snapshot_iter_{i}.json" for i in kept),
    )


def test_n_retains_leaves_other_files_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "snapshot_iter_x").write_text("not a snapshot name")
    run = Run(tmp_path)
    run.manager.extend(ext.snapshot(n_retains=1), trigger=(1, "iteration"))
    run.train(3)
    assert snapshots_and_manifests(tmp_path)[0] == [
        "notes.txt", "snapshot_iter_3", "snapshot_iter_x"]


# -- autoload --------------------------------------------------------------------------------------
def _saved_run(out: Path, iterations: int = 4) -> Run:
    run = Run(out, seed=0)
    run.manager.extend(ext.snapshot(), trigger=(1, "iteration"))
    run.train(iterations)
    run.manager.finalize()
    return run


def test_autoload_restores_model_optimizer_and_iteration(tmp_path):
    original = _saved_run(tmp_path)
    resumed = Run(tmp_path, seed=1)
    assert not torch.equal(resumed.model.weight, original.model.weight)  # differs before
    assert resumed.optimizer.state_dict()["state"] == {}

    snapshot = ext.snapshot(autoload=True)
    assert snapshot.initialize(resumed.manager) == "snapshot_iter_4"
    assert resumed.manager.iteration == 4
    assert tensors_equal(resumed.model.state_dict(), original.model.state_dict())
    assert tensors_equal(resumed.optimizer.state_dict(), original.optimizer.state_dict())


def test_autoload_through_the_manager_continues_training(tmp_path):
    _saved_run(tmp_path, iterations=3)
    resumed = Run(tmp_path, seed=1)
    resumed.manager.extend(ext.snapshot(autoload=True), trigger=(1, "iteration"))
    assert resumed.manager.iteration == 3  # reading the status initializes the extensions
    resumed.train(2)
    resumed.manager.finalize()
    assert snapshots_and_manifests(tmp_path)[0] == [f"snapshot_iter_{i}" for i in range(1, 6)]


def test_autoload_picks_the_highest_step_not_the_newest_mtime(tmp_path):
    original = _saved_run(tmp_path, iterations=4)
    later = os.path.getmtime(tmp_path / "snapshot_iter_4") + 1000
    os.utime(tmp_path / "snapshot_iter_2", (later, later))
    resumed = Run(tmp_path, seed=1)
    assert ext.snapshot(autoload=True).initialize(resumed.manager) == "snapshot_iter_4"
    assert tensors_equal(resumed.model.state_dict(), original.model.state_dict())


def test_autoload_without_snapshots_returns_none_and_changes_nothing(tmp_path):
    run = Run(tmp_path, seed=3)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert ext.snapshot(autoload=True).initialize(run.manager) is None
    assert run.manager.iteration == 0
    assert tensors_equal(run.model.state_dict(), before)


# -- target ----------------------------------------------------------------------------------------
def test_single_object_target_round_trip(tmp_path):
    run = Run(tmp_path)
    run.manager.extend(ext.snapshot_object(run.model, "model_{.iteration}"),
                       trigger=(1, "iteration"))
    run.train(2)
    saved = torch.load(tmp_path / "model_2", weights_only=True)
    assert tensors_equal(saved, run.model.state_dict())

    torch.manual_seed(5)
    other = torch.nn.Linear(3, 2)
    assert not torch.equal(other.weight, run.model.weight)
    loader = ext.snapshot_object(other, "model_{.iteration}", autoload=True)
    assert loader.initialize(Run(tmp_path, seed=5).manager) == "model_2"
    assert tensors_equal(other.state_dict(), run.model.state_dict())


def test_dict_target_round_trip(tmp_path):
    run = Run(tmp_path)
    target = {"model": run.model, "optimizer": run.optimizer}
    run.manager.extend(ext.snapshot(target=target, filename="pair_{.iteration}"),
                       trigger=(1, "iteration"))
    run.train(2)
    saved = torch.load(tmp_path / "pair_2", weights_only=True)
    assert sorted(saved) == ["model", "optimizer"]

    fresh = Run(tmp_path, seed=9)
    assert not torch.equal(fresh.model.weight, run.model.weight)
    loader = ext.snapshot(target={"model": fresh.model, "optimizer": fresh.optimizer},
                          filename="pair_{.iteration}", autoload=True)
    assert loader.initialize(fresh.manager) == "pair_2"
    assert tensors_equal(fresh.model.state_dict(), run.model.state_dict())
    assert tensors_equal(fresh.optimizer.state_dict(), run.optimizer.state_dict())
    assert fresh.manager.iteration == 0  # only the target was restored, not the manager


# -- bad input: the error names the argument; nothing saved is lost ------------------------------
@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict[str, bytes]]:
    out = tmp_path / "run"
    _saved_run(out, iterations=3)
    return out, contents(out)


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [
        (lambda: ext.snapshot(n_retains="3"), TypeError, r"n_retains must be an int.*'3'"),
        (lambda: ext.snapshot(n_retains=2.0), TypeError, r"n_retains must be an int"),
        (lambda: ext.snapshot(target=object()), TypeError,
         r"target \(object\) has no state_dict"),
        (lambda: ext.snapshot(target={"m": torch.nn.Linear(1, 1), "x": 3}), TypeError,
         r"target\['x'\] \(int\) has no state_dict"),
        (lambda: ext.snapshot_object(object(), "x"), TypeError, r"target \(object\)"),
        (lambda: ext.snapshot(filename=3), TypeError, r"filename must be a format string"),
        (lambda: ext.snapshot(writer="w"), TypeError, r"writer must be a callable"),
    ],
)
def test_bad_arguments_fail_at_construction(saved, build, error, pattern):
    out, before = saved
    with pytest.raises(error, match=pattern):
        build()
    assert contents(out) == before


def test_template_naming_a_missing_attribute_fails_before_training(saved):
    out, before = saved
    run = Run(out, seed=1)
    run.manager.extend(ext.snapshot(filename="{.nonexistent}_{.iteration}", n_retains=1),
                       trigger=(1, "iteration"))
    with pytest.raises(ValueError, match=r"filename template '\{\.nonexistent\}_\{\.iteration\}'"
                                         r".*nonexistent"):
        run.train(1)
    assert contents(out) == before


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file"])
def test_unwritable_out_dir_names_out_dir(saved, where):
    out, before = saved
    victim = out / "snapshot_iter_1"
    bad = victim / "sub" if where == "under-a-file" else victim
    with pytest.raises(SnapshotStorageError, match=rf"output directory '{bad}'") as info:
        Run(bad)
    assert isinstance(info.value, OSError)  # `except OSError` keeps working
    assert contents(out) == before


def test_unwritable_writer_out_dir_fails_before_training(saved):
    out, before = saved
    bad = out / "snapshot_iter_2" / "sub"
    run = Run(out, seed=1)
    run.manager.extend(
        ext.snapshot(writer=writing.SimpleWriter(out_dir=str(bad)), n_retains=1),
        trigger=(1, "iteration"))
    with pytest.raises(SnapshotStorageError, match=rf"output directory '{bad}'"):
        run.train(1)
    assert contents(out) == before


def test_target_without_load_state_dict_is_rejected(saved):
    class SaveOnly:
        def state_dict(self) -> dict[str, int]:
            return {}

    out, before = saved
    with pytest.raises(TypeError, match=r"target \(SaveOnly\) has no load_state_dict"):
        ext.snapshot_object(SaveOnly(), "s_{.iteration}", autoload=True)
    assert contents(out) == before


def test_snapshot_object_beside_an_autoloading_snapshot_continues_the_run(tmp_path, recwarn):
    """ppe's usual pair: snapshot(autoload=True) for the trainer, snapshot_object(model) for the
    weights. After a restart the weights' snapshots belong to the resumed run: no "starts
    fresh" warning, one run id in every manifest, and n_retains deletes the old run's files."""
    import json

    def start() -> Run:
        run = Run(tmp_path, seed=0)
        run.manager.extend(ext.snapshot(autoload=True, n_retains=2), trigger=(2, "iteration"))
        run.manager.extend(ext.snapshot_object(run.model, "model_iter_{.iteration}",
                                               n_retains=2), trigger=(2, "iteration"))
        return run

    first = start()
    first.train(6)
    first.manager.finalize()
    second = start()
    assert second.manager.iteration == 6
    second.train(4)
    second.manager.finalize()
    assert not [w for w in recwarn if "starts fresh" in str(w.message)]
    names = listing(tmp_path)
    assert [n for n in names if n.startswith("model_iter_")] == ["model_iter_10", "model_iter_8"]
    assert [n for n in names if n.startswith("snapshot_iter_")] == \
        ["snapshot_iter_10", "snapshot_iter_8"]
    run_ids = {json.loads((tmp_path / MANIFESTS / f"{n}.json").read_text())["run_id"]
               for n in names if n != MANIFESTS}
    assert len(run_ids) == 1


# -- values autoload could not load ----------------------------------------------------------------
class _Config:
    """An object torch.load(weights_only=True) refuses."""


class _WithConfig:
    def __init__(self) -> None:
        self.config = _Config()

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.config = state["config"]


class _OwnWriter:
    """A writer of the user's (not snapkeep's): it chooses its own format."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, Any]] = []

    def __call__(self, filename: str, out_dir: str, target: Any, *, savefun: Any = None,
                 **kwargs: Any) -> None:
        self.saved.append((filename, target))

    def finalize(self) -> None:
        pass


def test_a_users_writer_chooses_its_format_and_is_never_refused(tmp_path):
    run = Run(tmp_path)
    writer = _OwnWriter()
    run.manager.extend(ext.snapshot_object(_WithConfig(), "cfg_{.iteration}", writer=writer),
                       trigger=(1, "iteration"))
    run.train(2)
    assert [name for name, _ in writer.saved] == ["cfg_1", "cfg_2"]
    assert isinstance(writer.saved[0][1]["config"], _Config)


def test_a_users_savefun_is_never_refused(tmp_path):
    run = Run(tmp_path)
    run.manager.extend(ext.snapshot_object(_WithConfig(), "cfg_{.iteration}", savefun=torch.save),
                       trigger=(1, "iteration"))
    run.train(1)
    assert isinstance(torch.load(tmp_path / "cfg_1", weights_only=False)["config"], _Config)


def test_an_autoloading_snapshot_refuses_a_value_it_could_never_resume_from(tmp_path):
    run = Run(tmp_path)
    run.manager.extend(ext.snapshot_object(_WithConfig(), "cfg_{.iteration}", autoload=True),
                       trigger=(1, "iteration"))
    with pytest.raises(TypeError, match=r"'config'.*weights_only=False"):
        run.train(1)
    assert not list(tmp_path.glob("cfg_*"))


def test_without_autoload_snapkeeps_format_saves_and_warns_once(tmp_path):
    run = Run(tmp_path)
    run.manager.extend(ext.snapshot_object(_WithConfig(), "cfg_{.iteration}"),
                       trigger=(1, "iteration"))
    with pytest.warns(RuntimeWarning, match=r"'config'.*could not resume") as record:
        run.train(2)
    assert len([w for w in record if "could not resume" in str(w.message)]) == 1
    run.manager.finalize()
    assert sorted(p.name for p in tmp_path.glob("cfg_*")) == ["cfg_1", "cfg_2"]
    assert isinstance(torch.load(tmp_path / "cfg_2", weights_only=False)["config"], _Config)
