"""The plug-in path: snapkeep's writers under ppe's snapshot extension, snapkeep's snapshot
extension under ppe's manager (ppe 0.9.0, installed by the dev extras)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

ppe = pytest.importorskip("pytorch_pfn_extras")

import snapkeep  # noqa: E402
from snapkeep.training import extensions as sk_extensions  # noqa: E402

WRITERS = ["SimpleWriter", "ThreadWriter", "ThreadQueueWriter"]


def _train(out: pathlib.Path, *, until: int, writer: object | None, ext: object,
           model: torch.nn.Module | None = None) -> tuple[object, torch.nn.Module]:
    model = model or torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"writer": writer} if writer is not None else {"out_dir": str(out)}
    manager = ppe.training.ExtensionsManager(model, optimizer, 4, iters_per_epoch=3, **kwargs)
    manager.extend(ext)
    x = torch.arange(6.0).reshape(2, 3)
    while not manager.stop_trigger:
        with manager.run_iteration(step_optimizers=["main"]):
            model(x).sum().backward()
        if manager.iteration >= until:
            break
    manager.finalize()
    return manager, model


def _names(out: pathlib.Path) -> tuple[list[str], list[str]]:
    return (sorted(n for n in os.listdir(out) if n != ".snapkeep"),
            sorted(n for n in os.listdir(out / ".snapkeep") if not n.endswith(".lock")))


@pytest.mark.parametrize("writer_name", WRITERS)
def test_ppe_snapshot_with_snapkeep_writer_autoloads_and_retains(tmp_path, writer_name):
    cls = getattr(snapkeep.writing, writer_name)
    w = cls(out_dir=str(tmp_path))
    ext = ppe.training.extensions.snapshot(writer=w, autoload=True, n_retains=2)
    _train(tmp_path, until=9, writer=w, ext=ext)
    assert _names(tmp_path) == (["snapshot_iter_6", "snapshot_iter_9"],
                                ["snapshot_iter_6.json", "snapshot_iter_9.json"])
    w2 = cls(out_dir=str(tmp_path))
    ext2 = ppe.training.extensions.snapshot(writer=w2, autoload=True, n_retains=2)
    manager, _ = _train(tmp_path, until=100, writer=w2, ext=ext2)
    assert manager.iteration == 12
    assert _names(tmp_path) == (["snapshot_iter_12", "snapshot_iter_9"],
                                ["snapshot_iter_12.json", "snapshot_iter_9.json"])


def test_ppe_autoload_refuses_a_corrupt_snapshot(tmp_path):
    w = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    _train(tmp_path, until=6, writer=w,
           ext=ppe.training.extensions.snapshot(writer=w, autoload=True))
    newest = tmp_path / "snapshot_iter_6"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    w2 = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    with pytest.raises(snapkeep.SnapshotCorruptError, match="snapshot_iter_6"):
        _train(tmp_path, until=9, writer=w2,
               ext=ppe.training.extensions.snapshot(writer=w2, autoload=True))


def test_writer_fs_hides_temps_and_manifests(tmp_path):
    w = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    w("snap_1", "", {"a": 1})
    (tmp_path / "snap_2.snapkeep-tmp.x").write_bytes(b"partial")
    assert sorted(w.fs.list(str(tmp_path), recursive=True)) == ["snap_1"]
    assert w.fs.stat(str(tmp_path / "snap_1")).size == (tmp_path / "snap_1").stat().st_size
    with w.fs.open(str(tmp_path / "snap_1"), "rb") as f:
        assert torch.load(f, weights_only=True) == {"a": 1}
    with pytest.raises(ValueError, match="mode"):
        w.fs.open(str(tmp_path / "snap_1"), "wb")
    w.fs.remove(str(tmp_path / "snap_1"))
    w.fs.remove(str(tmp_path / "snap_1"))  # already gone: not an error
    assert not (tmp_path / ".snapkeep" / "snap_1.json").exists()
    assert not w.fs.exists(str(tmp_path / "snap_1"))
    w.finalize()
    (tmp_path / "snap_2.snapkeep-tmp.x").unlink()  # the fake temp file made above


def test_snapkeep_extension_is_a_ppe_extension_inside_ppe_manager(tmp_path):
    ext = sk_extensions.snapshot(autoload=True, n_retains=2)
    assert isinstance(ext, ppe.training.Extension)
    assert type(ext).__name__ == "_Snapshot"
    manager, _ = _train(tmp_path, until=6, writer=None, ext=ext)
    entry = manager._extensions["_Snapshot"]
    assert entry.extension is ext  # not wrapped: needs_model_state and state_dict kept
    assert entry.priority == ppe.training.extension.PRIORITY_SNAPSHOT
    assert _names(tmp_path)[0] == ["snapshot_iter_3", "snapshot_iter_6"]
    manager2, _ = _train(tmp_path, until=100, writer=None,
                         ext=sk_extensions.snapshot(autoload=True, n_retains=2))
    assert manager2.iteration == 12
    assert _names(tmp_path) == (["snapshot_iter_12", "snapshot_iter_9"],
                                ["snapshot_iter_12.json", "snapshot_iter_9.json"])


def test_ppe_manager_loads_a_snapkeep_managers_snapshot(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = snapkeep.training.ExtensionsManager(
        model, optimizer, 2, iters_per_epoch=3,
        writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(sk_extensions.snapshot())
    x = torch.arange(6.0).reshape(2, 3)
    while not manager.stop_trigger:
        with manager.run_iteration(step_optimizers=["main"]):
            model(x).sum().backward()
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "snapshot_iter_3", "snapshot_iter_6"]

    fresh = torch.nn.Linear(3, 1)
    assert not torch.equal(fresh.weight, model.weight)  # differs before the load
    ppe_manager = ppe.training.ExtensionsManager(
        fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), 4, iters_per_epoch=3,
        writer=ppe.writing.SimpleWriter(out_dir=str(tmp_path)))
    ppe_manager.extend(ppe.training.extensions.snapshot(autoload=True))
    # ppe_version holds snapkeep's version: ppe's manager says so, and loads it
    with pytest.warns(UserWarning, match="Snapshot taken with PPE " + snapkeep.__version__):
        assert ppe_manager.iteration == 6
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    ppe_manager.finalize()


def test_max_epochs_zero_manager_only_loads_like_ppes(tmp_path):
    w = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    _train(tmp_path, until=6, writer=w,
           ext=ppe.training.extensions.snapshot(writer=w, autoload=True))
    model = torch.nn.Linear(3, 1)
    manager = snapkeep.training.ExtensionsManager(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 0, iters_per_epoch=3,
        writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(sk_extensions.snapshot(autoload=True))
    assert manager.stop_trigger  # nothing to train
    assert manager.iteration == 6  # but the snapshot was loaded
    manager.finalize()


def test_ppe_extension_state_travels_under_snapkeeps_manager(tmp_path):
    def build():
        model = torch.nn.Linear(3, 1)
        manager = snapkeep.training.ExtensionsManager(
            model, torch.optim.SGD(model.parameters(), lr=0.1), 1, iters_per_epoch=4,
            writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
        log = ppe.training.extensions.LogReport(trigger=(1, "iteration"))
        manager.extend(log, name="log")
        return manager, log

    manager, log = build()
    for value in (1.0, 2.0):
        with manager.run_iteration():
            snapkeep.report({"loss": value})
    state = manager.state_dict()
    resumed, resumed_log = build()
    assert resumed_log.log == []  # differs before the load
    resumed.load_state_dict(state)
    assert [e["loss"] for e in resumed_log.log] == [1.0, 2.0] == [e["loss"] for e in log.log]
    manager.finalize()
    resumed.finalize()


def test_snapkeep_snapshot_on_error_under_ppe_manager(tmp_path):
    model = torch.nn.Linear(3, 1)
    manager = ppe.training.ExtensionsManager(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 4, iters_per_epoch=3,
        out_dir=str(tmp_path))
    manager.extend(sk_extensions.snapshot(
        writer=snapkeep.writing.ThreadWriter(out_dir=str(tmp_path)), snapshot_on_error=True))
    with manager.run_iteration():
        pass
    with pytest.raises(ZeroDivisionError):
        with manager.run_iteration():
            1 / 0  # noqa: B018
    # ppe's manager ran on_error: the mid-iteration snapshot is committed (waited for) under
    # its own on-error name, never under the clean snapshot's name
    assert _names(tmp_path) == (["snapshot_iter_1.on-error"], ["snapshot_iter_1.on-error.json"])
    manager.finalize()


def test_a_writers_fs_passed_on_is_the_storage_itself(tmp_path):
    from snapkeep.training.extensions._snapshot import _find_snapshot_files

    first = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    second = snapkeep.writing.SimpleWriter(fs=first.fs, out_dir=str(tmp_path))
    second("snapshot_iter_3", "", {"a": 1})
    assert second.storage_for()[0].is_local  # not a pfio-style wrapper around the view
    assert [name for _, name in _find_snapshot_files(
        "snapshot_iter_{.iteration}", str(tmp_path), first.fs)] == ["snapshot_iter_3"]
    second.finalize()


def test_listing_for_a_writer_without_out_dir_warns(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snapshot_iter_1").write_bytes(b"x")
    w = snapkeep.writing.SimpleWriter()
    with caplog.at_level("WARNING", logger="snapkeep.writing._ppe_fs"):
        assert list(w.fs.list(w.out_dir, recursive=True)) == ["snapshot_iter_1"]
    assert "create the writer with out_dir=" in caplog.text
    w.finalize()


def test_ppe_snapshot_with_snapkeep_writer_on_an_fsspec_url(tmp_path):
    out = f"memory://plugin-{tmp_path.name}"
    w = snapkeep.writing.ThreadWriter(out_dir=out)
    _train(tmp_path, until=9, writer=w,
           ext=ppe.training.extensions.snapshot(writer=w, autoload=True, n_retains=2))
    assert sorted(w.fs.list(out)) == ["snapshot_iter_6", "snapshot_iter_9"]
    assert w.fs.stat(out + "/snapshot_iter_9").last_modified > 0
    w2 = snapkeep.writing.ThreadWriter(out_dir=out)
    manager, _ = _train(tmp_path, until=100, writer=w2,
                        ext=ppe.training.extensions.snapshot(writer=w2, autoload=True,
                                                             n_retains=2))
    assert manager.iteration == 12
    assert sorted(w2.fs.list(out)) == ["snapshot_iter_12", "snapshot_iter_9"]
    assert sorted(w2.fs.list(out + "/.snapkeep")) == ["snapshot_iter_12.json",
                                                      "snapshot_iter_9.json"]
    for name in list(w2.fs.list(out, recursive=True)):
        if not w2.fs.isdir(f"{out}/{name}"):
            w2.fs.remove(f"{out}/{name}")


def test_overlap_under_ppe_manager_is_validated_at_the_step(tmp_path):
    """ppe's run_iteration has no end hook: the verdict comes from the step pre-hook (or the
    next snapshot, or finalize). A hand edit between a snapshot and the step drops it."""
    model = torch.nn.Linear(512, 512, bias=False)  # a 1 MiB weight: staged in the background
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = snapkeep.writing.ThreadWriter(out_dir=str(tmp_path))
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=4,
                                             writer=writer)
    ext = sk_extensions.snapshot(filename="snap_{.iteration}")
    manager.extend(ext, trigger=(1, "iteration"))
    x = torch.ones(2, 512)
    with pytest.warns(RuntimeWarning, match="'models/main/weight'.*dropped"):
        while not manager.stop_trigger:
            with manager.run_iteration(step_optimizers=["main"]):
                model(x).sum().backward()
                if manager.iteration == 2:  # snapshot 2 was taken; its step is next
                    with torch.no_grad():
                        model.weight.add_(1.0)
    manager.finalize()
    assert not ext._overlap_on  # snapshots 3 and 4 were copied in the call
    assert _names(tmp_path)[0] == ["snap_1", "snap_3", "snap_4"]
    saved = torch.load(tmp_path / "snap_4", weights_only=True)
    assert torch.equal(saved["models"]["main"]["weight"], model.weight)
