"""Incremental snapshots (``Checkpointer(incremental=True)``, ``extensions.snapshot(incremental=
True)``): unchanged storages are stored once as blobs, every snapshot loads alone and verified,
retention and the sweep delete only unreferenced blobs, a bare ``torch.load`` refuses."""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest
import torch
from click.testing import CliRunner

from snapkeep import Checkpointer
from snapkeep._core.tiers.blobs import BLOB_NAME
from snapkeep._core.tiers.incremental import BARE_LOAD_MESSAGE
from snapkeep.cli import cli
from snapkeep.errors import IncrementalSnapshotError
from snapkeep.loading import load_latest
from snapkeep.writing import SimpleWriter

MIB = 1 << 20


class Net(torch.nn.Module):
    """A frozen 'backbone' of two 1 MiB layers (one with a tied twin, one zero buffer pair of
    equal content) and a small trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(512, 512, bias=False)  # 1 MiB
        self.other = torch.nn.Linear(512, 512, bias=False)
        self.head = torch.nn.Linear(512, 4)
        self.register_buffer("zeros_a", torch.zeros(256, 1024))  # equal bytes, distinct
        self.register_buffer("zeros_b", torch.zeros(256, 1024))
        for p in (*self.backbone.parameters(), *self.other.parameters()):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.other(self.backbone(x)))


def make(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    return net, torch.optim.AdamW(net.head.parameters(), lr=1e-2)


def train(net: Net, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        net(torch.randn(4, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def blobs(directory: pathlib.Path) -> set[str]:
    area = directory / ".snapkeep" / "blobs"
    return {p.name for p in area.glob("*/*") if BLOB_NAME.fullmatch(p.name)}


def manifest_blobs(directory: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for path in (directory / ".snapkeep").glob("*.json"):
        found |= set(json.loads(path.read_text()).get("blobs", {}))
    return found


def test_unchanged_storages_are_written_once_and_each_snapshot_loads_alone(
        tmp_path: pathlib.Path) -> None:
    net, opt = make()
    records = []
    with Checkpointer(tmp_path, keep=2, incremental=True) as ckpt:
        for step in range(1, 5):
            train(net, opt)
            records.append(ckpt.save(step, {"model": net, "optim": opt}).wait())
            if step == 2:
                stats = ckpt.writer._saver.last_stage_stats  # type: ignore[union-attr]
    # the first save writes the frozen storages (backbone, other, one zeros content) once
    assert records[0].blob_bytes == 3 * MIB
    assert [r.blob_bytes for r in records[1:]] == [0, 0, 0]
    # the unchanged ones were not even staged: only the head, its AdamW state, small values
    assert stats is not None and stats.tensor_bytes < MIB
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "ckpt_3", "ckpt_4"]
    assert blobs(tmp_path) == manifest_blobs(tmp_path) and len(blobs(tmp_path)) == 3
    reference = {k: v.clone() for k, v in net.state_dict().items()}
    # each remaining snapshot loads alone, verified (the older one too)
    for step in (3, 4):
        fresh, fresh_opt = make(seed=1)
        with Checkpointer(tmp_path, incremental=True) as ckpt:
            assert ckpt.load({"model": fresh, "optim": fresh_opt}, step=step) == step
        if step == 4:
            for key, value in reference.items():
                assert torch.equal(fresh.state_dict()[key], value), key
            assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                               opt.state_dict()["state"][0]["exp_avg"])
    result = CliRunner().invoke(cli, ["verify", str(tmp_path), "--template", "ckpt_{step}"])
    assert result.exit_code == 0, result.output


def test_storage_sharing_is_kept_and_equal_bytes_stay_distinct(tmp_path: pathlib.Path) -> None:
    base = torch.arange(MIB // 4, dtype=torch.float32)
    tree = {"a": base, "view": base[10:20], "z1": torch.zeros(MIB // 4),
            "z2": torch.zeros(MIB // 4)}
    with Checkpointer(tmp_path, incremental=True, rng=False) as ckpt:
        ckpt.save(1, {"t": _Holder(tree)}).wait()
    assert len(blobs(tmp_path)) == 2  # arange, zeros (stored once for both)
    loaded = load_latest(tmp_path, template="ckpt_{step}")["state"]["t"]
    assert loaded["view"].untyped_storage().data_ptr() == loaded["a"].untyped_storage().data_ptr()
    assert loaded["z1"].untyped_storage().data_ptr() != loaded["z2"].untyped_storage().data_ptr()
    assert torch.equal(loaded["view"], base[10:20]) and torch.equal(loaded["a"], base)


class _Holder:
    """A stateful holding a plain tree of tensors."""

    def __init__(self, tree: dict[str, torch.Tensor]) -> None:
        self.tree = tree

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tree

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tree = dict(state)


def test_bare_torch_load_refuses_and_convert_writes_a_plain_file(tmp_path: pathlib.Path) -> None:
    net, opt = make()
    with Checkpointer(tmp_path, incremental=True) as ckpt:
        ckpt.save(1, {"model": net, "optim": opt}).wait()
    path = tmp_path / "ckpt_1"
    with pytest.raises(Exception, match="open_incremental_snapshot"):
        torch.load(path)  # weights_only=True: torch refuses the global
    with pytest.raises(IncrementalSnapshotError, match="snapkeep convert") as raised:
        torch.load(path, weights_only=False)
    assert str(raised.value) == BARE_LOAD_MESSAGE
    out = tmp_path / "plain.pt"
    result = CliRunner().invoke(cli, ["convert", str(path), str(out)])
    assert result.exit_code == 0, result.output
    plain = torch.load(out, weights_only=True)
    assert torch.equal(plain["state"]["model"]["backbone.weight"], net.backbone.weight)


def test_a_corrupt_blob_skips_its_snapshots_and_verify_names_it(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    net, opt = make()
    with Checkpointer(tmp_path, incremental=True, writer=SimpleWriter()) as ckpt:
        ckpt.save(1, {"model": net, "optim": opt})
        first = blobs(tmp_path)
        train(net, opt)
        with torch.no_grad():
            net.other.weight.mul_(2)  # a new blob for step 2 only
        ckpt.save(2, {"model": net, "optim": opt})
    new = blobs(tmp_path) - first
    assert len(new) == 1
    blob = next((tmp_path / ".snapkeep" / "blobs").glob(f"*/{new.pop()}"))
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["verify", str(tmp_path), "--template", "ckpt_{step}"])
    assert result.exit_code != 0 and "hash to" in result.output
    assert re.search(rf"BAD BLOB +\S*{blob.name}: its bytes hash to \w+, not to its name "
                     r".*; referred to by 1 snapshot: ckpt_2 \(", result.output), result.output
    result = CliRunner().invoke(cli, ["verify", str(tmp_path), "--template", "ckpt_{step}",
                                      "--json"])
    report = json.loads(result.output)
    assert [(b["digest"], b["snapshots"]) for b in report["bad_blobs"]] == \
        [(blob.name, ["ckpt_2"])]
    fresh, fresh_opt = make(seed=1)
    capsys.readouterr()
    with Checkpointer(tmp_path, incremental=True) as ckpt:
        assert ckpt.load({"model": fresh, "optim": fresh_opt}) == 1
    assert "skipped ckpt_2 (step 2): blob" in capsys.readouterr().err


def test_a_write_behind_the_version_counter_drops_the_snapshot(tmp_path: pathlib.Path) -> None:
    net, opt = make()
    with Checkpointer(tmp_path, incremental=True, writer=SimpleWriter()) as ckpt:
        ckpt.save(1, {"model": net, "optim": opt})
        net.other.weight.data.add_(1)  # .data: the counter does not move
        with pytest.raises(Exception, match="without its version counter moving"):
            ckpt.save(2, {"model": net, "optim": opt})
        ckpt.save(3, {"model": net, "optim": opt})  # the tracker forgot it: written in full
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == \
        ["ckpt_1", "ckpt_3"]
    fresh, fresh_opt = make(seed=1)
    with Checkpointer(tmp_path, incremental=True) as ckpt:
        assert ckpt.load({"model": fresh, "optim": fresh_opt}) == 3
    assert torch.equal(fresh.other.weight, net.other.weight)


def test_the_sweep_removes_only_unreferenced_blobs(tmp_path: pathlib.Path) -> None:
    net, opt = make()
    with Checkpointer(tmp_path, incremental=True, writer=SimpleWriter()) as ckpt:
        ckpt.save(1, {"model": net, "optim": opt})
    area = next((tmp_path / ".snapkeep" / "blobs").iterdir())
    orphan = area / ("0" * 32)  # a save killed after its blob, before its snapshot
    orphan.write_bytes(b"x")
    # a kill between a snapshot and its manifest: its blobs are read from the file itself
    (tmp_path / ".snapkeep" / "ckpt_1.json").unlink()
    before = blobs(tmp_path)
    with pytest.warns(RuntimeWarning, match="no checksum manifest"), \
            Checkpointer(tmp_path, incremental=True) as ckpt:
        fresh, fresh_opt = make(seed=1)
        assert ckpt.load({"model": fresh, "optim": fresh_opt}) == 1
    assert blobs(tmp_path) == before - {orphan.name}


def test_the_snapshot_extension_writes_incremental_snapshots(tmp_path: pathlib.Path) -> None:
    from snapkeep import training
    from snapkeep.training import extensions

    def run(iterations: int) -> tuple[Net, torch.optim.Optimizer]:
        net, opt = make()
        manager = training.ExtensionsManager(
            {"main": net}, {"main": opt}, max_epochs=1, iters_per_epoch=iterations,
            out_dir=str(tmp_path))
        manager.extend(extensions.snapshot(incremental=True, autoload=True, n_retains=1),
                       trigger=(2, "iteration"))
        while not manager.stop_trigger:
            with manager.run_iteration():
                train(net, opt)
        manager.writer.finalize()
        return net, opt

    net, _ = run(4)
    assert len(blobs(tmp_path)) == 3 and blobs(tmp_path) == manifest_blobs(tmp_path)
    assert os.path.exists(tmp_path / "snapshot_iter_4")
    resumed, _ = run(6)
    assert blobs(tmp_path) == manifest_blobs(tmp_path)
    assert torch.equal(resumed.backbone.weight, net.backbone.weight)


def test_no_blob_is_deleted_while_another_save_is_in_flight(tmp_path: pathlib.Path) -> None:
    from snapkeep.store import open_store, step_template
    from snapkeep.tiers import IncrementalTracker

    net, opt = make()
    state = {"model": net, "optim": opt}
    with Checkpointer(tmp_path, keep=1, incremental=True, writer=SimpleWriter()) as ckpt:
        ckpt.save(1, state)
        first = blobs(tmp_path)
        with torch.no_grad():
            net.other.weight.mul_(2)
        # another save of this process is in flight (planned, not committed): it may refer to
        # any blob, so retention after step 2 deletes ckpt_1 but none of its blobs yet
        store = open_store(str(tmp_path), step_template("ckpt_{step}"))
        other = IncrementalTracker.for_store(store)
        _, in_flight = other.plan({"t": torch.zeros(1)})
        ckpt.save(2, state)
        assert sorted(os.listdir(tmp_path)) == [".snapkeep", "ckpt_2"]
        assert first <= blobs(tmp_path) and len(blobs(tmp_path) - first) == 1
        in_flight.finish(None)
        ckpt.save(3, state)  # the next pass collects the blob only ckpt_1 used
    assert blobs(tmp_path) == manifest_blobs(tmp_path) and len(blobs(tmp_path)) == 3


def test_prune_deletes_the_blobs_no_snapshot_left_refers_to(tmp_path: pathlib.Path) -> None:
    net, opt = make()
    with Checkpointer(tmp_path, incremental=True, writer=SimpleWriter()) as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                net.other.weight.add_(1)  # a new 1 MiB blob per snapshot
            ckpt.save(step, {"model": net, "optim": opt})
    assert len(blobs(tmp_path)) == 5
    result = CliRunner().invoke(cli, ["prune", str(tmp_path), "--template", "ckpt_{step}",
                                      "--keep-latest", "1", "--yes"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [".snapkeep", "ckpt_3"]
    assert blobs(tmp_path) == manifest_blobs(tmp_path) and len(blobs(tmp_path)) == 3
    result = CliRunner().invoke(cli, ["verify", str(tmp_path), "--template", "ckpt_{step}"])
    assert result.exit_code == 0, result.output


def _damage(blob: pathlib.Path, how: str) -> None:
    """Other bytes of the same size: written in place, or a new file renamed over it."""
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    if how == "in-place":
        with open(blob, "r+b") as f:
            f.write(bytes(data))
    else:
        other = blob.with_name("replacement")
        other.write_bytes(bytes(data))
        os.replace(other, blob)


def _backbone_blob(directory: pathlib.Path, net: Net) -> pathlib.Path:
    from snapkeep._core.format.checksum import new_hasher

    hasher = new_hasher()
    hasher.update(net.backbone.weight.detach().numpy().tobytes())
    return next((directory / ".snapkeep" / "blobs").glob(f"*/{hasher.hexdigest()}"))


@pytest.mark.parametrize("how", ["in-place", "replaced"])
def test_a_damaged_blob_is_written_again_by_the_next_save_that_refers_to_it(
        tmp_path: pathlib.Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """Steps 1, 2 saved; the frozen backbone's blob gets other bytes of the same size; the same
    process saves 3 and 4: the blob is checked (not only its size), found damaged and written
    again from the live bytes, so a restart resumes from step 4 (and steps 1, 2 load again).
    (Before: BlobArea.has checked the size only; every later snapshot referred to the bad blob
    and the restart raised NoValidSnapshotError.)"""
    net, opt = make()
    with Checkpointer(tmp_path, incremental=True) as ckpt:
        for step in (1, 2):
            train(net, opt)
            ckpt.save(step, {"model": net, "optim": opt}).wait()
        blob = _backbone_blob(tmp_path, net)
        good = blob.read_bytes()
        _damage(blob, how)
        assert blob.read_bytes() != good and blob.stat().st_size == len(good)
        for step in (3, 4):
            train(net, opt)
            ckpt.save(step, {"model": net, "optim": opt}).wait()
    assert blob.read_bytes() == good
    assert "written again from the live bytes" in caplog.text
    result = CliRunner().invoke(cli, ["verify", str(tmp_path), "--template", "ckpt_{step}"])
    assert result.exit_code == 0, result.output
    for step in (4, 1):
        fresh, fresh_opt = make(seed=1)
        with Checkpointer(tmp_path, incremental=True) as ckpt:
            assert ckpt.load({"model": fresh, "optim": fresh_opt}, step=step) == step
    assert torch.equal(fresh.backbone.weight, net.backbone.weight)


def test_a_resumed_run_checks_the_blobs_it_did_not_load(tmp_path: pathlib.Path) -> None:
    """A resumed process's first save refers to blobs it finds there (hashed, not written):
    a blob it did not read at the resume and whose bytes are wrong is written again, not
    trusted by its size. (Before: the size matched, the blob was kept.)"""
    net, opt = make()
    with Checkpointer(tmp_path, incremental=True) as ckpt:
        ckpt.save(1, {"model": net, "optim": opt}).wait()
    blob = _backbone_blob(tmp_path, net)
    good = blob.read_bytes()
    _damage(blob, "replaced")
    with Checkpointer(tmp_path, incremental=True) as ckpt:  # no load: a fresh start's save
        ckpt.save(2, {"model": net, "optim": opt}).wait()
    assert blob.read_bytes() == good
    fresh, fresh_opt = make(seed=1)
    with Checkpointer(tmp_path, incremental=True) as ckpt:
        assert ckpt.load({"model": fresh, "optim": fresh_opt}) == 2
    assert torch.equal(fresh.backbone.weight, net.backbone.weight)
