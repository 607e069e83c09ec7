"""Staging: a consistent CPU copy of a state tree into buffers reused across snapshots."""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch

from snapkeep._core.save.host_memory import HeapAllocator
from snapkeep._core.save.shm import ArenaReader, SharedArena
from snapkeep._core.save.staging import BufferSet

Pair = collections.namedtuple("Pair", "a b")


def _tree() -> dict[str, Any]:
    weight = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
    sd: Any = collections.OrderedDict(
        [("emb.weight", weight.detach()), ("out.weight", weight.detach())])
    sd._metadata = {"": {"version": 1}}
    return {
        "model": sd,  # tied: two keys, one storage
        "param": weight,
        "view": weight.detach()[1],  # a row: storage offset 4
        "t_view": weight.detach().t(),  # non-contiguous strides
        "ints": torch.arange(5, dtype=torch.int64),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "flags": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "grad": torch.ones(2, requires_grad=True),
        "pair": Pair(torch.ones(2), [1, 2]),
        "tuple": (torch.zeros(2), "x"),
        "meta": {"history": [1, 2], "name": "run"},
    }


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _unique_bytes(tree: Any) -> int:
    seen: dict[int, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            seen[_ptr(node)] = node.untyped_storage().nbytes()
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(tree)
    return sum(seen.values())


def test_staged_copy_keeps_values_structure_and_sharing() -> None:
    tree = _tree()
    reference = copy.deepcopy(tree)
    staged, stats = BufferSet().stage(tree)

    with torch.no_grad():  # mutate every source in place, and the containers
        tree["param"].add_(100)
        tree["ints"].add_(100)
        tree["grad"].add_(100)
        tree["pair"].a.add_(100)
    tree["meta"]["history"].append(3)
    tree["pair"].b.append(3)
    assert not torch.equal(tree["param"], reference["param"])  # differs before ...

    assert torch.equal(staged["param"], reference["param"])  # ... not in the staged copy
    assert torch.equal(staged["model"]["emb.weight"], reference["model"]["emb.weight"])
    assert torch.equal(staged["view"], reference["view"])
    assert torch.equal(staged["t_view"], reference["t_view"])
    assert staged["t_view"].stride() == (1, 4)
    assert torch.equal(staged["ints"], reference["ints"])
    assert staged["half"].dtype == torch.bfloat16 and staged["flags"].dtype == torch.bool
    assert staged["scalar"].item() == 3.5 and staged["empty"].shape == (0, 7)
    assert torch.equal(staged["grad"], reference["grad"]) and staged["grad"].requires_grad
    assert isinstance(staged["param"], torch.nn.Parameter) and staged["param"].requires_grad
    assert type(staged["pair"]).__name__ == "Pair" and staged["pair"].b == [1, 2]
    assert staged["tuple"][1] == "x" and isinstance(staged["tuple"], tuple)
    assert staged["meta"] == {"history": [1, 2], "name": "run"}
    assert isinstance(staged["model"], collections.OrderedDict)
    assert getattr(staged["model"], "_metadata") == {"": {"version": 1}}  # noqa: B009

    shared = _ptr(staged["param"])  # one storage for the tied keys, the view and the param
    for t in (staged["model"]["emb.weight"], staged["model"]["out.weight"], staged["view"],
              staged["t_view"]):
        assert _ptr(t) == shared
    assert staged["view"].storage_offset() == 4
    assert shared != _ptr(tree["param"])  # a copy, not the source
    assert stats.tensor_bytes == _unique_bytes(tree)
    assert stats.num_storages == 9  # weight, ints, half, flags, scalar, empty, grad, pair, tuple


def test_second_stage_allocates_nothing_and_growth_reallocates_only_the_grown_buffer() -> None:
    buffers = BufferSet()
    tree = {"a": torch.ones(1000), "b": torch.ones(10, 10), "c": [torch.ones(3)]}
    staged1, first = buffers.stage(tree)
    assert first.allocated_bytes == first.tensor_bytes == (1000 + 100 + 3) * 4
    ptrs = {k: _ptr(v) for k, v in (("a", staged1["a"]), ("b", staged1["b"]))}

    staged2, second = buffers.stage(tree)
    assert second.allocated_bytes == 0 and second.tensor_bytes == first.tensor_bytes
    assert _ptr(staged2["a"]) == ptrs["a"] and _ptr(staged2["b"]) == ptrs["b"]

    tree["b"] = torch.ones(20, 10)  # the state grows: one tensor is larger
    staged3, grown = buffers.stage(tree)
    assert grown.allocated_bytes == 200 * 4  # only the grown buffer is new
    assert _ptr(staged3["a"]) == ptrs["a"] and _ptr(staged3["b"]) != ptrs["b"]
    assert torch.equal(staged3["b"], torch.ones(20, 10))

    _, again = buffers.stage(tree)
    assert again.allocated_bytes == 0

    del tree["b"]  # the state shrinks: the unused buffer is released
    buffers.stage(tree)
    assert buffers.allocator.total_bytes == (1000 + 3) * 4


def test_unsupported_tensor_layout_is_refused_with_its_path() -> None:
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True)
    with pytest.raises(TypeError, match=r"opt/state/0.*custom savefun"):
        BufferSet().stage({"opt": {"state": [sparse]}})


def test_shared_arena_round_trip_reuse_and_growth() -> None:
    arena = SharedArena()
    buffers = BufferSet(arena)
    reader = ArenaReader()
    try:
        tree = _tree()
        staged, first = buffers.stage(tree)
        assert first.allocated_bytes == arena.total_bytes >= first.tensor_bytes
        skeleton, table = arena.export(staged)
        assert arena.name is not None
        rebuilt = reader.rebuild(arena.name, copy.deepcopy(skeleton), table)  # as the worker
        assert torch.equal(rebuilt["param"], tree["param"])
        assert isinstance(rebuilt["param"], torch.nn.Parameter)
        assert _ptr(rebuilt["view"]) == _ptr(rebuilt["model"]["out.weight"])
        assert rebuilt["model"]._metadata == {"": {"version": 1}}
        assert rebuilt["meta"] == tree["meta"] and rebuilt["pair"].b == [1, 2]

        name = arena.name
        _, second = buffers.stage(tree)
        assert second.allocated_bytes == 0 and arena.name == name  # warm: same block

        tree["big"] = torch.ones(arena.total_bytes // 4 + 16)  # outgrows the block
        staged, grown = buffers.stage(tree)
        assert grown.allocated_bytes > 0 and arena.name != name
        assert torch.equal(staged["big"], tree["big"])
    finally:
        del staged, rebuilt
        reader.forget_except(set())
        arena.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sources_stage_into_pinned_cpu_buffers() -> None:
    tree = {"w": torch.arange(1 << 20, device="cuda", dtype=torch.float32)}
    staged, stats = BufferSet().stage(tree)
    tree["w"].add_(1)  # after stage returns, the copy is complete
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    assert torch.equal(staged["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert stats.allocated_bytes == 4 << 20


def test_cuda_sources_get_pinned_buffers_once_cpu_stand_in(monkeypatch) -> None:
    """The pinned-buffer policy without a GPU: buffers for CUDA sources are pinned when they are
    allocated, reused (not re-pinned) by later snapshots, and CPU sources are never pinned."""
    pinned: list[int] = []

    def fake_pin_memory(self, device=None):  # stands in for cudaHostRegister/cudaHostAlloc
        pinned.append(self.nbytes())
        return self

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.UntypedStorage, "pin_memory", fake_pin_memory)
    allocator = HeapAllocator()
    layout = [(("model", "w"), 4096, True), (("model", "b"), 64, False)]
    first, allocated = allocator.reserve(layout)
    assert pinned == [4096] and allocated == 4096 + 64
    again, allocated = allocator.reserve(layout)
    assert pinned == [4096] and allocated == 0
    assert all(a is b for a, b in zip(first, again))
    grown = [(("model", "w"), 8192, True), (("model", "b"), 64, False)]
    allocator.reserve(grown)
    assert pinned == [4096, 8192]  # only the grown buffer is reallocated (and pinned)
    unpinned = HeapAllocator(pin_memory=False)
    unpinned.reserve(layout)
    assert pinned == [4096, 8192]
