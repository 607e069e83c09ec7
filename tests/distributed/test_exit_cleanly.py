"""``snapkeep.distributed.exit_cleanly_at_exit``: the preemption exit's code survives interpreter
teardown (which can abort with gloo loaded), after every atexit handler ran and stdio was
flushed; an exception escaping afterwards still exits 1. Real subprocesses."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
