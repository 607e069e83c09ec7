"""``snapkeep.distributed.exit_cleanly_at_exit``: the preemption exit's code survives interpreter
teardown (which can abort with gloo loaded), after every atexit handler ran and stdio was
flushed; an exception escaping afterwards still exits 1. Real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from support.ranks import rank_env

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from snapkeep.distributed import exit_cleanly_at_exit

    atexit.register(lambda: print("user handler ran", flush=False))  # registered first
    exit_cleanly_at_exit(143)
    sys.stdout.write("unflushed line\\n")
    if sys.argv[1] == "error":
        try:
            raise SystemExit(143)
        finally:
            raise RuntimeError("cleanup failed")
    raise SystemExit(143)
""")


@pytest.mark.parametrize(("mode", "code"), [("exit", 143), ("error", 1)])
def test_the_exit_code_handlers_and_output_survive(mode, code):
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == code, done.stderr
    assert done.stdout.splitlines() == ["unflushed line", "user handler ran"]
    assert ("RuntimeError: cleanup failed" in done.stderr) == (mode == "error")


GLOO_SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch, torch.distributed as dist

    def gloo_workers():
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass  # the thread ended while listed
        return sum(name.startswith("pt_gloo") or name.startswith("gloo") for name in names)

    # registered before snapkeep's groups exist, so it runs after snapkeep's atexit handlers
    atexit.register(lambda: print("gloo threads at exit:", gloo_workers(), flush=True))
    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    from snapkeep.distributed import background_groups
    groups = background_groups(60.0)
    dist.all_reduce(torch.ones(3), group=groups.control)  # a temporary, as the extensions do
    print("gloo threads while training:", gloo_workers(), flush=True)
    dist.destroy_process_group()  # what the script is told to do; snapkeep still holds its groups
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_no_gloo_thread_of_snapkeeps_groups_lives_into_interpreter_finalization(tmp_path):
    """A gloo worker alive during finalization that drops a collective's tensors aborts the
    process (exit -6 after a successful run: 6 of 30 torchrun runs of status_worker.py before
    the release at exit). The deterministic check: no gloo thread is left when the interpreter
    starts finalizing."""
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_SCRIPT, str(rank), str(init)],
                              env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for rank in range(2)]
    outputs = []
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.communicate()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
        lines = output.splitlines()
        training = int(next(line for line in lines if "while training" in line).split()[-1])
        assert training >= 4, output  # the default group's and snapkeep's three groups' threads
        assert "gloo threads at exit: 0" in lines, output
