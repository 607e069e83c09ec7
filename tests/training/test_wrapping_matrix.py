"""A manager snapshot taken from a model in one wrapping resumes into any other (saved from x
loaded into): plain, ``torch.compile`` (the real ``OptimizedModule``, eager backend, never run:
only its ``_orig_mod.`` keys matter), DDP (gloo, 1 rank), compiled DDP and DDP of a compiled
model. The file holds canonical keys; a snapshot written with prefixed keys (before) loads too."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

WRAPPINGS = ("plain", "compiled", "ddp", "compiled_ddp", "ddp_compiled")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


def _wrap(net: torch.nn.Module, how: str) -> torch.nn.Module:
    def ddp(m: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.parallel.DistributedDataParallel(m)

    def compiled(m: torch.nn.Module) -> torch.nn.Module:
        return torch.compile(m, backend="eager")

    return {"plain": lambda m: m, "compiled": compiled, "ddp": ddp,
            "compiled_ddp": lambda m: compiled(ddp(m)),
            "ddp_compiled": lambda m: ddp(compiled(m))}[how](net)


def _run(out, how: str, seed: int, iterations: int):
    net = _net(seed)
    model = _wrap(net, how)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = ExtensionsManager({"main": model}, {"main": optimizer}, 1, iters_per_epoch=100,
                                out_dir=str(out), writer=writing.SimpleWriter(out_dir=str(out)))
    snapshot = ext.snapshot(autoload=True, quiet=True)
    manager.extend(snapshot, trigger=(1, "iteration"))
    manager.start_extensions()
    data = torch.Generator().manual_seed(3)
    while manager.iteration < iterations:
        with manager.run_iteration():
            net(torch.randn(4, 4, generator=data)).pow(2).mean().backward()  # the plain net
            optimizer.step()
            optimizer.zero_grad()
    manager.finalize()
    return net, optimizer, snapshot


def _state(net, optimizer):
    return ({k: v.clone() for k, v in net.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()}
             for i, s in optimizer.state_dict()["state"].items()})


@pytest.mark.parametrize(("saved", "loaded"), list(itertools.product(WRAPPINGS, WRAPPINGS)))
def test_resume_across_wrappings(tmp_path, process_group, saved, loaded):
    net, optimizer, _ = _run(tmp_path, saved, seed=0, iterations=2)
    want_model, want_opt = _state(net, optimizer)
    stored = torch.load(tmp_path / "snapshot_iter_2", weights_only=True)
    assert list(stored["models"]["main"]) == list(want_model)  # canonical: no wrapper atoms

    resumed, resumed_opt, snapshot = _run(tmp_path, loaded, seed=1, iterations=2)
    assert snapshot.loaded_entry.name == "snapshot_iter_2"
    got_model, got_opt = _state(resumed, resumed_opt)
    assert got_model.keys() == want_model.keys()
    assert all(torch.equal(got_model[k], want_model[k]) for k in want_model)
    assert got_opt.keys() == want_opt.keys() and all(
        torch.equal(got_opt[i][k], want_opt[i][k]) for i in want_opt for k in want_opt[i])


PREFIXES = {"ddp": "module.", "compiled": "_orig_mod.", "ddp_compiled": "module._orig_mod.",
            "compiled_ddp": "_orig_mod.module."}


@pytest.mark.parametrize(("saved", "loaded"), list(itertools.product(PREFIXES, WRAPPINGS)))
def test_a_snapshot_with_prefixed_keys_still_loads(tmp_path, process_group, saved, loaded):
    model = _wrap(_net(0), saved)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = ExtensionsManager({"main": model}, {"main": optimizer}, 1, iters_per_epoch=100,
                                out_dir=str(tmp_path))
    state = manager.state_dict()  # the manager's own state_dict: keys as the wrapping has them
    assert all(k.startswith(PREFIXES[saved]) for k in state["models"]["main"])
    writing.SimpleWriter(out_dir=str(tmp_path))("snapshot_iter_0", str(tmp_path), state)
    resumed, _, snapshot = _run(tmp_path, loaded, seed=1, iterations=0)
    assert snapshot.loaded_entry.name == "snapshot_iter_0"
    want = _net(0).state_dict()
    assert all(torch.equal(resumed.state_dict()[k], want[k]) for k in want)


def test_inspect_and_diff_show_canonical_names(tmp_path, process_group):
    from click.testing import CliRunner

    from snapkeep.cli import cli

    model = _wrap(_net(0), "compiled_ddp")
    old = {k: v.clone() for k, v in model.state_dict().items()}  # written before: prefixed
    assert next(iter(old)).startswith("_orig_mod.module.")
    writer = writing.SimpleWriter(out_dir=str(tmp_path))
    writer("old", str(tmp_path), old)
    ddp = _wrap(_net(0), "ddp")
    manager = ExtensionsManager({"main": ddp}, {}, 1, iters_per_epoch=1,
                                out_dir=str(tmp_path), writer=writer)
    manager.extend(ext.snapshot_object(ddp, "new_{.iteration}"),
                   trigger=(1, "iteration"))
    with manager.run_iteration():
        pass
    manager.finalize()
    runner = CliRunner()
    shown = runner.invoke(cli, ["inspect", "--json", str(tmp_path / "old")])
    assert shown.exit_code == 0, shown.output
    import json

    keys = [row["key"] for row in json.loads(shown.output)["keys"]]
    assert keys == list(_net(0).state_dict())
    compared = runner.invoke(cli, ["diff", str(tmp_path / "old"), str(tmp_path / "new_1")])
    assert compared.exit_code == 0, compared.output
    assert f"\nequal: {len(keys)} of {len(keys)} common tensors equal, 0 only in A" \
        in compared.output


@pytest.mark.parametrize("loaded", WRAPPINGS)
def test_manager_load_state_dict_of_a_canonical_snapshot(tmp_path, process_group, loaded):
    _run(tmp_path, "plain", seed=0, iterations=1)
    model = _wrap(_net(1), loaded)
    manager = ExtensionsManager({"main": model}, {}, 1, iters_per_epoch=100,
                                out_dir=str(tmp_path / "other"))
    state = torch.load(tmp_path / "snapshot_iter_1", weights_only=True)
    manager.load_state_dict({**state, "optimizers": {}})  # torch.load + load_state_dict, by hand
    assert all(torch.equal(model.state_dict()[live], state["models"]["main"][key])
               for live, key in zip(model.state_dict(), state["models"]["main"], strict=True))


def test_a_single_file_snapshot_of_an_fsdp2_model_is_refused_with_the_way_out(tmp_path,
                                                                               process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = _net(0)
    fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
    manager = ExtensionsManager({"main": net}, {}, 1, iters_per_epoch=100, out_dir=str(tmp_path))
    manager.extend(ext.snapshot(autoload=True))
    with pytest.raises(TypeError, match=r"models\['main'\] holds DTensor parameters .*"
                                        r"SnapshotMode.SHARDED"):
        manager.start_extensions()
    assert list(tmp_path.iterdir()) == []  # refused before the store was touched
