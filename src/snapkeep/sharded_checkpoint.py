"""The sharded side of :class:`snapkeep.Checkpointer`: one snapshot = one DCP directory.

Under torchrun (or with ``Checkpointer(..., sharded=True)``) every rank saves and loads together
through ``torch.distributed.checkpoint`` (DCP), as the manager's ``SnapshotMode.SHARDED`` does
and with its engine (:class:`snapkeep.distributed.ShardedSaver`): each rank stages its shards,
writes its own files, rank 0 writes the marker (every file's checksum) last, and retention runs
on rank 0 after the commit. Resuming, all ranks agree on the newest snapshot every rank can verify
(falling back together past a corrupt one), and DCP reshards it to the current world size.

Layout of the DCP state (keys of ``state`` as given to :meth:`Checkpointer.save`)::

    models.<key>.<fqn>            modules: get_model_state_dict (DTensor shards under FSDP2)
    optimizers.<key>....          optimizers: get_optimizer_state_dict with the module owning
                                  their parameters
    rank_objects.rank<r>.<key>    bytes: torch.save of rank r's value of every other key --
                                  its state_dict (LR schedulers, GradScaler, data loaders, your
                                  objects), a generator's state, or the plain value (numbers,
                                  metric dicts) -- restored on rank r
    rank_state.rank<r>            bytes: {"rng": rank r's global RNG states} (with rng=True)

Every non-tensor value is per rank: each rank saves its own and loads it back. A rank added
since the save (the world grew) has none: it takes rank 0's values and starts its global random
streams from their current state, with one warning. Snapshots written before values were per
rank hold ``objects.<key>`` (one copy, loaded on every rank) and ``rank_state.rank<r>`` as
``{"state": {data loaders, generators}, "rng": ...}``; they still load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from snapkeep.distributed import (
    Groups,
    RankObjects,
    ShardedJob,
    ShardedManifest,
    ShardedSaver,
    ShardedStore,
    all_gather,
    background_groups,
    exchange_outcomes,
    is_distributed,
    object_from_bytes,
    object_to_bytes,
    optimizer_module,
)
from snapkeep.errors import NoValidSnapshotError, SnapshotError
from snapkeep.layout import RngState, StatefulLoaderState, is_stateful_loader
from snapkeep.retention import RetentionPolicy, best_metrics
from snapkeep.session import RunLineage, Session
from snapkeep.store import Entry, FilenameTemplate, Storage
from snapkeep.tiers import check_into_live, copy_into_live, flat_keys, local_shards

logger = logging.getLogger(__name__)


class ShardedCheckpoint:
    """The DCP-backed snapshots of one Checkpointer (see the module docstring). Every method
    is collective: every rank calls it, in the same order.

    Args:
        storage, directory: where the snapshot directories go.
        template: the Checkpointer's template (its names are directories here).
        policy: retention, or None.
        lineage: the run lineage (the Checkpointer's fixed one: see
            :data:`snapkeep.checkpointer.RUN_ID`); default a fresh one.
        rng: save and restore each rank's global generators.
        claim: run on rank 0 once the process groups exist, before the store's start-up (the
            Checkpointer's check for another open one in this process); its failure is raised
            on every rank.
        weights_only: unpickle the non-tensor state with ``torch.load(weights_only=True)``.
        timeout_s: bound of every collective, seconds.
        storage_options: fsspec options (object stores).
    """

    def __init__(self, storage: Storage, directory: str, template: FilenameTemplate, *,
                 policy: RetentionPolicy | None, rng: bool, weights_only: bool, timeout_s: float,
                 storage_options: Mapping[str, Any] | None = None,
                 claim: Callable[[], None] | None = None,
                 lineage: RunLineage | None = None) -> None:
        self.groups: Groups | None = background_groups(timeout_s) if is_distributed() else None
        self.rank = self.groups.rank if self.groups else 0
        self.store = ShardedStore(storage, directory, template,
                                  storage_options=dict(storage_options or {}))
        # the engine session (as the snapshot extension's): on rank 0 the claim, the lock, one
        # listing, the kind check and the sweep of snapkeep's own crashed saves, its outcome
        # heard by every rank; the lineage and the retention input check
        self.session = Session(self.store, policy=policy, lineage=lineage)
        self._incomplete: list[Entry] = []

        def note_incomplete(store: Any) -> None:  # named in the resume notice
            self._incomplete = store.uncommitted()

        self.session.open(opener=self.rank == 0, claim=claim,
                          control=self.groups.control if self.groups else None,
                          timeout_s=self.groups.timeout_s if self.groups else None,
                          before_sweep=note_incomplete)
        self._policy = policy
        self._rng = rng
        self._weights_only = weights_only
        retain = self._retain if self.rank == 0 and policy is not None else None
        # the saver is drained at interpreter exit (snapkeep._core.save.exit_drain) if not closed
        self.saver = ShardedSaver(self.store, self.groups, retain=retain)

    # -- saving --------------------------------------------------------------------------------
    def save(self, name: str, step: int, state: Mapping[str, Any], version: str, *,
             metrics: Mapping[str, float] | None = None) -> Any:
        """Stage this rank's part of ``state`` and commit it in the background; returns the
        handle (``staged`` done, ``committed`` when the marker is durable). ``metrics``:
        recorded in the marker's manifest (KeepBest ranks by them)."""
        tree = self.tree(state)
        self._check_retention_input(name, step, dict(metrics or {}))
        job = ShardedJob(name=name, step=step, run_id=self.session.lineage.run_id,
                         metrics=dict(metrics or {}), version=version)
        handle = self.saver.save(tree, job)
        self._last = (self.store.path_of(name), handle)
        return handle

    def tree(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's DCP state of ``state`` (the layout in the module docstring)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        models = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
        tree: dict[str, Any] = {"models": {}, "optimizers": {}}
        own: dict[str, bytes] = {}
        for key, value in state.items():
            if isinstance(value, torch.nn.Module):
                tree["models"][key] = get_model_state_dict(value)
            elif isinstance(value, torch.optim.Optimizer):
                tree["optimizers"][key] = get_optimizer_state_dict(
                    _model_of(value, models, key), value)
            elif isinstance(value, torch.Generator):
                own[key] = object_to_bytes(value.get_state())
            elif is_stateful_loader(value):  # with its geometry and sampler epoch
                own[key] = object_to_bytes(StatefulLoaderState(key, value).state_dict())
            elif callable(getattr(value, "state_dict", None)):
                own[key] = object_to_bytes(value.state_dict())
            else:
                own[key] = object_to_bytes(value)
        tree.update(RankObjects.tree(self.rank, own))
        if self._rng:
            tree["rank_state"] = {f"rank{self.rank}": object_to_bytes(
                {"rng": RngState().state_dict()})}
        return tree

    def _check_retention_input(self, name: str, step: int, metrics: dict[str, float]) -> None:
        """The retention input check before anything is staged: rank 0 (which runs retention)
        checks, every rank hears the outcome (a ``KeepBest`` metric no snapshot records:
        ValueError on rank 0, RankFailedError naming it on the others; nothing written)."""
        if self._policy is None or not best_metrics(self._policy):
            return
        error: ValueError | None = None
        if self.rank == 0:
            try:
                self.session.check_retention_input(name, step, metrics)
            except ValueError as e:
                error = e
        if self.groups is None:
            if error is not None:
                raise error
            return
        try:
            exchange_outcomes(self.groups.control, error,
                              what=f"checking the retention policy before {name}",
                              timeout_s=self.groups.timeout_s)
        except Exception:
            if error is not None:
                raise error from None
            raise

    def _retain(self, manifest: ShardedManifest) -> None:
        """Retention on rank 0 after a commit (whole directories), through the store as the
        single-file Checkpointer's: among this lineage's snapshots only, and a ``KeepBest``
        metric no manifest of them records is a ValueError naming the metrics they record
        (nothing deleted; logged by the saver, never fatal)."""
        if self._policy is not None:
            self.store.retain(self._policy, self.session.lineage.members,
                              protect=[self.store.path_of(manifest.name)])

    def verify(self, step: int) -> Entry:
        """Verify the committed snapshot of ``step`` on every rank together: the ranks first
        agree that they all name ``step``, then each checks its share of the files against the
        marker's checksums (file ``i`` by rank ``i % world_size``, ``.metadata`` by all: see
        :meth:`~snapkeep.distributed.ShardedStore.verify_part`), and every rank hears every
        outcome. Reads each file once across the ranks.

        Returns:
            The verified snapshot's entry.

        Raises:
            ValueError: the ranks name different steps (every rank raises, naming them all).
            NoValidSnapshotError: this rank finds no committed snapshot of ``step``
                (single process; under torch.distributed every rank raises RankFailedError).
            SnapshotCorruptError: a file is missing, truncated or differs from its checksum
                (single process; RankFailedError naming the rank elsewhere).
            RankFailedError, CollectiveTimeoutError: a rank failed or did not take part.
        """
        group = self.groups.control if self.groups else None
        timeout_s = self.groups.timeout_s if self.groups else None
        steps = all_gather(group, step, what=f"verifying step {step}", timeout_s=timeout_s)
        if len(set(steps)) > 1:
            raise ValueError(f"the ranks verify different steps (by rank: {steps}); every rank "
                             "must name the same step")
        error: Exception | None = None
        entry: Entry | None = None
        try:
            found = [e for e in self.entries() if e.step == step]
            if not found:
                raise NoValidSnapshotError(
                    f"no committed snapshot of step {step} in {self.store.directory!r} on rank "
                    f"{self.rank}; steps there: {[e.step for e in self.entries()][-20:]}")
            entry = found[-1]
            self.store.verify_part(entry, self.rank, self.groups.world_size if self.groups
                                   else 1)
        except (SnapshotError, OSError) as e:
            error = e
        if group is None and error is not None:
            raise error
        exchange_outcomes(group, error, what=f"verifying the snapshot of step {step}",
                          timeout_s=timeout_s)  # every rank raises if any failed
        if entry is None:  # unreachable: a rank without it failed above
            raise NoValidSnapshotError(f"no committed snapshot of step {step}")
        return entry

    # -- loading ---------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Committed snapshot directories, oldest first."""
        return self.store.entries()

    def load(self, into: MutableMapping[str, Any], objects: Mapping[str, Any],
             entries: list[Entry], *,
             before_rng: Callable[[Mapping[str, Any]], None]) -> Entry | None:
        """Agree on the newest of ``entries`` every rank verifies, load it into ``objects``
        (resharded) and return it; ``None`` when ``entries`` is empty.

        ``before_rng(objects)`` runs after the data positions are loaded and before the global
        generators are restored (the Checkpointer starts data loader iterators there).

        Raises:
            NoCommonSnapshotError: snapshots exist but none verifies on every rank.
            RankFailedError: preparing or loading failed on some rank (named); every rank
                raises, before anything was applied to the live objects.
        """
        values = [k for k, v in objects.items()
                  if not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]
        plans: list[RankObjects] = []

        def build(entry: Entry, keys: set[str]) -> dict[str, Any]:
            template, plan = self._template(objects, keys, f"snapshot {entry.path}")
            plans[:] = [plan]
            return template

        def apply(entry: Entry, template: dict[str, Any]) -> None:
            self._set_sharded(objects, template)
            applied.append(template)

        applied: list[dict[str, Any]] = []

        def problems(entry: Entry, loaded: dict[str, Any]) -> list[str]:
            """A torchdata StatefulDataLoader's saved position that does not fit it (its
            geometry changed), found before any tensor is loaded into the live objects."""
            found: list[str] = []
            for key, data in plans[0].loaded(loaded).items() if loaded else ():
                if is_stateful_loader(objects.get(key)):
                    saved = object_from_bytes(data, self._weights_only)
                    found += StatefulLoaderState(key, objects[key]).problems(saved)
            return found

        check_loaders = any(is_stateful_loader(v) for v in objects.values())
        entry = self.session.resume_sharded(
            groups=self.groups, rank=self.rank, build=build, apply=apply,
            weights_only=self._weights_only, candidates=entries, incomplete=self._incomplete,
            values=lambda built: plans[0].template(),
            problems=problems if check_loaders else None)
        if entry is None:
            return None
        self._set_values(into, objects, entry, applied[0], plans[0], values, before_rng)
        return entry

    def _template(self, objects: Mapping[str, Any], keys: set[str],
                  what: str) -> tuple[dict[str, Any], RankObjects]:
        """What a snapshot (or RAM snapshot: ``what``) holding the flattened ``keys`` loads
        into on this rank: DCP's state dicts of the live modules and optimizers, and this
        rank's values; with the plan of its per-rank values.

        Raises:
            KeyError: it holds no value of a key of ``objects`` for this rank.
        """
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        models = {k: v for k, v in objects.items() if isinstance(v, torch.nn.Module)}
        values = [k for k, v in objects.items()
                  if not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]
        template: dict[str, Any] = {
            "models": {k: get_model_state_dict(m) for k, m in models.items()},
            "optimizers": {k: get_optimizer_state_dict(_model_of(o, models, k), o)
                           for k, o in objects.items()
                           if isinstance(o, torch.optim.Optimizer)},
        }
        own = f"rank{self.rank}"
        if f"rank_state.{own}" in keys:
            template["rank_state"] = {own: b""}
        plan = RankObjects.of(keys, values, self.rank)
        # a snapshot from before values were per rank keeps data loaders and generators
        # in rank_state.rank<r>: those are found there (or warned about) once it is loaded
        before = not any(k.startswith("rank_objects.") for k in keys)
        missing = [k for k in plan.missing
                   if not (before and isinstance(objects[k], (torch.utils.data.DataLoader,
                                                              torch.Generator)))]
        if missing:
            raise KeyError(f"{what} holds no {missing} of rank {self.rank}; nothing was loaded")
        template.update(plan.template())
        return template, plan

    @staticmethod
    def _set_sharded(objects: Mapping[str, Any], template: dict[str, Any]) -> None:
        """Set the modules and optimizers of ``objects`` from a filled template."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        models = {k: v for k, v in objects.items() if isinstance(v, torch.nn.Module)}
        for key, model in models.items():
            set_model_state_dict(model, template["models"][key])
        for key, optim in objects.items():
            if isinstance(optim, torch.optim.Optimizer):
                set_optimizer_state_dict(_model_of(optim, models, key), optim,
                                         template["optimizers"][key])

    def _set_values(self, into: MutableMapping[str, Any], objects: Mapping[str, Any],
                    entry: Entry, template: dict[str, Any], plan: RankObjects,
                    values: list[str], before_rng: Callable[[Mapping[str, Any]], None]) -> None:
        """Set this rank's values, data positions and generators from a filled template."""
        rank_bytes = template.get("rank_state", {}).get(f"rank{self.rank}")
        rank_state = object_from_bytes(rank_bytes, self._weights_only) if rank_bytes else {}
        saved = {k: object_from_bytes(data, self._weights_only)
                 for k, data in plan.loaded(template).items()}
        saved.update({k: v for k, v in rank_state.get("state", {}).items() if k in objects})
        for key, obj in objects.items():  # in the order of ``into``, as a single-file load
            if key not in saved:
                continue
            value = saved[key]
            if isinstance(obj, torch.Generator):
                obj.set_state(value)
            elif is_stateful_loader(obj):  # its sampler's epoch before torchdata's state
                StatefulLoaderState(key, obj).load_state_dict(value)
            elif callable(getattr(obj, "load_state_dict", None)):
                obj.load_state_dict(value)
            else:
                into[key] = value
        before_rng(objects)
        if self._rng and "rng" in rank_state:
            RngState().load_state_dict(rank_state["rng"])
        not_restored = [k for k in values if k not in saved]  # older layout, rank added since
        no_rng = self._rng and "rng" not in rank_state
        if plan.from_rank0 or (not plan.own and not rank_bytes and (not_restored or no_rng)):
            said = [f"its values {list(plan.from_rank0)} are rank 0's" if plan.from_rank0 else "",
                    f"{not_restored} start from their current state" if not_restored else "",
                    "its global random streams start from their current state"
                    if no_rng else ""]  # one warning for all of it
            logger.warning("rank %d: %s holds no state of this rank (saved on fewer ranks); %s",
                           self.rank, entry.path, "; ".join(p for p in said if p))
        elif no_rng:
            logger.warning("rank %d: %s holds no RNG state (saved with rng=False); the global "
                           "generators were not restored", self.rank, entry.path)

    # -- the memory tier -------------------------------------------------------------------------
    def memory_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's RAM snapshot of ``state`` for the memory tier: :meth:`tree` with every
        DTensor replaced by its local shard (a view, no copy)."""
        return local_shards(self.tree(state))

    def memory_prepare(self, objects: Mapping[str, Any], state: dict[str, Any]) -> Any:
        """Check ``state`` (this rank's RAM snapshot) against the live state of ``objects``
        (same keys, each tensor the shape and dtype of the live local shard) and return what
        :meth:`memory_apply` takes.

        Raises:
            ValueError, KeyError: the differences (another world size, sharding or model).
        """
        template, plan = self._template(objects, flat_keys(state), "the RAM snapshot")
        check_into_live(template, state)
        return template, plan, state

    def memory_apply(self, into: MutableMapping[str, Any], objects: Mapping[str, Any],
                     prepared: Any, step: int, path: str, *,
                     before_rng: Callable[[Mapping[str, Any]], None]) -> None:
        """Copy a RAM snapshot checked by :meth:`memory_prepare` into the live local shards
        in place, then set ``objects`` from it as :meth:`load` does."""
        template, plan, state = prepared
        copy_into_live(template, state)
        self._set_sharded(objects, template)
        values = [k for k, v in objects.items()
                  if not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]
        entry = Entry(name=path.rsplit("/", 1)[-1], path=path, key=(float(step),), step=step)
        self._set_values(into, objects, entry, template, plan, values, before_rng)

    def wait(self) -> None:
        """Wait until the snapshot in flight is committed on every rank (its error raised)."""
        self.saver.wait()

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the snapshot in flight (at most ``timeout_s`` seconds), then stop the
        commit thread; idempotent.

        Raises:
            SnapshotTimeoutError: still not committed after ``timeout_s``.
            Exception: the commit's error (once).
        """
        self.saver.close(timeout_s)


def _model_of(optimizer: torch.optim.Optimizer, models: Mapping[str, torch.nn.Module],
              key: str) -> torch.nn.Module:
    model = optimizer_module(optimizer, models)
    if model is not None:
        return model
    raise ValueError(f"state[{key!r}] optimizes no parameter of the modules in state "
                     f"{sorted(models)}; sharded snapshots save an optimizer with its module: "
                     "put the module into state too")



__all__ = ["ShardedCheckpoint"]
