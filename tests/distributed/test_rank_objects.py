"""Non-tensor state is per rank in sharded snapshots (the manager's ``SnapshotMode.SHARDED`` and
the sharded ``Checkpointer``): saved on 2 gloo ranks, each rank resumes its own value; a rank
that did not exist at save time takes rank 0's, with one warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed

from support.ranks import reports, run

WORKER = Path(__file__).with_name("rank_objects_worker.py")
TIMEOUT_S = 150

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is not available")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """3 iterations on 2 ranks, each rank's values its own (``1000 * rank + step``)."""
    base = tmp_path_factory.mktemp("rank_objects")
    out = base / "out"
    run(WORKER, 2, [str(base / "init"), str(out), str(base), "save"], timeout_s=TIMEOUT_S)
    return out


def _resume(out: Path, tmp_path: Path, world_size: int) -> list[dict]:
    run(WORKER, world_size, [str(tmp_path / "init"), str(out), str(tmp_path), "resume"],
        timeout_s=TIMEOUT_S)
    return reports(tmp_path, "resume", world_size)


def test_each_rank_resumes_its_own_non_tensor_state(saved, tmp_path):
    for report in _resume(saved, tmp_path, 2):
        rank = report["rank"]
        assert report["tally"] == 1000 * rank + 3, report  # the manager's state object
        assert report["checkpointer"] == {  # a plain value and a state_dict object
            "metrics": {"rank": rank, "seen": [rank] * 3}, "counter": 1000 * rank + 3}, report
        assert report["warnings"] == [], report


def test_a_rank_added_since_takes_rank_0s_values_with_one_warning(saved, tmp_path):
    resumed = _resume(saved, tmp_path, 3)
    for report in resumed[:2]:
        rank = report["rank"]
        assert report["tally"] == 1000 * rank + 3, report
        assert report["checkpointer"]["counter"] == 1000 * rank + 3, report
        assert report["warnings"] == [], report
    added = resumed[2]
    assert added["tally"] == 3
    assert added["checkpointer"] == {"metrics": {"rank": 0, "seen": [0] * 3}, "counter": 3}
    # one warning per path (the manager's snapshot, the Checkpointer), naming rank 0
    assert len(added["warnings"]) == 2, added["warnings"]
    assert all("rank 2" in w and "rank 0's" in w for w in added["warnings"]), added["warnings"]


def _write_old_layout(monkeypatch: pytest.MonkeyPatch, rank_local: tuple[str, ...] = ()) -> None:
    """From now on sharded saves write the layout of snapkeep before values were per rank:
    ``objects.<name>`` (one copy for all ranks); the Checkpointer's ``rank_local`` values (data
    loaders, generators) inside ``rank_state.rank<r>`` as ``{"state": ..., "rng": ...}``."""
    from snapkeep._core.distributed.sharded import (
        ShardedSaver,
        object_from_bytes,
        object_to_bytes,
    )

    save = ShardedSaver.save

    def old_save(self, state, job, **options):
        state = dict(state)
        ((rank, values),) = state.pop("rank_objects").items()
        state["objects"] = {k: v for k, v in values.items() if k not in rank_local}
        if rank_local:  # the Checkpointer's
            rng = object_from_bytes(state["rank_state"][rank], False)["rng"]
            own = {k: object_from_bytes(values[k], False) for k in rank_local}
            state["rank_state"] = {rank: object_to_bytes({"state": own, "rng": rng})}
        return save(self, state, job, **options)

    monkeypatch.setattr(ShardedSaver, "save", old_save)


def test_a_snapshot_of_the_shared_layout_still_loads(tmp_path, monkeypatch):
    """Single process: snapshots written with ``objects.<name>`` (and the Checkpointer's data
    loaders and generators in ``rank_state``) load into the manager and the Checkpointer."""
    import snapkeep
    from snapkeep import writing
    from snapkeep.distributed import saved_keys
    from snapkeep.training import ExtensionsManager
    from snapkeep.training import extensions as ext

    def manager(out: Path, iterations: int):
        model = torch.nn.Linear(4, 2)
        tally = _Tally()
        m = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                              iters_per_epoch=100, out_dir=str(out), state_objects={"tally": tally},
                              writer=writing.SimpleWriter(out_dir=str(out)))
        snapshot = ext.snapshot(snapshot_mode=ext.SnapshotMode.SHARDED, autoload=True, quiet=True)
        m.extend(snapshot, trigger=(1, "iteration"))
        m.start_extensions()
        while m.iteration < iterations:
            with m.run_iteration(step_optimizers=["main"]):
                model(torch.ones(2, 4)).sum().backward()
                tally.value = 10 + m.iteration  # iteration 0, 1 of the run: 10, 11
        m.finalize()
        return m, tally, snapshot

    def checkpointer(out: Path, save: bool):
        gen = torch.Generator().manual_seed(5)
        state = {"model": torch.nn.Linear(4, 2), "metrics": {"loss": -1.0}, "counter": _Tally(),
                 "gen": gen}
        with snapkeep.Checkpointer(out, sharded=True) as ckpt:
            if save:
                state["metrics"] = {"loss": 0.5}
                state["counter"].value = 7
                torch.rand(3, generator=gen)
                ckpt.save(1, state)
                return state, torch.rand(3, generator=gen)
            ckpt.load(into=state)
            return state, torch.rand(3, generator=gen)

    with monkeypatch.context() as patch:
        _write_old_layout(patch)
        manager(tmp_path / "m", 2)
    with monkeypatch.context() as patch:
        _write_old_layout(patch, rank_local=("gen",))
        _, after = checkpointer(tmp_path / "c", save=True)
    m, tally, snapshot = manager(tmp_path / "m", 2)
    assert "objects.manager" in saved_keys(snapshot._sharded_store, snapshot.loaded_entry)
    assert (m.iteration, tally.value) == (2, 11)  # snapshot_iter_2 loaded
    state, drawn = checkpointer(tmp_path / "c", save=False)
    assert state["metrics"] == {"loss": 0.5} and state["counter"].value == 7
    assert torch.equal(drawn, after)  # the generator, from rank_state.rank0["state"]


class _Tally:
    def __init__(self) -> None:
        self.value = -1

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
