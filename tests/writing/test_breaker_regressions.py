"""Regressions found by trying to break the writers: fork, on_save_error='log', bad arguments."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

FORK_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from snapkeep import writing
    out = sys.argv[1]
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # several copy chunks
    parent = writing.ThreadWriter()
    parent("p0", out, state)
    parent.wait()
    parent("p1", out, state)  # still in flight at the fork
    pid = os.fork()
    if pid == 0:
        t0 = time.monotonic()
        child = writing.ThreadWriter()
        child("c0", out, state)  # stages through the copy pool: must not deadlock
        child.finalize()
        print(f"child done in {time.monotonic() - t0:.1f} s", flush=True)
        sys.exit(0)  # exit must not wait for the parent's in-flight save
    _, status = os.waitpid(pid, 0)
    parent.finalize()
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_stages_and_exits_promptly(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", FORK_CHILD, str(tmp_path)],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "child done" in done.stdout and "child exit 0" in done.stdout
    for name in ("p0", "p1", "c0"):
        assert torch.equal(torch.load(tmp_path / name)["t3"], torch.full((1 << 20,), 3.0))


def test_on_save_error_log_still_takes_the_snapshot_after_a_failure(tmp_path) -> None:
    failed = []
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=6, out_dir=str(tmp_path),
                                writer=writing.ThreadWriter())

    def flaky(obj, f):
        if manager.iteration == 3 and not failed:
            failed.append(3)
            raise OSError(28, "No space left on device")
        torch.save(obj, f)

    manager.extend(ext.snapshot(savefun=flaky, on_save_error="log"), trigger=(1, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            handle = manager.writer.last_handle  # the previous save is done (or failed)
            if handle is not None:
                concurrent.futures.wait([handle.committed])
    manager.finalize()
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("snapshot_iter_"))
    assert names == [f"snapshot_iter_{i}" for i in (1, 2, 4, 5, 6)]  # 4 follows the failure


def savefun_in_main_stand_in(obj, f):  # module-level, but pretend it lives in __main__
    torch.save(obj, f)


def test_process_writer_refuses_a_savefun_from_main() -> None:
    savefun_in_main_stand_in.__module__ = "__main__"
    try:
        with pytest.raises(TypeError, match="defined in the training script"):
            writing.ProcessWriter(savefun=savefun_in_main_stand_in)
    finally:
        savefun_in_main_stand_in.__module__ = __name__


@pytest.mark.parametrize("kwargs, match", [
    ({"max_pending": 0}, "max_pending"),
    ({"max_pending": False}, "max_pending"),
    ({"timeout_s": "5"}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"),
    ({"timeout_s": -1}, "timeout_s"),
])
@pytest.mark.parametrize("cls", [writing.ThreadWriter, writing.ThreadQueueWriter])
def test_bad_back_pressure_arguments_name_themselves(cls, kwargs, match) -> None:
    with pytest.raises(TypeError if kwargs.get("timeout_s") == "5" else ValueError,
                       match=match):
        cls(**kwargs)
