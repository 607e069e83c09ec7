"""Ctrl-C (SIGINT to the whole foreground process group) right after a ProcessWriter call must not
lose that snapshot: the worker ignores SIGINT and the trainer's finalize() waits for the save.
Found by the breaker session: the worker ignores SIGINT only once ``worker_main`` runs, after the
spawned interpreter has imported torch (seconds); a Ctrl-C in that window kills the worker
(exit code -2). The trainer then writes the staged snapshot itself (a WARNING names the dead
worker), as for any worker that dies before reporting its commit, so the snapshot is committed
either way. Real processes and signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

WAIT_S = 120

CHILD = textwrap.dedent("""
    import os, sys
    import torch
    import snapkeep
    out = sys.argv[1]
    writer = snapkeep.writing.ProcessWriter(out_dir=out)
    writer("s_1", out, {"w": torch.arange(4.0)})
    try:
        print("SUBMITTED", flush=True)  # the SIGINT may arrive before print returns
        sys.stdin.readline()  # interrupted by the SIGINT
    except KeyboardInterrupt:
        pass
    try:
        writer.finalize()
    except Exception as e:
        print("ERROR", type(e).__name__, flush=True)
    print("FILES", sorted(n for n in os.listdir(out) if not n.startswith(".")), flush=True)
""")


def test_ctrl_c_right_after_the_first_process_writer_call_keeps_the_snapshot(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "SUBMITTED"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=WAIT_S)
    assert "ERROR" not in out, err
    assert "FILES ['s_1']" in out, err
    # Here the Ctrl-C lands while the worker still imports torch (seconds), so it dies (-2; or
    # 1 when it lands in the interpreter's own start-up, "init_import_site") and the trainer
    # writes the snapshot; a worker already past its start-up ignores the SIGINT and writes it
    # itself. Either way the snapshot above is committed, and a death is reported.
    if "died with exit code" in err:
        assert re.search(r"died with exit code (-2|1)\b", err), err
        assert "the trainer wrote that snapshot itself" in err
