"""snapkeep.Checkpointer, the front door for plain loops (issue 20): real files, the real store
lock, retention, checksums with fallback, all-or-nothing loads, first runs and templates."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import snapkeep
from snapkeep.errors import NoValidSnapshotError, StateMismatchError, StoreLockedError
from snapkeep.retention import AnyOf, KeepBest, KeepEvery, KeepLatest

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {
        "model": model, "optim": optim,
        "sched": torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", init_scale=2.0 ** (seed + 4)),
        "gen": torch.Generator().manual_seed(seed),
        "data": StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True,
                                   generator=torch.Generator().manual_seed(seed)),
        "epoch": seed,
    }


def _train(state: dict[str, Any], steps: int) -> Any:
    it = iter(state["data"])
    for _ in range(steps):
        batch = next(it).float()
        state["optim"].zero_grad()
        loss = state["model"](batch[:, None].expand(-1, 8)).pow(2).mean()
        state["scaler"].scale(loss).backward()
        state["scaler"].step(state["optim"])
        state["scaler"].update()
        state["sched"].step()
        torch.randint(0, 10, (3,), generator=state["gen"])
    return it


def test_save_then_load_restores_every_kind_of_object(tmp_path: Any) -> None:
    state = _objects(1)
    it = _train(state, 3)
    with snapkeep.Checkpointer(tmp_path / "ck") as ckpt:
        handle = ckpt.save(3, state)
        assert handle is not None and handle.staged.done()
        record = handle.wait(timeout_s=60)
        assert record.step == 3
    expected_batch = next(it)
    expected_draw = torch.randint(0, 1000, (4,), generator=state["gen"])
    expected_global = torch.rand(3)

    fresh = _objects(2)
    assert not torch.equal(fresh["model"].weight, state["model"].weight)  # differs before
    torch.rand(5)  # the global generator moves on; the load puts it back
    with snapkeep.Checkpointer(tmp_path / "ck") as ckpt:
        assert ckpt.latest_step() == 3 and ckpt.all_steps() == [3]
        assert ckpt.load(into=fresh) == 3
    assert torch.equal(fresh["model"].weight, state["model"].weight)
    assert fresh["optim"].state_dict()["state"][0]["exp_avg"].equal(
        state["optim"].state_dict()["state"][0]["exp_avg"])
    assert fresh["sched"].state_dict() == state["sched"].state_dict()
    assert fresh["scaler"].state_dict() == state["scaler"].state_dict()
    assert fresh["epoch"] == 1  # a plain value is replaced in the mapping, as dcp.load does
    assert torch.equal(next(iter(fresh["data"])), expected_batch)
    assert torch.equal(torch.randint(0, 1000, (4,), generator=fresh["gen"]), expected_draw)
    assert torch.equal(torch.rand(3), expected_global)  # rng=True restored the global one
    saved = torch.load(tmp_path / "ck" / "ckpt_3", weights_only=True)  # a plain torch file
    assert saved["format"] == snapkeep.checkpointer.FORMAT and saved["step"] == 3


def test_keep_retains_the_newest_and_every_skips_other_steps(tmp_path: Any) -> None:
    state = {"model": torch.nn.Linear(2, 2)}
    with snapkeep.Checkpointer(tmp_path, keep=2, every=5, template="{step:08d}.pt") as ckpt:
        saved = [s for s in range(1, 31) if ckpt.save(s, state) is not None]
        assert saved == [5, 10, 15, 20, 25, 30]
        assert ckpt.should_save(35) and not ckpt.should_save(36)
        assert ckpt.save(31, state, force=True) is not None
        ckpt.wait()
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "00000030.pt", "00000031.pt"]
    with snapkeep.Checkpointer(tmp_path, keep=KeepEvery(10), template="{step:08d}.pt") as ckpt:
        ckpt.save(40, state)
        ckpt.save(41, state)
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "00000030.pt", "00000040.pt",
                                            "00000041.pt"]


LOSSES = {1: 0.9, 2: 0.4, 3: 0.7, 4: 0.2, 5: 0.8, 6: 0.6}


@pytest.mark.parametrize("sharded", [False, True])
def test_keep_best_ranks_by_the_metrics_given_to_save(tmp_path: Any, sharded: bool) -> None:
    state = {"model": torch.nn.Linear(2, 2)}
    keep = AnyOf(KeepLatest(1), KeepBest(2, "val_loss"))
    with snapkeep.Checkpointer(tmp_path, keep=keep, sharded=sharded) as ckpt:
        for step, loss in LOSSES.items():
            ckpt.save(step, state, metrics={"val_loss": torch.tensor(loss), "epoch": step})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 4, 6]  # the two lowest losses and the newest


@pytest.mark.parametrize(("metrics", "error", "words"), [
    ([("loss", 1.0)], TypeError, "metrics must be a mapping"),
    ({1: 1.0}, TypeError, "metrics keys must be str"),
    ({"loss": "low"}, TypeError, "metrics['loss'] must be an int, float"),
    ({"loss": torch.ones(2)}, TypeError, "metrics['loss'] must be an int, float"),
    ({"loss": float("nan")}, ValueError, "metrics['loss'] must be finite"),
])
def test_bad_metrics_are_named_and_nothing_is_saved(tmp_path: Any, metrics: Any, error: Any,
                                                    words: str) -> None:
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
        with pytest.raises(error, match=words.replace("[", r"\[").replace("(", r"\(")):
            ckpt.save(2, {"w": torch.ones(2)}, metrics=metrics)
        ckpt.wait()
        assert ckpt.all_steps() == [1]


@pytest.mark.parametrize("first_sharded", [False, True])
def test_mixed_kinds_under_one_template_are_refused_at_start(tmp_path: Any,
                                                             first_sharded: bool) -> None:
    state = {"model": torch.nn.Linear(2, 2)}
    with snapkeep.Checkpointer(tmp_path, sharded=first_sharded) as ckpt:
        ckpt.save(1, state)
    before = sorted(os.listdir(tmp_path))
    other = "sharded snapshot directories" if first_sharded else "single-file snapshots"
    with pytest.raises(ValueError, match=f"template 'ckpt_{{step}}' in .* already names 1 "
                                         f"{other} \\(e.g. 'ckpt_1'\\)"):
        snapkeep.Checkpointer(tmp_path, sharded=not first_sharded)
    assert sorted(os.listdir(tmp_path)) == before
    with snapkeep.Checkpointer(tmp_path, sharded=not first_sharded, template="other_{step}"):
        pass  # another template in the same directory is fine


def test_two_checkpointers_on_one_directory_are_refused(tmp_path: Any) -> None:
    with snapkeep.Checkpointer(tmp_path) as first:
        with pytest.raises(StoreLockedError, match="another open Checkpointer"):
            snapkeep.Checkpointer(tmp_path)
        other_process = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(f"""
                import snapkeep, sys
                try:
                    snapkeep.Checkpointer({str(tmp_path)!r})
                except snapkeep.StoreLockedError as e:
                    sys.exit(f"StoreLockedError: {{e}}")
            """)], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
            capture_output=True, text=True, timeout=60, check=False)
        assert other_process.returncode == 1
        assert other_process.stderr.startswith("StoreLockedError")
        assert f"pid {os.getpid()}" in other_process.stderr
        first.save(1, {"x": torch.zeros(1)})
    with snapkeep.Checkpointer(tmp_path) as again:  # closed: the directory is free
        assert again.latest_step() == 1


def test_corrupt_newest_falls_back_with_a_warning(tmp_path: Any, capfd: Any) -> None:
    model = torch.nn.Linear(2, 2)
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(step)
            ckpt.save(step, {"model": model})
    with open(tmp_path / "ckpt_2", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    fresh = torch.nn.Linear(2, 2)
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        capfd.readouterr()
        assert ckpt.load(into={"model": fresh}) == 1
        err = capfd.readouterr().err.splitlines()  # the fallback is said on stderr, once
        assert err[0] == f"snapkeep: resuming from ckpt_1 (step 1) in {tmp_path}"
        assert err[1].startswith(f"snapkeep: skipped ckpt_2 (step 2): {tmp_path / 'ckpt_2'}: "
                                 "xxh3_128 checksum ") and len(err) == 2
        assert torch.equal(fresh.weight, torch.ones(2, 2))
        with pytest.raises(NoValidSnapshotError, match="ckpt_2.*checksum"):
            ckpt.load(into={"model": fresh}, step=2)  # an exact step never falls back
        with pytest.raises(NoValidSnapshotError, match="no snapshot of step 7"):
            ckpt.load(into={"model": fresh}, step=7)


def test_load_is_all_or_nothing(tmp_path: Any) -> None:
    state = _objects(1)
    _train(state, 2)
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
    other = _objects(2)
    other["model"] = torch.nn.Linear(8, 5)  # another shape
    other["optim"] = torch.optim.AdamW(other["model"].parameters())
    before = {k: v.state_dict() for k, v in other.items() if hasattr(v, "state_dict")}
    extra = torch.nn.Linear(1, 1)
    rng = torch.get_rng_state()
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        # each says what differs and what to do next
        with pytest.raises(StateMismatchError, match=r"does not fit.*Next: build these objects "
                           r"as they were.*snapkeep inspect .*ckpt_2.*Checkpointer\(<another "
                           r"directory>\)"):
            ckpt.load(into=other)
        with pytest.raises(StateMismatchError, match=r"has no \['extra'\].*Next: leave "
                           r"\['extra'\] out of `into`.*Checkpointer\(<another directory>\)"):
            ckpt.load(into={**state, "extra": extra})
    assert torch.equal(torch.get_rng_state(), rng)
    assert other["epoch"] == 2
    for key, sd in before.items():
        assert str(other[key].state_dict()) == str(sd), key


def test_first_run_returns_none_and_names_lookalike_files(tmp_path: Any, caplog: Any,
                                                          capfd: Any) -> None:
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="snapkeep"):
        with snapkeep.Checkpointer(tmp_path / "new" / "run") as ckpt:
            assert ckpt.load(into={"model": model}) is None
            assert ckpt.latest_step() is None
    assert caplog.records == []  # said once, on stderr (not also as a log warning)
    assert capfd.readouterr().err == (
        f"snapkeep: no snapshot of 'ckpt_{{step}}' in {tmp_path / 'new' / 'run'}, starting fresh\n")
    for step in (100, 200):
        torch.save({"w": 1}, tmp_path / f"{step}.pt")
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(RuntimeWarning, match=r"\['100.pt', '200.pt'\] would match the "
                                                r"template '\{step\}.pt'"):
            assert ckpt.load(into={"model": model}) is None


def test_on_error_snapshot_is_kept_aside(tmp_path: Any) -> None:
    model = torch.nn.Linear(2, 2)
    with snapkeep.Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, {"model": model})
        with pytest.raises(ZeroDivisionError):
            try:
                raise ZeroDivisionError("the loop failed mid-step")
            except ZeroDivisionError:
                handle = ckpt.save(2, {"model": model}, on_error=True)
                assert handle is not None and handle.committed.done()
                raise
        ckpt.save(3, {"model": model})
    assert sorted(os.listdir(tmp_path)) == [".snapkeep", "ckpt_2.on-error", "ckpt_3"]
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [3]


@pytest.mark.parametrize(("template", "error"), [
    ("ckpt", "exactly one"), ("ckpt_{step}_{step}", "exactly one"),
    ("ckpt_{.iteration}", "the only field is"), ("c_{step!r}", "the only field is"),
    ("../{step}", "refused"),
])
def test_bad_templates_are_refused(tmp_path: Any, template: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        snapkeep.Checkpointer(tmp_path, template=template)
    assert not os.path.exists(tmp_path / ".snapkeep")


def test_bad_arguments_are_named(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        snapkeep.Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="every must be"):
        snapkeep.Checkpointer(tmp_path, every=0)
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(4))

    loader: Any = torch.utils.data.DataLoader(Stream())
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match="IterableDataset.*StatefulDataLoader"):
            ckpt.save(1, {"data": loader})
        with pytest.raises(TypeError, match="IterableDataset.*StatefulDataLoader"):
            ckpt.load(into={"data": loader})
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            ckpt.save(-1, {})
    with pytest.raises(RuntimeError, match="is closed"):
        ckpt.save(1, {})


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "generator"])
def test_a_plain_dataloader_resumes_mid_epoch_with_the_next_batch(tmp_path: Any,
                                                                  seeded: bool) -> None:
    def make() -> Any:
        generator = torch.Generator().manual_seed(7) if seeded else None
        return torch.utils.data.DataLoader(list(range(40)), batch_size=4, shuffle=True,
                                           generator=generator)

    torch.manual_seed(3)
    loader = make()
    state = {"data": loader}
    with snapkeep.Checkpointer(tmp_path, writer=snapkeep.writing.SimpleWriter()) as ckpt:
        assert ckpt.load(into=state) is None  # hooks the loader before its first iter
        seen = [b.tolist() for b in loader]  # epoch 1
        it = iter(loader)  # epoch 2
        seen += [next(it).tolist() for _ in range(3)]
        ckpt.save(13, state)
        rest = [b.tolist() for b in it] + [b.tolist() for b in loader]  # epoch 2 end, epoch 3
        assert isinstance(loader, torch.utils.data.DataLoader)
    assert len(seen) == 13 and sorted(sum(seen[:10], [])) == list(range(40))

    torch.manual_seed(99)  # the snapshot's global RNG replaces it
    again = make()
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        assert ckpt.load(into={"data": again}) == 13
        resumed = [b.tolist() for b in again] + [b.tolist() for b in again]
    assert resumed == rest  # the 7 batches left of epoch 2, then the same epoch 3


def test_synchronous_writer_and_exit_on_exception(tmp_path: Any, caplog: Any) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(KeyError):
        with snapkeep.Checkpointer(tmp_path, writer=snapkeep.writing.SimpleWriter()) as ckpt:
            handle = ckpt.save(1, {"model": model})
            assert handle is not None and handle.committed.done()
            raise KeyError("loop failed")
    assert ckpt.writer.pending == 0
    with snapkeep.Checkpointer(tmp_path) as again:
        assert again.latest_step() == 1


def test_a_failed_save_does_not_mask_the_loops_own_error(tmp_path: Any, caplog: Any) -> None:
    def savefun(obj: Any, f: Any) -> None:
        raise OSError(28, "No space left on device (injected)")

    with pytest.raises(KeyError, match="loop failed"), caplog.at_level(logging.ERROR):
        with snapkeep.Checkpointer(tmp_path, writer=snapkeep.writing.ThreadWriter(
                savefun=savefun)) as ckpt:
            ckpt.save(1, {"x": torch.zeros(2)})
            raise KeyError("loop failed")
    assert any("while the loop raised KeyError" in r.getMessage()
               and "No space left on device (injected)" in r.getMessage()
               for r in caplog.records)
    assert sorted(os.listdir(tmp_path)) == [".snapkeep"]


def test_sharded_in_one_process_writes_dcp_directories(tmp_path: Any) -> None:
    state = _objects(1)
    it = _train(state, 3)
    with snapkeep.Checkpointer(tmp_path, keep=2, sharded=True) as ckpt:
        assert ckpt.writer is None
        with pytest.raises(StoreLockedError):
            snapkeep.Checkpointer(tmp_path, sharded=True)
        for step in (1, 2, 3):
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
    assert sorted(os.listdir(tmp_path / "ckpt_3")) == [
        ".metadata", ".snapkeep-commit.json", ".snapkeep-in-progress", "__0_0.distcp"]
    expected_batch = next(it)
    fresh = _objects(2)
    assert not torch.equal(fresh["model"].weight, state["model"].weight)
    with snapkeep.Checkpointer(tmp_path, sharded=True) as ckpt:
        assert ckpt.load(into=fresh) == 3
    assert torch.equal(fresh["model"].weight, state["model"].weight)
    assert fresh["sched"].state_dict() == state["sched"].state_dict()
    assert fresh["scaler"].state_dict() == state["scaler"].state_dict()
    assert fresh["epoch"] == 1
    assert torch.equal(next(iter(fresh["data"])), expected_batch)


def test_a_resume_says_so_on_stderr(tmp_path, capfd):
    model = torch.nn.Linear(2, 2)
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, {"model": model})
    capfd.readouterr()
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        assert ckpt.load(into={"model": torch.nn.Linear(2, 2)}) == 3
    assert f"snapkeep: resuming from ckpt_3 (step 3) in {tmp_path}" in capfd.readouterr().err


def test_a_checkpointer_never_lists_its_directory_between_saves(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves with retention keep the store's listing up to date instead of listing the
    directory or its manifest directory again; counted at fsspec's ``ls``."""
    from fsspec.implementations.local import LocalFileSystem

    listings: dict[str, int] = {}

    def ls(self: Any, path: str, detail: bool = True, _ls: Any = LocalFileSystem.ls,
           **kw: Any) -> Any:
        key = str(path).split("://", 1)[-1].rstrip("/")
        listings[key] = listings.get(key, 0) + 1
        return _ls(self, path, detail=detail, **kw)

    monkeypatch.setattr(LocalFileSystem, "ls", ls)
    out = str(tmp_path / "ckpt")
    state = {"model": torch.nn.Linear(2, 2)}
    for first in (1, 5):  # a fresh run, then a restart that loads and keeps going
        listings.clear()
        with snapkeep.Checkpointer(out, keep=2) as ckpt:
            assert (ckpt.load(into=state) or 0) == first - 1
            opened = (listings.get(out, 0), listings.get(out + "/.snapkeep", 0))
            for step in range(first, first + 4):
                ckpt.save(step, state)
                ckpt.wait()
            assert (listings.get(out, 0), listings.get(out + "/.snapkeep", 0)) == opened
        assert opened[1] == 1, listings
        assert ckpt.all_steps() == [first + 2, first + 3]


# -- input a new user typed (found by a fresh-user trial) ---------------------------------------


@dataclasses.dataclass
class Cfg:
    lr: float = 0.1


def test_a_value_load_would_refuse_is_refused_at_save_and_nothing_is_written(tmp_path):
    """A dataclass in the state: load() (weights_only=True) could never resume it, so save
    raises TypeError naming the key before anything is written (before: the snapshot
    committed, ``snapkeep verify`` said autoload would resume from it, and the rerun's load
    raised UnsafeSnapshotError)."""
    model = torch.nn.Linear(2, 2)
    with snapkeep.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "cfg": dataclasses.asdict(Cfg())})  # the fix it names
        for bad, where in (({"cfg": Cfg()}, "'cfg'"), ({"extra": [1, {"x": object()}]},
                                                       "'extra/1/x'"),
                           ({"lock": __import__("threading").Lock()}, "'lock'")):
            with pytest.raises(TypeError, match=f"state\\['{list(bad)[0]}'\\].*at {where}.*"
                                                "weights_only=False"):
                ckpt.save(2, {"model": model, **bad})
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["ckpt_1"]
    with snapkeep.Checkpointer(tmp_path, weights_only=False) as ckpt:  # the opt-in saves it
        ckpt.save(3, {"model": model, "cfg": Cfg()})
    with snapkeep.Checkpointer(tmp_path, weights_only=False) as ckpt:
        into = {"model": torch.nn.Linear(2, 2), "cfg": None}
        assert ckpt.load(into=into) == 3


@pytest.mark.parametrize("timeout_s, error", [("60", TypeError), (True, TypeError),
                                              (-1, ValueError), (0, ValueError),
                                              (float("nan"), ValueError),
                                              (float("inf"), ValueError)])
def test_a_bad_timeout_is_refused_naming_it(tmp_path, timeout_s, error):
    with pytest.raises(error, match="timeout_s must be a finite number of seconds > 0"):
        snapkeep.Checkpointer(tmp_path, timeout_s=timeout_s)
    from snapkeep.training import extensions

    with pytest.raises(error, match="timeout_s must be a finite number of seconds > 0"):
        extensions.snapshot(timeout_s=timeout_s)
    assert not os.listdir(tmp_path)


def test_a_file_as_the_directory_is_named_as_the_output_directory(tmp_path):
    path = tmp_path / "afile"
    path.write_text("x")
    with pytest.raises(snapkeep.SnapshotStorageError) as info:
        snapkeep.Checkpointer(path)
    message = str(info.value)
    assert f"output directory {str(path)!r} cannot be used" in message
    assert "out_dir" not in message and message.count("hoose") <= 1
    assert path.read_text() == "x"


def test_a_first_run_says_starting_fresh_once(tmp_path):
    code = ("import snapkeep, torch\nm = torch.nn.Linear(2, 2)\n"
            f"with snapkeep.Checkpointer({str(tmp_path)!r}) as c:\n"
            "    c.load(into={'m': m})\n    c.save(1, {'m': m})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stderr.count("starting fresh") == 1, out.stderr
