"""snapshot(loaders=...): argument checks, and resume from every batch of a two-epoch run in
one process (the subprocess matrix is tests/integration/test_loader_resume.py).

The resumed loader is a new object built the same way, in a process whose global RNG is
elsewhere; the loop draws from the global RNG after each batch (as dropout would). From every
position it must yield the remaining batches of the uninterrupted run and leave the global RNG
where the uninterrupted run had it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from snapkeep.layout import check_loaders
from snapkeep.training import extensions

DATA = TensorDataset(torch.arange(11))
EPOCHS = 2


def _loader(kind: str) -> DataLoader:
    if kind == "global":
        return DataLoader(DATA, batch_size=3, shuffle=True)
    if kind == "generator":
        return DataLoader(DATA, batch_size=3, shuffle=True,
                          generator=torch.Generator().manual_seed(5))
    if kind == "sampler-generator":
        sampler = RandomSampler(DATA, generator=torch.Generator().manual_seed(6))
        return DataLoader(DATA, batch_size=4, sampler=sampler, drop_last=True)
    if kind == "batch-sampler":
        sampler = BatchSampler(RandomSampler(DATA), batch_size=2, drop_last=False)
        return DataLoader(DATA, batch_sampler=sampler)
    if kind == "no-batching":
        return DataLoader(DATA, batch_size=None, shuffle=True)
    if kind == "sequential":
        return DataLoader(DATA, batch_size=3, sampler=SequentialSampler(DATA))
    raise AssertionError(kind)


def _run(loader: DataLoader, position, *, epochs_left: int, on_batch=None) -> list:
    out = []
    for _ in range(epochs_left):
        for (batch,) in loader:
            out.append((batch.tolist(), float(torch.rand(()))))
            if on_batch is not None:
                on_batch()
    return out


def _uninterrupted(kind: str) -> tuple[Any, Any, list[tuple[dict, torch.Tensor]], Any]:
    """The uninterrupted run of ``kind``'s loader over EPOCHS epochs: (loader, its position,
    the position and global RNG state saved after each batch, the batches)."""
    torch.manual_seed(0)
    loader = _loader(kind)
    position = check_loaders({"train": loader})["train"]
    saved: list[tuple[dict, torch.Tensor]] = []
    straight = _run(loader, position, epochs_left=EPOCHS,
                    on_batch=lambda: saved.append((position.state_dict(), torch.get_rng_state())))
    return loader, position, saved, straight


@pytest.mark.parametrize("kind", ["global", "generator", "sampler-generator", "batch-sampler",
                                  "no-batching", "sequential"])
def test_resume_from_every_batch_continues_the_uninterrupted_run(kind):
    loader, position, saved, straight = _uninterrupted(kind)
    per_epoch = len(loader)
    assert len(straight) == EPOCHS * per_epoch
    for done, (state, rng) in enumerate(saved[:-1], start=1):
        torch.manual_seed(1234)  # another process: the global RNG is elsewhere
        resumed_loader = _loader(kind)
        resumed = check_loaders({"train": resumed_loader})["train"]
        resumed.load_state_dict(state, "train")
        torch.set_rng_state(rng)  # what the snapshot extension restores
        epochs_left = EPOCHS - done // per_epoch
        tail = _run(resumed_loader, resumed, epochs_left=epochs_left)
        assert tail == straight[done:], f"resumed after batch {done}"


def test_a_changed_loader_length_is_refused_at_load():
    torch.manual_seed(0)
    loader = _loader("global")
    position = check_loaders({"train": loader})["train"]
    next(iter(loader))
    state = position.state_dict()
    other = DataLoader(DATA, batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match=r"loaders\['train'\].*batch_size 3 -> 4; batches per "
                                         r"epoch 4 -> 3"):
        check_loaders({"train": other})["train"].load_state_dict(state, "train")


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(("loaders", "message"), [
    ([1], r"loaders must be a mapping of names to data loaders.*got list"),
    ({"train": [1, 2]}, r"loaders\['train'\] is a list; accepted: a torch.utils.data.DataLoader"),
    ({1: DataLoader(DATA)}, r"loaders keys must be str names, got 1"),
    ({"s": DataLoader(_Stream())}, r"loaders\['s'\] is a DataLoader over an IterableDataset"),
])
def test_bad_loaders_argument_names_it_and_the_accepted_kinds(loaders, message):
    with pytest.raises(TypeError, match=message):
        extensions.snapshot(loaders=loaders)


def test_the_hooked_loader_keeps_its_class_name_and_isinstance():
    loader = DataLoader(DATA, batch_size=3)
    extensions.snapshot(loaders={"train": loader})
    assert isinstance(loader, DataLoader) and type(loader).__name__ == "DataLoader"
    assert len(loader) == 4 and [b[0].tolist() for b in loader][0] == [0, 1, 2]


@pytest.mark.parametrize("kind", ["global", "generator", "sampler-generator", "batch-sampler",
                                  "no-batching", "sequential"])
def test_a_resumed_run_snapshots_a_position_that_resumes_again(kind):
    """Resume mid-epoch, take a snapshot later in the same epoch, resume from that one: the
    second resume continues the uninterrupted run too (a resumed epoch keeps the generator
    states of the epoch's start in its own snapshots)."""
    loader, position, saved, straight = _uninterrupted(kind)
    per_epoch = len(loader)
    for first in range(1, per_epoch - 1):  # mid-epoch, with a later batch left in the epoch
        state, rng = saved[first - 1]
        torch.manual_seed(1234)
        second_loader = _loader(kind)
        second = check_loaders({"train": second_loader})["train"]
        second.load_state_dict(state, "train")
        torch.set_rng_state(rng)
        again: list[tuple[dict, torch.Tensor]] = []
        for (_batch,) in second_loader:  # the rest of the first epoch, snapshotting each batch
            float(torch.rand(()))
            again.append((second.state_dict(), torch.get_rng_state()))
        assert len(again) == per_epoch - first
        for later, (state2, rng2) in enumerate(again[:-1], start=first + 1):
            assert "torch_rng" in state2, "a resumed epoch's snapshot lost its generator states"
            torch.manual_seed(99)
            third_loader = _loader(kind)
            third = check_loaders({"train": third_loader})["train"]
            third.load_state_dict(state2, "train")
            torch.set_rng_state(rng2)
            tail = _run(third_loader, third, epochs_left=EPOCHS)
            assert tail == straight[later:], f"resumed after {first}, then after {later}"


def test_a_stateful_loader_shuffled_on_the_global_rng_is_warned_about_at_registration():
    from torchdata.stateful_dataloader import StatefulDataLoader

    with pytest.warns(RuntimeWarning, match=r"loaders\['train'\]: a StatefulDataLoader without "
                                            r"generator="):
        check_loaders({"train": StatefulDataLoader(DATA, batch_size=3, shuffle=True)})
    seeded = StatefulDataLoader(DATA, batch_size=3, shuffle=True,
                                generator=torch.Generator().manual_seed(0))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check_loaders({"train": seeded})  # exact: no warning
