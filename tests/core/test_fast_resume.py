"""Resume at disk speed: local snapshots are verified by hashing the memory-mapped file and
loaded through ``torch.load(mmap=True)`` (safetensors: its own mapping) into the existing
parameters and optimizer state; corrupt bytes are still never loaded."""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch

import snapkeep.codecs
from snapkeep._core.format.checksum import digest_file, digest_stream
from snapkeep._core.load.loading import into_existing_state, load_file, optimizers_in
from snapkeep._core.storage import resolve_storage
from snapkeep.training import ExtensionsManager, extensions
from snapkeep.writing import SimpleWriter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/maps")


def _mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 10_000, 3 * 4096 + 7])
@pytest.mark.parametrize("chunk_bytes", [4096, 8192, 1 << 26])
def test_digest_file_equals_the_streamed_digest(tmp_path, size, chunk_bytes):
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert digest_file(path, chunk_bytes=chunk_bytes) == digest_stream(io.BytesIO(data))
    assert digest_file(path, chunk_bytes=chunk_bytes)[1] == size


def test_digest_file_sees_a_flipped_byte(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(20_000))
    clean = digest_file(path, chunk_bytes=4096)
    with open(path, "r+b") as f:
        f.seek(12_345)
        f.write(b"\x01")
    assert digest_file(path, chunk_bytes=4096)[0] != clean[0]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_digest_file_rejects_a_bad_chunk_size(tmp_path, bad):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        digest_file(tmp_path / "f", chunk_bytes=bad)


@linux_only
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_local_files_load_as_views_of_the_mapped_file(tmp_path, fmt):
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": {"x": torch.ones(3)}}
    path = str(tmp_path / "snap")
    with open(path, "wb") as f:
        if fmt == "torch":
            torch.save(state, f)
        else:
            snapkeep.codecs.save_safetensors(state, f)
    assert path not in _mapped_paths()
    storage, _ = resolve_storage(str(tmp_path))
    loaded = load_file(storage, path)
    assert path in _mapped_paths()  # the tensors are views of the file, not a read copy
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"]["x"], state["b"]["x"])
    loaded["w"].add_(1)  # copy-on-write: the file keeps its bytes
    assert torch.equal(load_file(storage, path)["w"], state["w"])


def test_legacy_format_loads_without_mmap(tmp_path):
    path = str(tmp_path / "legacy")
    torch.save({"w": torch.ones(5)}, path, _use_new_zipfile_serialization=False)
    storage, _ = resolve_storage(str(tmp_path))
    assert torch.equal(load_file(storage, path)["w"], torch.ones(5))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def test_into_existing_state_copies_into_the_optimizers_own_tensors():
    source_model, source = _trained(0)
    model, optimizer = _trained(1)
    before = {id(p): {k: v for k, v in s.items()} for p, s in optimizer.state.items()}
    assert not torch.equal(next(iter(optimizer.state.values()))["exp_avg"],
                           next(iter(source.state.values()))["exp_avg"])
    with into_existing_state(optimizers_in({"opt": optimizer, "model": model})):
        optimizer.load_state_dict(source.state_dict())
    for (param, state), src in zip(optimizer.state.items(), source.state.values()):
        for key, value in state.items():
            assert value is before[id(param)][key]  # the same tensor object, new values
            assert torch.equal(value, src[key])


def test_into_existing_state_adopts_state_a_fresh_optimizer_lacks():
    _, source = _trained(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    with into_existing_state([optimizer]):
        optimizer.load_state_dict(source.state_dict())
    for state, src in zip(optimizer.state.values(), source.state.values()):
        assert all(torch.equal(state[k], src[k]) for k in src)


def _run(out, model, optimizer, *, autoload):
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=3,
                                writer=SimpleWriter(out_dir=str(out)))
    manager.extend(extensions.snapshot(autoload=autoload), trigger=(3, "iteration"))
    return manager


def test_autoload_restores_into_the_trainers_existing_tensors(tmp_path):
    model, optimizer = _trained(0)
    manager = _run(tmp_path, model, optimizer, autoload=False)
    while not manager.stop_trigger:
        with manager.run_iteration(step_optimizers=["main"]):
            model(torch.randn(4, 8)).pow(2).sum().backward()
    manager.finalize()
    saved = torch.load(tmp_path / "snapshot_iter_3", weights_only=True)

    model2, optimizer2 = _trained(1)
    params = [p for p in model2.parameters()]
    states = {id(p): dict(s) for p, s in optimizer2.state.items()}
    manager2 = _run(tmp_path, model2, optimizer2, autoload=True)
    with manager2.run_iteration():
        pass  # initialize: autoload
    assert [p for p in model2.parameters()] == params
    for key, value in saved["models"]["main"].items():
        assert torch.equal(model2.state_dict()[key], value)
    for index, (param, state) in enumerate(optimizer2.state.items()):
        for key, value in state.items():
            assert value is states[id(param)][key]
            assert torch.equal(value, saved["optimizers"]["main"]["state"][index][key])
    manager2.finalize()
