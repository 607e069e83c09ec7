"""One trainer per snapshot directory: the snapshot extension locks the store in initialize
(before autoload) and unlocks it in finalize; a second trainer is refused with the holder named;
a lock left by a SIGKILLed trainer never blocks a restart. Real processes throughout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

import snapkeep
from support.integration import assert_params, listing, make_run, train

WAIT_S = 60

CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from support.integration import make_run, train
    import snapkeep
    manager, _, model = make_run(sys.argv[1])
    try:
        manager.start_extensions()
    except snapkeep.StoreLockedError as e:
        print("LOCKED", e, flush=True)
        sys.exit(3)
    train(manager, model, 2)
    print("READY", manager.iteration, flush=True)
    sys.stdin.readline()  # hold the lock until told (or killed)
    manager.finalize()
    print("DONE", flush=True)
""")


def _child(out) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # support.integration
    return subprocess.Popen([sys.executable, "-c", CHILD, str(out), tests], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = ""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if sel.select(timeout=WAIT_S):
            line = proc.stdout.readline()
    assert line, f"no output from the child within {WAIT_S} s"
    return line.strip()


@pytest.fixture
def holder(tmp_path):
    """A trainer process that holds the lock of ``tmp_path`` (2 snapshots written)."""
    proc = _child(tmp_path)
    try:
        assert _line(proc) == "READY 2"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_a_second_trainer_is_refused_naming_the_holder(tmp_path, holder):
    before = listing(tmp_path)
    manager, _, model = make_run(tmp_path)
    with pytest.raises(snapkeep.StoreLockedError) as info:
        manager.start_extensions()
    message = str(info.value)
    assert f"pid {holder.pid} on host {socket.gethostname()}, since " in message
    assert "UTC" in message and "another output directory" in message
    assert manager.iteration == 0  # refused before autoload: nothing loaded
    assert listing(tmp_path) == before  # nothing written or deleted
    assert isinstance(info.value, snapkeep.SnapshotError)


def test_a_sigkilled_holder_never_blocks_a_restart(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=WAIT_S)
    manager, _, model = make_run(tmp_path)
    manager.start_extensions()  # the kernel released the flock with the process
    assert manager.iteration == 2
    assert_params(model, 2)
    train(manager, model, 1)
    manager.finalize()


def test_the_lock_is_released_at_finalize(tmp_path):
    manager, _, model = make_run(tmp_path)
    train(manager, model, 1)
    proc = _child(tmp_path)
    try:
        assert _line(proc).startswith(f"LOCKED snapshot directory {str(tmp_path)!r} (asked for "
                                      "'snapshot_iter_{.iteration}') is in use by another "
                                      f"trainer (pid {os.getpid()}")
        proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
        proc.stdin.close()  # type: ignore[union-attr]
        proc.stdout.close()  # type: ignore[union-attr]
    assert proc.returncode == 3
    manager.finalize()

    proc = _child(tmp_path)
    try:
        assert _line(proc) == "READY 3"  # resumed from snapshot 1, trained 2 more
        proc.stdin.write("\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert _line(proc) == "DONE"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)
        proc.stdin.close()  # type: ignore[union-attr]
        proc.stdout.close()  # type: ignore[union-attr]


def test_another_template_in_the_same_directory_is_refused(tmp_path, holder):
    """One trainer owns the directory, whatever template names its files (before: a
    ``snapshot_object`` of another template ran beside the holder, and its sweep and retention
    reached the holder's directory)."""
    import torch

    from snapkeep.training import ExtensionsManager, extensions

    before = listing(tmp_path)
    model = torch.nn.Linear(2, 2)
    manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                                iters_per_epoch=1,
                                writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(extensions.snapshot_object(model, "model_{.iteration}"),
                   trigger=(1, "iteration"))
    with pytest.raises(snapkeep.StoreLockedError, match=f"pid {holder.pid} "):
        manager.start_extensions()
    assert listing(tmp_path) == before


def test_two_templates_of_one_manager_share_the_directory(tmp_path):
    """The doors of one run in one process share the lock: a manager's ``snapshot`` and
    ``snapshot_object`` extensions on one out_dir both save."""
    import torch

    from snapkeep.training import ExtensionsManager, extensions

    model = torch.nn.Linear(2, 2)
    manager = ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 2,
                                iters_per_epoch=1,
                                writer=snapkeep.writing.SimpleWriter(out_dir=str(tmp_path)))
    manager.extend(extensions.snapshot(n_retains=1), trigger=(1, "iteration"))
    manager.extend(extensions.snapshot_object(model, "model_{.iteration}", n_retains=1),
                   trigger=(1, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            pass
    manager.finalize()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "model_2", "snapshot_iter_2"]


def test_a_second_manager_of_the_same_process_shares_the_lock(tmp_path, caplog):
    """flock cannot tell two objects of one process apart; an earlier manager that was never
    finalized (a notebook cell run twice) shares the lock with the new one, and finalizing
    the earlier one leaves the lock held for the new one."""
    import logging

    caplog.set_level(logging.INFO, logger="snapkeep._core.store.lock")
    first, _, model = make_run(tmp_path)
    train(first, model, 1)
    second, _, model = make_run(tmp_path)
    second.start_extensions()
    assert second.iteration == 1
    assert "already holds" in caplog.text
    first.finalize()  # releasing the earlier share leaves the new holder's lock alone
    proc = _child(tmp_path)
    try:
        assert _line(proc).startswith("LOCKED")
    finally:
        proc.kill()
        proc.wait(timeout=WAIT_S)
        proc.stdin.close()  # type: ignore[union-attr]
        proc.stdout.close()  # type: ignore[union-attr]
    second.finalize()


FORKING_CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from support.integration import make_run, train
    manager, _, model = make_run(sys.argv[1])
    train(manager, model, 2)  # the lock is held from here on
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=1, num_workers=2,
                                         persistent_workers=True)
    it = iter(loader)
    next(it)  # both workers forked and running
    workers = [w.pid for w in it._workers]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a plain fork child that outlives the trainer (blocks until killed)
        os.read(r, 1)
        os._exit(0)
    print("READY", manager.iteration, pid, *workers, flush=True)
    sys.stdin.readline()
""")


def test_forked_children_of_a_sigkilled_trainer_do_not_hold_the_lock(tmp_path):
    """kill -9 of only the trainer's pid: its DataLoader workers and an os.fork child live on
    (in their own process group), yet a restart gets the lock at once."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # support.integration
    proc = subprocess.Popen([sys.executable, "-c", FORKING_CHILD, str(tmp_path), tests], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        fields = _line(proc).split()
        assert fields[:2] == ["READY", "2"] and len(fields) == 5
        children = [int(pid) for pid in fields[2:]]
        proc.send_signal(signal.SIGKILL)  # the trainer only, not its group
        proc.wait(timeout=WAIT_S)
        for pid in children:
            os.kill(pid, 0)  # still alive: they would hold an inherited lock descriptor
        manager, _, model = make_run(tmp_path)
        manager.start_extensions()  # no StoreLockedError naming the dead pid
        assert manager.iteration == 2
        assert_params(model, 2)
        manager.finalize()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leftover children
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)
        proc.stdin.close()  # type: ignore[union-attr]
        proc.stdout.close()  # type: ignore[union-attr]
