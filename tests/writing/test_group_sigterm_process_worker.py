"""SIGTERM to the whole process group (a scheduler, ``torchrun``, ``docker stop``, ``kill -TERM
-PGID``) with ``extensions.preemption`` and a process writer: the worker must survive it to write
the preemption snapshot, and the trainer exits with the preemption code. Found by the breaker
session: the worker ignored only SIGINT, died with -15, the preemption snapshot failed
(WorkerDiedError) and the trainer exited 1 with nothing of that iteration committed. Real
processes and signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

WAIT_S = 120

CHILD = textwrap.dedent("""
    import sys
    import torch
    import snapkeep
    from snapkeep.training import ExtensionsManager, extensions
    out, kind = sys.argv[1], sys.argv[2]
    writer = getattr(snapkeep.writing, kind)(out_dir=out)
    manager = ExtensionsManager(torch.nn.Linear(8, 8), {}, 10**6, iters_per_epoch=1,
                                writer=writer)
    manager.extend(extensions.snapshot(filename="s_{.iteration}", n_retains=1),
                   trigger=(1000, "iteration"))
    manager.extend(extensions.snapshot(filename="early_{.iteration}"), trigger=(1, "iteration"))
    manager.extend(extensions.preemption())
    for _ in range(2):  # the worker is up and has committed early_1, early_2
        with manager.run_iteration():
            pass
    print("RUNNING", flush=True)
    while True:
        with manager.run_iteration():
            pass
        print("IT", manager.iteration, flush=True)
""")


@pytest.mark.parametrize("kind", ["ProcessWriter", "ProcessQueueWriter"])
def test_group_sigterm_leaves_the_preemption_snapshot_committed(tmp_path, kind):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), kind], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("IT 3"):
                break
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 143, out[-2000:]
    steps = [int(n[2:]) for n in os.listdir(tmp_path) if re.fullmatch(r"s_\d+", n)]
    assert len(steps) == 1 and steps[0] >= 3, (sorted(os.listdir(tmp_path)), out[-2000:])
