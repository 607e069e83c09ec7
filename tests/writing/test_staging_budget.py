"""``staging_budget=`` (issue 34): a state larger than the budget is staged and written in pieces
through a ring of that size, with the consistency of the overlap (every file holds the values of
the call, bit for bit, while the loop keeps updating the parameters in place); every door takes
the argument; bad values are refused by name."""

from __future__ import annotations

import copy
import io
import pathlib

import pytest
import torch

import snapkeep
from snapkeep import writing
from snapkeep.codecs import torch_save
from snapkeep.training import ExtensionsManager, extensions
from support.ema import Ema

WAIT_S = 120


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(1024, 1024)  # 4 MiB: optimizer-owned, copied after the call
        self.fc2 = torch.nn.Linear(1024, 1024)
        self.bn = torch.nn.BatchNorm1d(1024)  # buffers: copied at the call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc2(self.fc1(x)))  # type: ignore[no-any-return]


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8)
                            if b.dim() else b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))  # type: ignore
    return a == b


def test_overlap_under_a_quarter_budget_every_snapshot_holds_the_call(
        tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    ema = Ema(model)
    state_bytes = sum(t.nbytes for t in model.state_dict().values()) * 4  # + Adam x2 + EMA
    writer = writing.ThreadWriter(out_dir=str(tmp_path), timeout_s=WAIT_S,
                                  staging_budget=state_bytes // 4)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=4, writer=writer,
                                state_objects={"ema": ema})
    manager.extend(extensions.snapshot(), trigger=(1, "iteration"))
    at_call: dict[int, dict] = {}
    seen_by_step: list[bool] = []
    while not manager.stop_trigger:
        if manager.iteration == 1:  # after the snapshot's guard: runs after its pre-hook
            optimizer.register_step_pre_hook(
                lambda *_: seen_by_step.append(writer.last_handle.staged.done()))
        with manager.run_iteration(step_optimizers=["main"]):
            optimizer.zero_grad()
            model(torch.randn(8, 1024)).pow(2).mean().backward()
        # the snapshot was taken at the end of the iteration: the state now is the call's
        at_call[manager.iteration] = copy.deepcopy(manager.state_dict())
        ema.update(model)  # in place, right after the call
    stats = writer._saver.last_budget_stats
    manager.finalize()
    assert stats is not None and stats.budget_bytes == state_bytes // 4
    assert stats.streamed_bytes > 2 * stats.ring_bytes  # the ring was reused within one save
    assert stats.ring_bytes + stats.held_bytes <= stats.budget_bytes
    assert seen_by_step == [True] * 3  # each step after a snapshot waited for its staging
    for step, expected in at_call.items():
        saved = torch.load(tmp_path / f"snapshot_iter_{step}", weights_only=True)
        for section in ("models", "optimizers", "state_objects"):
            assert _equal(saved[section], expected[section]), (step, section)
    assert not _equal(manager.state_dict()["models"], at_call[1]["models"])  # it did change


def test_checkpointer_budget_writes_torch_saves_bytes_of_the_call(tmp_path: pathlib.Path) -> None:
    """No guarded optimizer (the plain loop): the call copies everything through the ring, the
    file is byte for byte ``torch_save`` of the state at the call."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optimizer": optimizer}
    with snapkeep.Checkpointer(tmp_path, staging_budget=3 << 20) as ckpt:
        for step in (1, 2):
            model(torch.randn(8, 1024)).pow(2).mean().backward()
            optimizer.step()
            ckpt.save(step, state)
            expected = copy.deepcopy({"model": model.state_dict(),
                                      "optimizer": optimizer.state_dict()})
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # in place, right after the call
    saved = torch.load(tmp_path / "ckpt_2", weights_only=True)["state"]
    assert _equal(saved["model"], expected["model"])
    assert _equal(saved["optimizer"]["state"], expected["optimizer"]["state"])
    assert not _equal(model.state_dict(), expected["model"])


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_writer_under_budget_writes_the_same_bytes_as_torch_save(
        tmp_path: pathlib.Path, where: str) -> None:
    """Local files (O_DIRECT from the ring) and an fsspec store (the pieces pass through its
    buffered file): each write must be done with the ring's memory when it returns."""
    import fsspec

    base = torch.randn(600, 1024)
    tree = {"w": base, "view": base[7:], "big": torch.randn(5, 1024, 1024), "n": [3, "x"],
            "empty": torch.zeros(0), "i": torch.arange(10)}
    expected = io.BytesIO()
    torch_save(tree, expected)
    out = str(tmp_path) if where == "local" else f"memory://budget-{tmp_path.name}"
    writer = writing.ThreadWriter(out_dir=out, staging_budget=2 << 20)
    writer("a.pt", "", tree)
    writer.finalize()
    if where == "local":
        written = (tmp_path / "a.pt").read_bytes()
    else:
        fs = fsspec.filesystem("memory")
        written = fs.cat(f"/budget-{tmp_path.name}/a.pt")
        fs.rm(f"/budget-{tmp_path.name}", recursive=True)
    assert written == expected.getvalue()  # 20 MiB through a 2 MiB ring


@pytest.mark.parametrize("value, error", [
    ("1G", TypeError), (1.5e9, TypeError), (True, TypeError), (0, ValueError),
    (-1, ValueError), (1000, ValueError)])
def test_bad_staging_budget_is_refused_by_name(tmp_path: pathlib.Path, value: object,
                                               error: type[Exception]) -> None:
    with pytest.raises(error, match=r"staging_budget must be a positive int.*or None"):
        writing.ThreadWriter(staging_budget=value)  # type: ignore[arg-type]
    with pytest.raises(error, match="staging_budget"):
        snapkeep.Checkpointer(tmp_path / "c", staging_budget=value)  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()  # refused before anything was created


def test_combinations_that_cannot_hold_a_budget_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="staging_budget.*process writer"):
        writing.ProcessWriter(staging_budget=64 << 20)
    with pytest.raises(ValueError, match="staging_budget.*memory tier"):
        snapkeep.Checkpointer(tmp_path, memory=snapkeep.MemoryTier(every=1),
                              staging_budget=64 << 20)
    with pytest.raises(ValueError, match="staging_budget.*writer"):
        snapkeep.Checkpointer(tmp_path, writer=writing.ThreadWriter(), staging_budget=64 << 20)


def test_lightning_checkpoint_io_takes_staging_budget(tmp_path: pathlib.Path) -> None:
    lightning = pytest.importorskip("snapkeep.lightning")
    io_ = lightning.SnapkeepCheckpointIO(staging_budget=2 << 20)
    checkpoint = {"state_dict": {"w": torch.randn(1024, 1024)}, "epoch": 0, "global_step": 3}
    expected = copy.deepcopy(checkpoint)
    io_.save_checkpoint(checkpoint, str(tmp_path / "epoch=0-step=3.ckpt"))
    checkpoint["state_dict"]["w"].add_(1.0)  # in place, right after the call
    io_.teardown()
    loaded = io_.load_checkpoint(str(tmp_path / "epoch=0-step=3.ckpt"))
    io_.close()
    assert _equal(loaded["state_dict"], expected["state_dict"])
    with pytest.raises(ValueError, match="staging_budget"):
        lightning.SnapkeepCheckpointIO(writer=writing.ThreadWriter(), staging_budget=2 << 20)
    with pytest.raises(ValueError, match="staging_budget and memory="):
        lightning.SnapkeepCheckpointIO(memory=snapkeep.MemoryTier(every=1),
                                       staging_budget=2 << 20)


def test_hf_owned_save_over_the_budget_writes_the_live_tensors(tmp_path: pathlib.Path) -> None:
    hf = pytest.importorskip("snapkeep.hf")
    from doors import hf_worker

    with pytest.raises(ValueError, match="staging_budget"):
        hf.SnapkeepCallback(staging_budget=0)
    model = hf_worker.GPT2LMHeadModel(hf_worker.GPT2Config(
        n_layer=1, n_embd=128, n_head=2, vocab_size=1024, n_positions=hf_worker.SEQ))
    args = hf_worker.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, save_steps=2, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
    trainer = hf.SnapkeepTrainer(model=model, args=args,
                                 train_dataset=hf_worker.Tokens(64, 1024, 1),
                                 callbacks=[hf.SnapkeepCallback(staging_budget=1 << 20)])
    with pytest.raises(ValueError, match="staging_budget.*memory"):
        hf.SnapkeepTrainer(model=model, args=args, train_dataset=hf_worker.Tokens(64, 1024, 1),
                           memory=snapkeep.MemoryTier(every=1),
                           callbacks=[hf.SnapkeepCallback(staging_budget=1 << 20)])
    trainer.train()
    assert trainer._snapkeep_callback.staging_budget == 1 << 20
    hf.verify_checkpoint(tmp_path / "checkpoint-4")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    live = model.state_dict()
    assert all(torch.equal(saved[k], live[k]) for k in saved)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_at_random_moments_with_a_budget_resumes_bit_identical(
        tmp_path: pathlib.Path) -> None:
    """The Checkpointer's loop of ``support.incremental_worker`` (a 12 MiB state) with
    ``staging_budget`` of 2 MiB, SIGKILLed at random moments (start-up, or 0-60 ms after a save
    call returned: the ring being filled and drained, the commit): every rerun resumes the newest
    snapshot bit-identically. ``benchmarks/checkpointer_kill_trials.py --staging-budget`` runs
    more."""
    from support.incremental_trials import run_trials

    tally = run_trials(3, steps=5, seed=5, root=tmp_path,
                       worker_args=("--staging-budget", str(2 << 20)))
    assert tally.failures == []
    assert tally.trials == 3 and tally.resumes_checked >= 2
    if (tmp_path / "run").exists():  # the next start removes what the last kill left
        snapkeep.Checkpointer(tmp_path / "run").close()


def test_status_shows_the_predicted_stall(tmp_path: pathlib.Path) -> None:
    from click.testing import CliRunner

    from snapkeep.cli import cli

    model = Net()
    state = {"model": model}
    with snapkeep.Checkpointer(tmp_path, staging_budget=2 << 20) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state)
            ckpt.wait()
    result = CliRunner().invoke(cli, ["status", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "staging budget 2 MiB for 8 MiB of tensors: predicted stall " in result.output
    assert "predicted stall unknown" not in result.output  # from the previous save's rates
    record = snapkeep.session.run_status(tmp_path).staging
    assert record["budget_bytes"] == 2 << 20 and record["predicted_stall_s"] > 0
    # the writer's lag (the call to its first piece's write) is measured and in the forecast:
    # a ring that starts draining L seconds late leaves the last pieces L seconds later
    assert 0 < record["write_lag_s"] < record["staged_s"] + 60
    assert record["write_Bps"] > 0


def test_the_forecast_follows_the_pieces_through_the_ring() -> None:
    """The last piece has room once all but the ring's last ``blocks`` pieces are written, and
    the writer starts its lag after the call: a ring of 8 blocks of 128 MiB holds 8 pieces of
    85 MiB tensors (683 MiB), not 1 GiB (the forecast ran 0.1-0.3 s short before)."""
    from snapkeep._core.save.budget import piece_sizes, predict_staged_s

    MiB = 1 << 20
    pieces = piece_sizes([85 * MiB] * 24, 128 * MiB)  # 2 GiB through 8 x 128 MiB
    assert pieces == [85 * MiB] * 24
    assert piece_sizes([200 * MiB, 10 * MiB], 64 * MiB) == [64 * MiB] * 3 + [8 * MiB, 10 * MiB]
    c, w = 8e9, 1e9
    drained = 16 * 85 * MiB  # all but the last 8 pieces
    assert predict_staged_s(pieces, 8, c, w) == pytest.approx(
        85 * MiB / c + drained / w + 85 * MiB / c)
    assert predict_staged_s(pieces, 8, c, w, 0.25) == pytest.approx(
        0.25 + drained / w + 85 * MiB / c)  # the writer starts 0.25 s after the call
    assert predict_staged_s(pieces[:8], 8, c, w, 0.25) == pytest.approx(
        8 * 85 * MiB / c)  # the pieces fit the ring: the copy alone


def test_the_managers_memory_tier_refuses_a_budgeted_writer(tmp_path: pathlib.Path) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = writing.ThreadWriter(out_dir=str(tmp_path / "out"), staging_budget=2 << 20)
    manager = ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=2, writer=writer,
                                out_dir=str(tmp_path / "out"))
    manager.extend(extensions.snapshot(), trigger=(1, "iteration"))
    manager.extend(extensions.memory_tier(snapkeep.MemoryTier(every=1, root=str(tmp_path))))
    with pytest.raises(ValueError, match="memory tier: .*staging_budget"):
        with manager.run_iteration():
            pass
    writer.finalize()
