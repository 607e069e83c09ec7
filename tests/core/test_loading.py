"""Safe loading (a snapshot crafted to run code is refused by default) and the optional
safetensors format (save, detect, load, verify)."""

from __future__ import annotations

import io
import os
import pickle
import re

import pytest
import torch

import snapkeep
import snapkeep.codecs
from snapkeep._core.load.loading import load_file
from snapkeep._core.storage import resolve_storage
from snapkeep.training import ExtensionsManager, extensions


class CodeOnLoad:
    """Unpickling it calls ``os.mkdir(marker)``: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class Box:
    """A snapshot target accepting any state."""

    def __init__(self) -> None:
        self.state: object = {"x": 0}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def _write_evil(directory, name: str, use_torch: bool = True) -> str:
    marker = str(directory / "MARKER")
    payload = {"x": CodeOnLoad(marker), "w": torch.ones(2)}
    path = directory / name
    if use_torch:
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=2)
    return marker


def _manager(out, target, **kwargs):
    model = torch.nn.Linear(1, 1)
    manager = ExtensionsManager(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 1, iters_per_epoch=1,
        writer=snapkeep.writing.SimpleWriter(out_dir=str(out)))
    ext = extensions.snapshot_object(target, "box_{.iteration}", autoload=True, **kwargs)
    manager.extend(ext)
    return manager, ext


@pytest.mark.parametrize("use_torch", [True, False], ids=["torch.save", "raw-pickle"])
def test_code_on_unpickling_is_refused_by_default(tmp_path, use_torch):
    marker = _write_evil(tmp_path, "box_7", use_torch)
    box = Box()
    manager, _ = _manager(tmp_path, box)
    with pytest.raises(snapkeep.UnsafeSnapshotError) as info:
        manager.start_extensions()
    assert "box_7" in str(info.value) and "weights_only=False" in str(info.value)
    assert "mkdir" in str(info.value)  # names the refused global
    assert isinstance(info.value, pickle.UnpicklingError)
    assert not os.path.exists(marker)
    assert box.state == {"x": 0}
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "box_7"]  # nothing deleted
    assert [n for n in os.listdir(tmp_path / ".snapkeep") if not n.endswith(".lock")] == []


def test_explicit_weights_only_false_loads_it(tmp_path):
    marker = _write_evil(tmp_path, "box_7")
    box = Box()
    manager, _ = _manager(tmp_path, box, weights_only=False)
    with pytest.warns(RuntimeWarning, match="no checksum manifest"):
        manager.start_extensions()
    assert os.path.exists(marker)  # the opt-in really unpickles arbitrary objects
    assert torch.equal(box.state["w"], torch.ones(2))


def test_load_file_refuses_and_opts_in(tmp_path):
    marker = _write_evil(tmp_path, "evil")
    storage, _ = resolve_storage(str(tmp_path))
    with pytest.raises(snapkeep.UnsafeSnapshotError):
        load_file(storage, str(tmp_path / "evil"))
    assert not os.path.exists(marker)
    load_file(storage, str(tmp_path / "evil"), weights_only=False)
    assert os.path.exists(marker)


# -- safetensors -------------------------------------------------------------------------------
def _round_trip(tree, **kwargs):
    buffer = io.BytesIO()
    snapkeep.codecs.save_safetensors(tree, buffer, **kwargs)
    return snapkeep.codecs.load_safetensors(buffer.getvalue())


def test_safetensors_round_trip_of_a_nested_tree():
    tree = {
        "model": {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)},
        "ema": {"fc.weight": torch.randn(3, 4).t()},  # non-contiguous
        "step": torch.tensor(7, dtype=torch.int64),
        "half": torch.ones(2, dtype=torch.bfloat16),
        "empty": {},
    }
    loaded = _round_trip(tree)
    assert loaded.keys() == tree.keys()
    assert loaded["empty"] == {}
    for key in ("step", "half"):
        assert torch.equal(loaded[key], tree[key]) and loaded[key].dtype == tree[key].dtype
    for group in ("model", "ema"):
        assert loaded[group].keys() == tree[group].keys()
        for name, value in tree[group].items():
            assert torch.equal(loaded[group][name], value)


def test_safetensors_tied_weights_are_stored():
    shared = torch.randn(4, 4)
    loaded = _round_trip({"encoder": shared, "decoder": shared, "view": shared[1]})
    assert torch.equal(loaded["encoder"], shared) and torch.equal(loaded["decoder"], shared)
    assert torch.equal(loaded["view"], shared[1])


@pytest.mark.parametrize(
    ("tree", "error", "match"),
    [
        ({"a": {"b": torch.ones(1), "lr": 0.1}}, TypeError, "'a/lr' is a float"),
        ({"a": [torch.ones(1)]}, TypeError, "'a' is a list"),
        ({"state": {0: torch.ones(1)}}, TypeError, "key 0 under 'state' is a int"),
        ({"a/b": torch.ones(1)}, ValueError, "contains the separator"),
    ],
    ids=["float-leaf", "list-leaf", "int-key", "separator-in-key"],
)
def test_safetensors_rejects_what_it_cannot_store(tree, error, match):
    with pytest.raises(error, match=match):
        snapkeep.codecs.save_safetensors(tree, io.BytesIO())


def test_safetensors_custom_separator():
    loaded = _round_trip({"a/b": {"c": torch.ones(1)}}, separator="::")
    assert list(loaded) == ["a/b"] and torch.equal(loaded["a/b"]["c"], torch.ones(1))


def test_safetensors_snapshot_autoloads_and_is_verified(tmp_path, capfd):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    writer = snapkeep.writing.SimpleWriter(out_dir=str(tmp_path))
    manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 10,
                                iters_per_epoch=1, writer=writer)
    manager.extend(extensions.snapshot_object(
        model, "model_{.iteration}.safetensors", savefun=snapkeep.codecs.save_safetensors),
        trigger=(1, "iteration"))
    for _ in range(2):
        with manager.run_iteration():
            with torch.no_grad():
                model[0].weight.add_(1.0)
    manager.finalize()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    data = (tmp_path / "model_2.safetensors").read_bytes()
    from safetensors.torch import load

    assert set(load(data)) == set(expected)  # a plain safetensors file other tools can read

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert not torch.equal(fresh[0].weight, expected["0.weight"])  # differs before loading
    manager = ExtensionsManager(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), 10,
                                iters_per_epoch=1,
                                writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    ext = extensions.snapshot_object(fresh, "model_{.iteration}.safetensors", autoload=True)
    manager.extend(ext)
    manager.start_extensions()
    assert ext.loaded_entry.name == "model_2.safetensors"
    for key, value in expected.items():
        assert torch.equal(fresh.state_dict()[key], value)

    # a flipped byte is caught by the checksum and the older snapshot is used
    path = tmp_path / "model_2.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    again = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    manager = ExtensionsManager(again, torch.optim.SGD(again.parameters(), lr=0.1), 10,
                                iters_per_epoch=1,
                                writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    ext = extensions.snapshot_object(again, "model_{.iteration}.safetensors", autoload=True)
    manager.extend(ext)
    capfd.readouterr()
    manager.start_extensions()
    notice = capfd.readouterr().err  # autoload's resume notice names what it skipped and why
    assert re.search(r"snapkeep: skipped model_2\.safetensors \(step 2\): .*checksum", notice)
    assert ext.loaded_entry.name == "model_1.safetensors"
