"""Invariant 1: when an async writer's call returns, the state may be mutated in place and the
snapshot still holds the values of the call.

Each save is held in its savefun (a gate) until the test has mutated the state in place -- as
``optimizer.step()`` does -- so the file is written strictly after the mutation; the file must
still equal the reference cloned at the call.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

from snapkeep import writing
from support.writer_gates import EventGate, SocketGate

SNAPSHOTS = 3


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.hidden = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight  # tied weights: one storage, two state_dict keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.hidden(self.emb(x))))  # type: ignore[no-any-return]


def _integer_valued(model: torch.nn.Module, base: int) -> None:
    with torch.no_grad():
        for i, t in enumerate(model.state_dict().values()):
            if t.is_floating_point():
                t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) + base + 100 * i)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.arange(6).repeat(2)).square().mean().backward()
    optimizer.step()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
           grad_leaf: torch.Tensor) -> dict[str, Any]:
    emb = model.get_parameter("emb.weight")
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "meta": meta,  # non-tensor leaves, mutated after the call
        "param": emb,  # an nn.Parameter leaf (requires_grad), tied to model/emb.weight
        "view": emb.detach()[2:4],  # a view into the tied storage at an offset
        "grad_leaf": grad_leaf,  # a plain tensor with requires_grad
    }


def _mutate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
            grad_leaf: torch.Tensor) -> None:
    _train_step(model, optimizer)  # params, exp_avg, exp_avg_sq and step change in place
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(1000)
        grad_leaf.add_(1000)
    meta["history"].append(len(meta["history"]))
    meta["epoch"] += 1000
    meta["nested"]["tags"][0] = "mutated"


def _assert_tree_equal(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got.detach(), want.detach()), f"torn or stale tensor at {path}"
        assert got.requires_grad == want.requires_grad, path
        assert isinstance(got, torch.nn.Parameter) == isinstance(want, torch.nn.Parameter), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            _assert_tree_equal(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_tree_equal(g, w, f"{path}/{i}")
    else:
        assert got == want, path


def _differs(a: Any, b: Any) -> int:
    """Number of leaves that differ (the "differs before" check)."""
    if isinstance(b, torch.Tensor):
        return int(not torch.equal(a.detach(), b.detach()))
    if isinstance(b, dict):
        return sum(_differs(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)) and len(a) == len(b):
        return sum(_differs(x, y) for x, y in zip(a, b))
    return int(a != b)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


WRITERS = [
    pytest.param(writing.ThreadWriter, False, id="ThreadWriter"),
    pytest.param(writing.ThreadQueueWriter, False, id="ThreadQueueWriter"),
    pytest.param(writing.ProcessWriter, True, id="ProcessWriter"),
    pytest.param(writing.ProcessQueueWriter, True, id="ProcessQueueWriter"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("writer_cls", "in_process"), WRITERS)
def test_file_holds_values_of_the_call_despite_in_place_mutation(
    writer_cls: type[writing.Writer], in_process: bool, tmp_path: Any,
) -> None:
    torch.manual_seed(0)
    model = TiedModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _train_step(model, optimizer)  # populate Adam's state
    meta: dict[str, Any] = {"history": [0], "epoch": 0, "nested": {"tags": ["orig"]}}
    grad_leaf = torch.arange(5.0).requires_grad_(True)
    gate = SocketGate() if in_process else EventGate()
    writer = writer_cls(gate.savefun)  # type: ignore[call-arg]
    out = str(tmp_path)
    references = []
    try:
        for i in range(SNAPSHOTS):
            _integer_valued(model, base=10 * i)
            state = _state(model, optimizer, meta, grad_leaf)
            reference = copy.deepcopy(state)  # clones tensors, keeps storage sharing
            handle = writer(f"snap_{i}", out, state)
            assert handle is not None and handle.staged.done()
            _mutate(model, optimizer, meta, grad_leaf)
            assert _differs(state, reference) >= 10, "the mutation must change the state"
            references.append(reference)
            gate.wait_entered()  # the save of this snapshot is blocked in its savefun ...
            gate.release()  # ... and writes only now, after the mutation
        writer.finalize()
    finally:
        gate.close()

    assert sorted(os.listdir(out)) == [".snapkeep"] + [f"snap_{i}" for i in range(SNAPSHOTS)]
    for i, reference in enumerate(references):
        loaded = torch.load(os.path.join(out, f"snap_{i}"), weights_only=True)
        _assert_tree_equal(loaded, reference)
        # tied weights, the Parameter leaf and the view still share one storage
        m = loaded["model"]
        tied = _storage_ptr(m["emb.weight"])
        assert _storage_ptr(m["out.weight"]) == tied
        assert _storage_ptr(loaded["param"]) == tied
        assert _storage_ptr(loaded["view"]) == tied
        assert loaded["view"].storage_offset() == 2 * 4
        assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["param"].requires_grad
        assert loaded["grad_leaf"].requires_grad
        assert loaded["meta"]["history"] == list(range(i + 1))
        assert loaded["meta"]["nested"]["tags"] == (["orig"] if i == 0 else ["mutated"])
        assert loaded["optimizer"]["state"][0]["step"].item() == i + 1
