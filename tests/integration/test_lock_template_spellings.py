"""The directory lock covers the names a template matches, not its spelling: a second trainer
whose template is written differently but lists, autoloads and retains the same files
(``{0.iteration}``, ``{.iteration:d}``, ``{.iteration!s}``) is refused while the first holds the
lock. Found by the breaker session: before, such a trainer autoloaded the holder's snapshot and
its ``n_retains=1`` deleted the holder's only snapshot. Real processes and files."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import textwrap

import pytest
import torch

import snapkeep
from snapkeep.training import ExtensionsManager, extensions

WAIT_S = 60

HOLDER = textwrap.dedent("""
    import sys
    import torch
    import snapkeep
    from snapkeep.training import ExtensionsManager, extensions
    model = torch.nn.Linear(2, 2)
    manager = ExtensionsManager(model, {}, 1000, iters_per_epoch=1,
                                writer=snapkeep.writing.SimpleWriter(out_dir=sys.argv[1]))
    manager.extend(extensions.snapshot(filename="s_{.iteration}", n_retains=1, autoload=True),
                   trigger=(1, "iteration"))
    manager.start_extensions()
    with manager.run_iteration():
        pass
    print("READY", manager.iteration, flush=True)
    sys.stdin.readline()  # hold the lock until told (or killed)
    manager.finalize()
""")


def _ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline().strip() if sel.select(timeout=WAIT_S) else ""
    return line


@pytest.fixture
def holder(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _ready(proc) == "READY 1"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("template", ["s_{0.iteration}", "s_{.iteration:d}", "s_{.iteration!s}"])
def test_an_equivalent_template_spelling_is_refused(tmp_path, holder, template):
    model = torch.nn.Linear(2, 2)
    manager = ExtensionsManager(model, {}, 1000, iters_per_epoch=1,
                                writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(extensions.snapshot(filename=template, n_retains=1, autoload=True),
                   trigger=(1, "iteration"))
    with pytest.raises(snapkeep.StoreLockedError, match=f"pid {holder.pid} "):
        manager.start_extensions()
    assert manager.iteration == 0  # refused before autoload
    assert os.path.exists(tmp_path / "s_1")  # the holder's only snapshot is still there


def test_lock_key_ignores_spelling_but_not_literals():
    from snapkeep.store import FilenameTemplate, ppe_template

    keys = {ppe_template(t).lock_key for t in
            ["s_{.iteration}", "s_{0.iteration}", "s_{.iteration:05d}", "s_{.iteration!r}",
             "s_{step}", "s_{step:05d}"]}
    assert keys == {"s_{int}"}
    assert FilenameTemplate("m_{step}").lock_key == "m_{int}"
    assert ppe_template("a{{b}}_{.loss}").lock_key == "a{{b}}_{num}"
