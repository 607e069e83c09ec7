"""The data loader's position in the snapshot: ``extensions.snapshot(loaders={'train': loader})``.

A resumed run must feed the same batches in the same order as the uninterrupted run, and the
user's unchanged ``for batch in loader`` must end its epoch where the manager's epoch ends. How
the position is kept, per kind of loader:

``torch.utils.data.DataLoader`` (map-style dataset, any sampler or ``batch_sampler``,
``num_workers`` >= 0, ``DistributedSampler``):
    The loader object the loop holds is hooked in place: its class is swapped for a subclass
    (one per loader class, same name) that overrides ``__iter__`` and ``_index_sampler``.
    ``DataLoader.__setattr__`` forbids replacing ``sampler``/``batch_sampler`` after
    construction and the loop keeps its own reference, so the object itself has to change; the
    swap keeps every attribute and ``isinstance`` check of the loader. Per epoch (per
    ``iter(loader)``) the position records:

    * the states of torch's global CPU generator and of every ``torch.Generator`` the loader or
      its sampler holds, taken just before the index sampler yields its first index (so
      ``RandomSampler``'s seed draw and ``randperm``, on the global RNG or ``generator=``, are
      covered), and
    * the number of batches the *loop* has received from the loader's iterator (counted at the
      iterator, not the sampler: worker processes prefetch ahead of the loop).

    On resume the next ``iter(loader)`` sets those generator states, lets the index sampler
    compute the epoch's order again and drops the first ``batches`` entries at the index level
    (no sample is loaded), then puts torch's global generator back to the state the snapshot
    restored. The generators the loader owns end in the state the uninterrupted run had:
    the same indices were drawn, prefetch included. A snapshot taken after the epoch's last
    batch replays the whole epoch's index draws (``RandomSampler`` draws one more ``randperm``
    when its iterator runs out, after that snapshot) and then starts the next epoch normally.
    Cost at resume: one pass of the index sampler over the consumed part of the epoch
    (``docs/guarantees.md`` gives the figure measured for 1M samples). Saved: two small
    ints and 5,056 bytes per generator.

    Exact with ``num_workers`` > 0: the batches and their order. Not exact: randomness drawn
    inside worker processes mid-epoch (a dataset's ``__getitem__`` drawing random
    augmentation): workers restart from their epoch seed, skip no draws for the batches not
    loaded, and get batches in a different round-robin slot. Derive such randomness from the
    index (``torch.Generator().manual_seed(hash((epoch, index)))``) to make it exact. With
    ``persistent_workers=True`` worker RNG also carries across epochs, so it is not exact at
    epoch boundaries either.

torchdata's ``StatefulDataLoader``:
    Its own ``state_dict()``/``load_state_dict()``, plus the states of its generators at the
    snapshot. Two corrections, measured with torchdata 0.11: its resumed iterator draws a base
    seed from the global RNG (or ``generator=``) before replacing it with the saved one, so
    the global state is put back after that ``iter``; and it restores ``generator=`` to the
    epoch's start, so the generators are set to their snapshot states after it (without
    that, with ``num_workers=0`` the next epoch's order differs). A snapshot taken after the
    epoch's last batch starts a fresh epoch from those states instead of loading the
    finished iterator.

The loader's geometry is part of the position (:func:`loader_geometry`): the topology it was
taken under (the job's world size, and this rank, recorded for messages), the dataset's length,
the batch size, ``drop_last``, the sampler's and batch sampler's kinds and their settings
(``DistributedSampler``'s ``num_replicas``, ``shuffle``, ``seed``, ``drop_last``;
``RandomSampler``'s ``replacement`` and ``num_samples``) and the batches per epoch. Any change
moves samples to other positions (a batch size of 10 -> 11 or 100 -> 95 samples keeps
``len(loader)`` equal but skips or repeats samples), so a saved position whose geometry differs
from the live loader's is refused, naming each change, before anything is loaded
(:meth:`LoaderPosition.problems`). The sampler's epoch (``DistributedSampler.set_epoch``, any
sampler with ``set_epoch`` and an ``epoch`` attribute) is saved with the position and set back
when it loads, before any iterator of the resumed epoch is built; a loop that then sets another
epoch for the resumed epoch is told (a warning) and the saved epoch's order is fed.

Another world size: a position is per rank (each rank's count of batches, its generators, its
sampler's share of the epoch), so a position taken under W ranks cannot be split exactly over W'
ranks by loading each rank's own: a rank that did not exist would take rank 0's position (the
rule for other per-rank values, RNG states included: see ``RankObjects`` in
:mod:`snapkeep._core.distributed.sharded`) and feed rank 0's samples twice, and a rank that is
gone takes its unseen samples with it. So a saved position whose world size differs from the
live job's is refused, naming both sizes and the saving rank, before anything is loaded (model
and optimizer included), for every kind of loader and sampler; model and optimizer state alone
reshard through DCP as before (leave the loader out of the resumed state to start its epoch
over on the new world size, or resume on the saved world size to finish the epoch exactly).
Snapshots from before the topology was recorded are not compared on it.

An ``IterableDataset`` in a plain ``DataLoader`` is refused (skipping would mean reading the
skipped samples); use ``StatefulDataLoader`` with a dataset that has ``state_dict``.

The saved values load under ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

__all__ = ["LOADER_KINDS", "LoaderPosition", "StatefulLoaderState", "check_loaders",
           "generator_states", "geometry_problems", "is_stateful_loader", "loader_geometry",
           "loader_position", "sampler_epoch", "set_generator_states"]

logger = logging.getLogger(__name__)

LOADER_KINDS = ("a torch.utils.data.DataLoader over a map-style dataset (any sampler or "
                "batch_sampler, num_workers >= 0), or torchdata's StatefulDataLoader")

_PLAIN = "torch.DataLoader/1"
_STATEFUL = "torchdata.StatefulDataLoader/1"
_ATTR = "_snapkeep_position"


class LoaderPosition(Protocol):
    """What the snapshot extension holds per registered loader.

    Call order: ``state_dict()`` at each snapshot (training thread); ``load_state_dict()``
    once, while the manager loads a snapshot (before the loop's next ``iter(loader)``), which
    applies at that ``iter``.
    """

    def state_dict(self) -> dict[str, Any]:
        """The position now (values load under ``weights_only=True``)."""

    def problems(self, state: Mapping[str, Any], name: str) -> list[str]:
        """Why ``state`` cannot be loaded into this loader exactly (empty when it can); changes
        nothing. ``load_state_dict`` raises ``ValueError`` with these."""

    def load_state_dict(self, state: Mapping[str, Any], name: str) -> None:
        """Resume from ``state`` at the next ``iter(loader)``.

        Raises:
            ValueError: :meth:`problems` found some (nothing was changed).
        """


def check_loaders(loaders: Mapping[str, Any] | None) -> dict[str, LoaderPosition]:
    """Validate ``snapshot(loaders=...)`` and hook each loader (see the module docstring).

    Registering the same loader object twice (two extensions) shares one position.

    Raises:
        TypeError: not a mapping of str to one of :data:`LOADER_KINDS`.
    """
    if loaders is None:
        return {}
    if not isinstance(loaders, Mapping):
        raise TypeError(f"loaders must be a mapping of names to data loaders, e.g. "
                        f"loaders={{'train': loader}}; got {type(loaders).__name__}")
    positions: dict[str, LoaderPosition] = {}
    for name, loader in loaders.items():
        if not isinstance(name, str):
            raise TypeError(f"loaders keys must be str names, got {name!r}")
        positions[name] = loader_position(name, loader)
    return positions


def loader_position(name: str, loader: Any) -> LoaderPosition:
    """Hook ``loader`` in place (module docstring) and return its position; a loader hooked
    before (by a snapshot extension or a ``Checkpointer``) returns the position it has.

    Hook a loader before its first ``iter(loader)``: an epoch started unhooked has no recorded
    generator states, so it is saved as not started.

    Raises:
        TypeError: ``loader`` is not one of :data:`LOADER_KINDS` (``name`` names it in the
            message), or a plain ``DataLoader`` over an ``IterableDataset``.
    """
    existing = getattr(loader, _ATTR, None) if isinstance(loader, DataLoader) else None
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    if not isinstance(loader, DataLoader):
        raise TypeError(f"loaders[{name!r}] is a {type(loader).__name__}; accepted: "
                        f"{LOADER_KINDS}")
    position: _SamplerPosition | _StatefulPosition
    if _is_stateful(loader):
        if loader.generator is None and type(loader.sampler).__name__ == "RandomSampler":
            warnings.warn(
                f"loaders[{name!r}]: a StatefulDataLoader without generator= resumes the same "
                "batches, but the global RNG stream after a resume differs from the "
                "uninterrupted run's (dropout draws differ): pass generator=torch.Generator()"
                ".manual_seed(seed) to it, or use a plain DataLoader (docs/continuation.md)",
                RuntimeWarning, stacklevel=3)
        position = _StatefulPosition(loader)
    elif isinstance(loader.dataset, IterableDataset):
        raise TypeError(f"loaders[{name!r}] is a DataLoader over an IterableDataset, whose "
                        f"position cannot be skipped to without reading it; accepted: "
                        f"{LOADER_KINDS} (use StatefulDataLoader with a dataset that has "
                        f"state_dict/load_state_dict)")
    else:
        position = _SamplerPosition(loader)
    loader.__dict__[_ATTR] = position
    loader.__class__ = _hooked_class(type(loader), stateful=isinstance(position,
                                                                       _StatefulPosition))
    return position


def _is_stateful(loader: DataLoader[Any]) -> bool:
    return any(c.__module__.startswith("torchdata.") and c.__name__ == "StatefulDataLoader"
               for c in type(loader).__mro__)


_HOOKED: dict[tuple[type, bool], type] = {}


def _hooked_class(cls: type, *, stateful: bool) -> type:
    """``cls`` with ``__iter__`` (and, for a plain loader, ``_index_sampler``) routed through
    the loader's position; one subclass per class, same name and module."""
    hooked = _HOOKED.get((cls, stateful))
    if hooked is not None:
        return hooked
    base_iter = cls.__iter__  # type: ignore[attr-defined]

    def __iter__(self: Any) -> Any:
        return self.__dict__[_ATTR].iterate(lambda: base_iter(self))

    namespace: dict[str, Any] = {"__iter__": __iter__, "__module__": cls.__module__,
                                 "__qualname__": cls.__qualname__,
                                 "__doc__": cls.__doc__}
    if not stateful:
        base_index_sampler = cls._index_sampler  # type: ignore[attr-defined]

        def _index_sampler(self: Any) -> Any:
            return self.__dict__[_ATTR].index_sampler(base_index_sampler.fget(self))

        namespace["_index_sampler"] = property(_index_sampler)
    hooked = type(cls.__name__, (cls,), namespace)
    _HOOKED[(cls, stateful)] = hooked
    return hooked


#: Sampler settings that decide which sample sits at which position of an epoch.
_SAMPLER_SETTINGS = ("num_replicas", "shuffle", "seed", "drop_last", "replacement",
                     "num_samples", "batch_size")


def _kind_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe(geometry: dict[str, Any], where: str, sampler: Any) -> None:
    """``sampler``'s kind and plain-valued settings into ``geometry`` under ``where``."""
    if sampler is None:
        return
    geometry[where] = _kind_name(sampler)
    for setting in _SAMPLER_SETTINGS:
        try:
            value = getattr(sampler, setting)
        except (TypeError, AttributeError):
            continue
        if value is None or isinstance(value, (bool, int, str)):
            geometry[f"{where}.{setting}"] = value


def loader_geometry(loader: DataLoader[Any]) -> dict[str, Any]:
    """What decides which sample sits at which position of the loader's epoch: the job's
    ``world size`` (and this ``rank``, for messages), the dataset's
    length, ``batch_size``, ``drop_last``, the kinds (module and class name) of the sampler,
    the batch sampler and a batch sampler's own sampler, their settings among
    :data:`_SAMPLER_SETTINGS` that are plain values, and the batches per epoch. Entries that
    cannot be known (an ``IterableDataset`` has no length) are left out. Values are str, int,
    bool or None (load under ``weights_only=True``)."""
    from snapkeep._core.distributed.groups import job_rank, job_world_size

    geometry: dict[str, Any] = {"world size": job_world_size(), "rank": job_rank()}
    try:
        geometry["dataset length"] = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        pass
    geometry["batch_size"] = loader.batch_size
    geometry["drop_last"] = bool(loader.drop_last)
    _describe(geometry, "sampler", getattr(loader, "sampler", None))
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None:
        _describe(geometry, "batch_sampler", batch_sampler)
        inner = getattr(batch_sampler, "sampler", None)
        if inner is not None and inner is not getattr(loader, "sampler", None):
            _describe(geometry, "batch_sampler.sampler", inner)
    try:
        geometry["batches per epoch"] = len(loader)
    except TypeError:
        pass
    return geometry


def geometry_problems(saved: Any, live: Mapping[str, Any], name: str) -> list[str]:
    """One line per entry of a saved :func:`loader_geometry` that differs from ``live``
    (entries only one side has are not compared: an older snapkeep saved fewer; the rank is
    not compared; the world size first and alone, where the sampler splits the data by rank:
    ``num_replicas``)."""
    if not isinstance(saved, Mapping):
        return []
    # a sampler that splits the data by rank (DistributedSampler: ``num_replicas``) makes a
    # position per rank; one that does not (every rank iterates the whole dataset, as the
    # sharded demo's global batch order) is a full pass on each rank, which rank r of the new
    # job continues (rank 0's for a new rank: the RankObjects rule)
    splits = any(str(key).endswith(".num_replicas") for key in saved)
    if splits and "world size" in saved and "world size" in live \
            and saved["world size"] != live["world size"]:
        return [f"loaders[{name!r}]: the data position was taken on {saved['world size']} "
                f"rank(s) (this one on rank {saved.get('rank', '?')}), this job runs "
                f"{live['world size']}: a position is per rank and cannot be re-split exactly "
                "over another number of ranks (samples would be seen twice or never); resume "
                f"on {saved['world size']} rank(s) to finish the epoch, or leave the loader out "
                "of the resumed state to start its epoch over on the new world size"]
    changed = [f"{key} {saved[key]!r} -> {live[key]!r}" for key in live
               if key in saved and key not in ("rank", "world size") and saved[key] != live[key]]
    if not changed:
        return []
    return [f"loaders[{name!r}]: the loader's geometry changed since the snapshot "
            f"({'; '.join(changed)}), which moves samples to other positions of the epoch "
            "(they would be skipped or repeated); build the loader as the snapshot's run did, "
            "or leave it out of the resumed state to start its epoch over"]


def _sampler_of(loader: DataLoader[Any]) -> Any:
    """The object whose ``set_epoch`` decides the epoch's order (sampler, else batch
    sampler), or None."""
    for owner in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        if callable(getattr(owner, "set_epoch", None)) \
                and isinstance(getattr(owner, "epoch", None), int):
            return owner
    return None


def sampler_epoch(loader: DataLoader[Any]) -> int | None:
    """The epoch the loader's sampler was set to (``set_epoch``), or None without one."""
    owner = _sampler_of(loader)
    return None if owner is None else int(owner.epoch)


def _set_sampler_epoch(loader: DataLoader[Any], epoch: Any, name: str) -> None:
    owner = _sampler_of(loader)
    if owner is not None and epoch is not None and int(owner.epoch) != int(epoch):
        owner.set_epoch(int(epoch))


def _check_sampler_epoch(loader: DataLoader[Any], epoch: Any, name: str) -> None:
    """Before a resumed epoch's iterator is built: the loop may have set another epoch since
    the load; the saved epoch's order is what the uninterrupted run fed, so it is set back,
    and said."""
    live = sampler_epoch(loader)
    if live is None or epoch is None or live == int(epoch):
        return
    logger.warning("loaders[%r]: the loop set the sampler's epoch to %d, but the snapshot was "
                   "taken inside epoch %d of it; the rest of epoch %d is fed (as the "
                   "uninterrupted run did). Call set_epoch with the resumed epoch", name, live,
                   int(epoch), int(epoch))
    _set_sampler_epoch(loader, epoch, name)


def _generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The distinct ``torch.Generator`` objects the loader's iterator and samplers draw from."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, getattr(loader, "sampler", None), batch_sampler,
                  getattr(batch_sampler, "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def generator_states(loader: DataLoader[Any]) -> list[torch.Tensor]:
    """The states (uint8 CPU tensors, 5,056 bytes each) of every distinct ``torch.Generator``
    the loader and its samplers draw from (``generator=``, a sampler's own generator:
    torchdata's ``RandomSampler`` always holds one), in a fixed order."""
    return [g.get_state() for g in _generators(loader)]


def set_generator_states(loader: DataLoader[Any], states: list[torch.Tensor],
                         name: str) -> None:
    """Set the loader's generators to ``states`` (:func:`generator_states`' order).

    Raises:
        ValueError: the loader holds another number of generators than ``states`` (``name``
            names the loader); nothing is changed.
    """
    generators = _generators(loader)
    if len(generators) != len(states):
        raise ValueError(f"loaders[{name!r}]: the snapshot's loader drew from {len(states)} "
                         f"torch.Generator objects, this one from {len(generators)}; build the "
                         "loader with the same sampler and generator arguments")
    for g, state in zip(generators, states, strict=True):
        g.set_state(state)


class _Epoch:
    """One ``iter(loader)``: the generator states at the sampler's start and the batches the
    loop has received. Mutable, owned by the training thread."""

    def __init__(self) -> None:
        self.batches = 0
        self.rng: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.sampler_epoch: int | None = None  # the sampler's set_epoch at the start
        self.started = False


class _SamplerPosition:
    """Position of a plain ``DataLoader`` (module docstring)."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self._loader = loader
        self._current: _Epoch | None = None
        self._pending: Mapping[str, Any] | None = None
        self._resume_rng: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._skip = 0
        self._samplers: dict[int, _SkippingSampler] = {}
        self._name = ""

    # -- the snapshot ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        epoch = self._current
        state: dict[str, Any] = {"kind": _PLAIN, "length": len(self._loader),
                                 "batches": 0 if epoch is None else epoch.batches,
                                 "geometry": loader_geometry(self._loader)}
        sampler_epoch_now = sampler_epoch(self._loader) if epoch is None or not epoch.started \
            else epoch.sampler_epoch
        if sampler_epoch_now is not None:
            state["sampler_epoch"] = sampler_epoch_now
        if epoch is not None and epoch.rng is not None:
            state["torch_rng"] = epoch.rng[0]
            state["generators"] = list(epoch.rng[1])
        return state

    def problems(self, state: Mapping[str, Any], name: str) -> list[str]:
        if not isinstance(state, Mapping) or state.get("kind") != _PLAIN:
            kind = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
            return [f"loaders[{name!r}]: the snapshot holds the position of a {kind!r} loader, "
                    f"this run registers a plain DataLoader ({_PLAIN!r})"]
        problems = geometry_problems(state.get("geometry"), loader_geometry(self._loader), name)
        length = len(self._loader)
        if int(state["length"]) != length and not problems:
            problems.append(f"loaders[{name!r}]: the snapshot's loader had "
                            f"{int(state['length'])} batches per epoch, this one has {length}; "
                            f"use the same data, batch size and sampler")
        batches = int(state["batches"])
        if batches > 0 and "torch_rng" not in state:
            problems.append(f"loaders[{name!r}]: the snapshot records {batches} batches of an "
                            "epoch but not the generator states its order came from, so the "
                            "position cannot be restored exactly")
        elif batches > 0 and len(state["generators"]) != len(_generators(self._loader)):
            problems.append(f"loaders[{name!r}]: the snapshot's loader drew from "
                            f"{len(state['generators'])} torch.Generator objects, this one from "
                            f"{len(_generators(self._loader))}; build the loader with the same "
                            "sampler and generator arguments")
        return problems

    def load_state_dict(self, state: Mapping[str, Any], name: str) -> None:
        problems = self.problems(state, name)
        if problems:
            raise ValueError("; ".join(problems))
        self._name = name
        _set_sampler_epoch(self._loader, state.get("sampler_epoch"), name)
        if int(state["batches"]) > 0:
            self._pending = state

    # -- hooks called by the hooked loader -----------------------------------------------------
    def index_sampler(self, inner: Any) -> _SkippingSampler:
        sampler = self._samplers.get(id(inner))
        if sampler is None or sampler.inner is not inner:
            sampler = self._samplers[id(inner)] = _SkippingSampler(inner, self)
        return sampler

    def iterate(self, make: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        if pending is None:
            return self._begin(make)
        saved_rng = (pending["torch_rng"], list(pending["generators"]))
        if int(pending["batches"]) < int(pending["length"]):  # inside the saved epoch
            _check_sampler_epoch(self._loader, pending.get("sampler_epoch"), self._name)
        restored_global = torch.get_rng_state()  # what the snapshot restored: the loop's state
        if int(pending["batches"]) >= int(pending["length"]):
            try:
                self._replay_epoch(saved_rng, pending.get("sampler_epoch"))
            finally:
                torch.set_rng_state(restored_global)
            return self._begin(make)
        try:
            return self._resume(make, saved_rng, int(pending["batches"]),
                                pending.get("sampler_epoch"))
        finally:
            torch.set_rng_state(restored_global)

    def _begin(self, make: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        epoch = self._current = _Epoch()
        return _CountingIterator(make(), epoch)

    def _resume(self, make: Callable[[], Iterator[Any]],
                rng: tuple[torch.Tensor, list[torch.Tensor]], batches: int,
                saved_epoch: Any) -> Iterator[Any]:
        epoch = self._current = _Epoch()
        epoch.batches = batches
        epoch.rng = rng  # the epoch's start: what a later snapshot of this epoch must record
        epoch.sampler_epoch = None if saved_epoch is None else int(saved_epoch)
        epoch.started = True
        self._skip, self._resume_rng = batches, rng
        try:
            iterator = make()
            for sampler in self._samplers.values():
                sampler.advance()  # a single-process iterator draws its first index lazily
        finally:
            self._skip, self._resume_rng = 0, None
        return _CountingIterator(iterator, epoch)

    def _replay_epoch(self, rng: tuple[torch.Tensor, list[torch.Tensor]],
                      saved_epoch: Any) -> None:
        """The saved epoch was complete: draw its indices again (with the sampler set to that
        epoch; the loop's next epoch is set back after) so that the generators end where the
        uninterrupted run's did (``RandomSampler``'s tail ``randperm``)."""
        base = type(self._loader).__mro__[1]  # the user's loader class
        next_epoch = sampler_epoch(self._loader)
        _set_sampler_epoch(self._loader, saved_epoch, self._name)
        try:
            indices = iter(base._index_sampler.fget(self._loader))  # type: ignore[attr-defined]
            self._set_rng(rng)
            for _ in indices:
                pass
        finally:
            _set_sampler_epoch(self._loader, next_epoch, self._name)

    def sampler_started(self, epoch: _Epoch | None) -> int:
        """Called by a :class:`_SkippingIterator` before its first index; returns how many
        entries to drop."""
        if self._resume_rng is not None:
            self._set_rng(self._resume_rng)
            return self._skip
        if epoch is not None:
            epoch.rng = (torch.get_rng_state(), [g.get_state() for g in _generators(self._loader)])
            epoch.sampler_epoch, epoch.started = sampler_epoch(self._loader), True
        return 0

    def _set_rng(self, rng: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        torch_rng, states = rng
        torch.set_rng_state(torch_rng)
        generators = _generators(self._loader)
        if len(generators) != len(states):
            raise ValueError(f"the snapshot's loader drew from {len(states)} torch.Generator "
                             f"objects, this one from {len(generators)}; build the loader with "
                             f"the same sampler and generator arguments")
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)

    @property
    def current_epoch(self) -> _Epoch | None:
        return self._current


class _SkippingSampler:
    """Stands in for the loader's index sampler (``batch_sampler`` or ``sampler``): same
    length; each ``iter`` reports its start to the position and drops what it says."""

    def __init__(self, inner: Any, position: _SamplerPosition) -> None:
        self.inner = inner
        self._position = position
        self._last: _SkippingIterator | None = None

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> _SkippingIterator:
        self._last = _SkippingIterator(self.inner, self._position)
        return self._last

    def advance(self) -> None:
        if self._last is not None:
            self._last.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _SkippingIterator:
    def __init__(self, inner: Any, position: _SamplerPosition) -> None:
        self._iterator = iter(inner)
        self._position = position
        self._epoch = position.current_epoch
        self._started = False

    def __iter__(self) -> _SkippingIterator:
        return self

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        for _ in range(self._position.sampler_started(self._epoch)):
            next(self._iterator)

    def __next__(self) -> Any:
        self.start()
        return next(self._iterator)


class _CountingIterator:
    """The loader's iterator, counting the batches the loop receives."""

    def __init__(self, iterator: Iterator[Any], epoch: _Epoch) -> None:
        self._iterator = iterator
        self._epoch = epoch

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self._epoch.batches += 1
        return batch

    def __len__(self) -> int:
        return len(self._iterator)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


class _StatefulPosition:
    """Position of torchdata's ``StatefulDataLoader`` (module docstring)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._pending_generators: list[torch.Tensor] | None = None
        self._pending_mid_epoch = False
        self._pending_epoch: int | None = None
        self._name = ""

    def state_dict(self) -> dict[str, Any]:
        state = {"kind": _STATEFUL, "state": self._loader.state_dict(),
                 "generators": [g.get_state() for g in _generators(self._loader)],
                 "geometry": loader_geometry(self._loader)}
        epoch = sampler_epoch(self._loader)
        if epoch is not None:
            state["sampler_epoch"] = epoch
        return state

    def problems(self, state: Mapping[str, Any], name: str) -> list[str]:
        if not isinstance(state, Mapping) or state.get("kind") != _STATEFUL:
            kind = state.get("kind") if isinstance(state, Mapping) else type(state).__name__
            return [f"loaders[{name!r}]: the snapshot holds the position of a {kind!r} loader, "
                    f"this run registers a StatefulDataLoader ({_STATEFUL!r})"]
        return geometry_problems(state.get("geometry"), loader_geometry(self._loader), name)

    def load_state_dict(self, state: Mapping[str, Any], name: str) -> None:
        problems = self.problems(state, name)
        if problems:
            raise ValueError("; ".join(problems))
        self._name = name
        loader_state = state["state"]
        self._pending_generators = list(state.get("generators", []))
        self._pending_mid_epoch = not loader_state.get("_iterator_finished", False)
        saved_epoch = state.get("sampler_epoch")
        self._pending_epoch = None if saved_epoch is None else int(saved_epoch)
        _set_sampler_epoch(self._loader, saved_epoch, name)  # before any iterator is built
        if self._pending_mid_epoch:
            self._loader.load_state_dict(loader_state)

    def iterate(self, make: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        pending, self._pending_generators = self._pending_generators, None
        if pending is None:
            return make()
        generators = _generators(self._loader)
        if not self._pending_mid_epoch:  # the saved epoch was complete: a fresh epoch
            for g, g_state in zip(generators, pending, strict=False):
                g.set_state(g_state)
            return make()
        _check_sampler_epoch(self._loader, self._pending_epoch, self._name)
        # torchdata's resumed iterator draws a base seed (then replaces it with the saved
        # one): the loop's global and loader generators must not see that draw
        restored_global = torch.get_rng_state()
        iterator = make()
        torch.set_rng_state(restored_global)
        for g, g_state in zip(generators, pending, strict=False):
            g.set_state(g_state)
        return iterator


#: The key under which :class:`StatefulLoaderState` adds snapkeep's part to torchdata's state.
_CHECKPOINTER_KEY = "snapkeep_position"


class StatefulLoaderState:
    """``state_dict``/``load_state_dict`` of torchdata's ``StatefulDataLoader`` for the
    ``Checkpointer``: torchdata's own state plus, under ``'snapkeep_position'``, the loader's
    geometry and its sampler's epoch (module docstring).

    ``load_state_dict`` sets the sampler's epoch *before* torchdata's state is loaded, so the
    iterator the Checkpointer builds right after the load (``_start_iterators``) orders the
    resumed epoch as the uninterrupted run did; a state saved without snapkeep's part (older
    snapkeep) loads as torchdata's alone.
    """

    def __init__(self, key: str, loader: Any) -> None:
        self._key = key
        self._loader = loader

    def state_dict(self) -> dict[str, Any]:
        """torchdata's state with ``'snapkeep_position': {'geometry', 'sampler_epoch'}``."""
        state = dict(self._loader.state_dict())
        position: dict[str, Any] = {"geometry": loader_geometry(self._loader)}
        epoch = sampler_epoch(self._loader)
        if epoch is not None:
            position["sampler_epoch"] = epoch
        state[_CHECKPOINTER_KEY] = position
        return state

    def problems(self, state: Any) -> list[str]:
        """Why ``state`` cannot be loaded exactly (changes nothing)."""
        if not isinstance(state, Mapping):
            return [f"loaders[{self._key!r}]: the snapshot holds a {type(state).__name__}, "
                    "not a StatefulDataLoader state"]
        position = state.get(_CHECKPOINTER_KEY)
        if not isinstance(position, Mapping):
            return []
        return geometry_problems(position.get("geometry"), loader_geometry(self._loader),
                                 self._key)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the sampler's epoch, then load torchdata's state.

        Raises:
            ValueError: :meth:`problems` found some (nothing was changed).
        """
        problems = self.problems(state)
        if problems:
            raise ValueError("; ".join(problems))
        position = state.get(_CHECKPOINTER_KEY)
        if isinstance(position, Mapping):
            _set_sampler_epoch(self._loader, position.get("sampler_epoch"), self._key)
        self._loader.load_state_dict({k: v for k, v in state.items() if k != _CHECKPOINTER_KEY})


def is_stateful_loader(obj: Any) -> bool:
    """Whether ``obj`` is torchdata's ``StatefulDataLoader`` (or a subclass)."""
    return isinstance(obj, DataLoader) and _is_stateful(obj)
