"""The loader's geometry and its sampler's epoch are part of the data position (issue 25 item
4, issue 24): a change that moves samples to other positions of the epoch (batch size 10 -> 11
or 100 -> 95 samples keep ``len(loader)`` equal) is refused, naming it, before anything is
loaded, by every door (the position itself, ``Checkpointer.load``, the snapshot extension's
autoload); a ``DistributedSampler``'s epoch is restored before the resumed iterator is built."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torchdata.stateful_dataloader import StatefulDataLoader

import snapkeep
from snapkeep import writing
from snapkeep.errors import StateMismatchError
from snapkeep.layout import check_loaders
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _dist(n: int, **kw: Any) -> DistributedSampler:
    return DistributedSampler(_data(n), num_replicas=2, rank=0, **kw)


# (built before, built after, what the message names): each keeps len(loader) where noted
CHANGES = [
    (lambda: dict(dataset=_data(100), batch_size=10, shuffle=True),
     lambda: dict(dataset=_data(100), batch_size=11, shuffle=True), r"batch_size 10 -> 11"),
    (lambda: dict(dataset=_data(100), batch_size=10, shuffle=True),
     lambda: dict(dataset=_data(95), batch_size=10, shuffle=True), r"dataset length 100 -> 95"),
    (lambda: dict(dataset=_data(100), batch_size=7, drop_last=False),
     lambda: dict(dataset=_data(100), batch_size=7, drop_last=True), r"drop_last False -> True"),
    (lambda: dict(dataset=_data(100), batch_size=10, shuffle=True),
     lambda: dict(dataset=_data(100), batch_size=10, sampler=SequentialSampler(_data(100))),
     r"sampler '[\w.]+\.RandomSampler' -> 'torch.utils.data.sampler.SequentialSampler'"),
    (lambda: dict(dataset=_data(100), batch_size=10, sampler=_dist(100, seed=1)),
     lambda: dict(dataset=_data(100), batch_size=10, sampler=_dist(100, seed=2)),
     r"sampler.seed 1 -> 2"),
    (lambda: dict(dataset=_data(100), batch_sampler=BatchSampler(RandomSampler(_data(100)), 10,
                                                                 drop_last=False)),
     lambda: dict(dataset=_data(100), batch_sampler=BatchSampler(RandomSampler(_data(100)), 11,
                                                                 drop_last=False)),
     r"batch_sampler.batch_size 10 -> 11"),
]


def _positioned(kind: type, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    loader = kind(**kwargs)
    position = check_loaders({"train": loader})["train"]
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    return loader, position.state_dict()


@pytest.mark.parametrize("kind", [DataLoader, StatefulDataLoader], ids=["plain", "stateful"])
@pytest.mark.parametrize(("before", "after", "named"), CHANGES,
                         ids=["batch-size", "dataset-length", "drop-last", "sampler", "seed",
                              "batch-sampler"])
def test_a_geometry_change_is_refused_naming_it(kind, before, after, named):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the stateful loader's generator hint
        _, state = _positioned(kind, before())
        loader = kind(**after())
        position = check_loaders({"train": loader})["train"]
    assert position.problems(state, "train")  # a check that changes nothing
    with pytest.raises(ValueError, match=named):
        position.load_state_dict(state, "train")


def _model_state(model: torch.nn.Module, optim: torch.optim.Optimizer,
                 gen: torch.Generator) -> Any:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            repr(optim.state_dict()), gen.get_state().clone(), torch.get_rng_state().clone())


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1] \
        and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


def _train_state(batch_size: int, n: int, kind: type = DataLoader) -> dict[str, Any]:
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.Adam(model.parameters())
    loader = kind(_data(n), batch_size=batch_size, shuffle=True,
                  generator=torch.Generator().manual_seed(3))
    return {"model": model, "optim": optim, "gen": torch.Generator().manual_seed(9),
            "loader": loader}


@pytest.mark.parametrize("kind", [DataLoader, StatefulDataLoader], ids=["plain", "stateful"])
@pytest.mark.parametrize(("batch_size", "n", "named"), [(20, 100, "batches per epoch 10 -> 5"),
                                                        (11, 100, "batch_size 10 -> 11"),
                                                        (10, 95, "dataset length 100 -> 95")])
def test_checkpointer_refuses_before_loading_anything(tmp_path, kind, batch_size, n, named):
    torch.manual_seed(0)
    state = _train_state(10, 100, kind)
    with snapkeep.Checkpointer(tmp_path, writer=writing.SimpleWriter()) as ckpt:
        ckpt.load(into=state)
        iterator = iter(state["loader"])
        for step in (1, 2, 3):
            next(iterator)
            state["model"](torch.ones(1, 2)).sum().backward()
            state["optim"].step()
            state["gen"].seed()
            ckpt.save(step, state)
    torch.manual_seed(1)
    fresh = _train_state(batch_size, n, kind)
    before = _model_state(fresh["model"], fresh["optim"], fresh["gen"])
    with snapkeep.Checkpointer(tmp_path, writer=writing.SimpleWriter()) as ckpt, \
            pytest.raises(StateMismatchError, match=named):
        ckpt.load(into=fresh)
    assert _same(before, _model_state(fresh["model"], fresh["optim"], fresh["gen"]))


def test_a_sharded_checkpointer_refuses_before_loading_anything(tmp_path):
    """The sharded engine (DCP) fills the live tensors in place while it loads: the loaders'
    positions are read and checked first."""
    torch.manual_seed(0)
    state = _train_state(10, 100, StatefulDataLoader)
    del state["gen"]
    with snapkeep.Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.load(into=state)
        iterator = iter(state["loader"])
        for step in (1, 2):
            next(iterator)
            state["model"](torch.ones(1, 2)).sum().backward()
            state["optim"].step()
            ckpt.save(step, state)
    fresh = _train_state(11, 100, StatefulDataLoader)
    del fresh["gen"]
    weights = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    with snapkeep.Checkpointer(tmp_path, sharded=True) as ckpt, \
            pytest.raises(StateMismatchError,  # one process: its own error (RankFailedError
                          match=r"batch_size 10 -> 11.*Nothing was loaded"):  # on many ranks)
        ckpt.load(into=fresh)
    assert all(torch.equal(v, fresh["model"].state_dict()[k]) for k, v in weights.items())
    # nothing of the snapshot (2 Adam steps) reached the optimizer; DCP's state_dict API
    # itself initializes a fresh optimizer's state with one zero-gradient step (torch's
    # _init_optim_state): moments zero, step 1
    for param_state in fresh["optim"].state_dict()["state"].values():
        assert param_state["step"].item() == 1
        assert not torch.any(param_state["exp_avg"]) and not torch.any(param_state["exp_avg_sq"])


def _manager(out: str, batch_size: int, n: int, mode: str) -> tuple[Any, Any, DataLoader]:
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(n), batch_size=batch_size, shuffle=True)
    manager = ExtensionsManager(model, {"main": optim}, 3, iters_per_epoch=len(loader),
                                out_dir=out, writer=writing.SimpleWriter(out_dir=out))
    sharded = {"snapshot_mode": ext.SnapshotMode.SHARDED} if mode == "sharded" else {}
    manager.extend(ext.snapshot(autoload=True, loaders={"train": loader}, **sharded),
                   trigger=(4, "iteration"))
    return model, manager, loader


@pytest.mark.parametrize("mode", ["single-file", "sharded"])
def test_the_snapshot_extensions_autoload_refuses_before_loading_anything(tmp_path, mode):
    out = str(tmp_path / "run")
    torch.manual_seed(0)
    model, manager, loader = _manager(out, 10, 100, mode)
    for (x,) in loader:
        with manager.run_iteration():
            model.weight.data += x.float().mean()
        if manager.iteration == 4:
            break
    manager.finalize()
    torch.manual_seed(1)
    model, manager, loader = _manager(out, 11, 100, mode)
    weights = model.weight.detach().clone()
    with pytest.raises(StateMismatchError, match=r"batch_size 10 -> 11.*Nothing was loaded"):
        manager.start_extensions()  # single process: its own error (ranks: RankFailedError)
    assert torch.equal(model.weight, weights) and manager.iteration == 0


def _epochs(loader: Any, sampler: DistributedSampler, ckpt: Any, state: Any, start: int,
            stop: int, *, set_epoch: Any = None) -> list[list[int]]:
    """A plain loop over epochs with set_epoch (the docs' torchrun loop); the batches fed
    after ``start`` until step ``stop``."""
    fed: list[list[int]] = []
    step, per_epoch = start, len(loader)
    while step < stop:
        sampler.set_epoch(step // per_epoch if set_epoch is None else set_epoch)
        for (x,) in loader:
            fed.append(x.tolist())
            step += 1
            ckpt.save(step, state)
            if step == stop:
                break
    return fed


@pytest.mark.parametrize("kind", [DataLoader, StatefulDataLoader], ids=["plain", "stateful"])
@pytest.mark.parametrize("killed_at", [7, 10], ids=["inside-epoch", "epoch-end"])
def test_a_distributed_samplers_epoch_is_restored_before_the_iterator_is_built(tmp_path, kind,
                                                                              killed_at):
    def build() -> tuple[Any, DistributedSampler, dict[str, Any]]:
        sampler = _dist(40, shuffle=True, seed=7)  # 20 samples per rank, 5 batches per epoch
        loader = kind(_data(40), batch_size=4, sampler=sampler)
        return loader, sampler, {"loader": loader}

    loader, sampler, state = build()
    with snapkeep.Checkpointer(tmp_path / "ref", writer=writing.SimpleWriter()) as ckpt:
        ckpt.load(into=state)
        straight = _epochs(loader, sampler, ckpt, state, 0, 15)
    loader, sampler, state = build()
    with snapkeep.Checkpointer(tmp_path / "run", writer=writing.SimpleWriter()) as ckpt:
        ckpt.load(into=state)
        _epochs(loader, sampler, ckpt, state, 0, killed_at)  # killed in or at the end of epoch 1
    loader, sampler, state = build()
    with snapkeep.Checkpointer(tmp_path / "run", writer=writing.SimpleWriter()) as ckpt:
        start = ckpt.load(into=state)
        assert start == killed_at and sampler.epoch == 1  # restored by the load itself
        assert _epochs(loader, sampler, ckpt, state, start, 15) == straight[killed_at:]


def test_a_loop_that_sets_another_epoch_inside_the_resumed_one_is_told(tmp_path, caplog):
    loader = DataLoader(_data(40), batch_size=4, sampler=_dist(40, shuffle=True, seed=7))
    state = {"loader": loader}
    with snapkeep.Checkpointer(tmp_path, writer=writing.SimpleWriter()) as ckpt:
        straight = _epochs(loader, loader.sampler, ckpt, state, 0, 10)
    loader = DataLoader(_data(40), batch_size=4, sampler=_dist(40, shuffle=True, seed=7))
    state = {"loader": loader}
    with snapkeep.Checkpointer(tmp_path, writer=writing.SimpleWriter()) as ckpt:
        ckpt.load(into=state, step=7)
        with caplog.at_level("WARNING", logger="snapkeep"):
            fed = _epochs(loader, loader.sampler, ckpt, state, 7, 10, set_epoch=0)
    assert fed == straight[7:10]  # the saved epoch's order, not epoch 0's
    assert "set the sampler's epoch to 0, but the snapshot was taken inside epoch 1" \
        in caplog.text
