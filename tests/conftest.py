"""Shared fixtures. Every test is bounded by pytest-timeout (see pyproject)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch

from snapkeep._core.save.shm import ARENA_PREFIX
from snapkeep._core.storage import TEMP_MARKER
from support import zygote
from support.leak_check import LONG_LIVED_PIDS
from support.storage_backends import BUCKET, MotoServer, s3_options, start_moto_server

#: How long a test's child processes may take to exit after it returns (a worker finishing its
#: shutdown), in seconds; polled, never slept through.
CHILD_EXIT_GRACE_S = 30.0  # polled: a quiet machine never waits it out
_SHM_DIR = "/dev/shm"
#: Long-lived helpers multiprocessing starts once per test process; not a test's leak.
_INFRASTRUCTURE = ("resource_tracker", "forkserver")


@pytest.fixture(autouse=True, scope="session")
def _session_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Point TMPDIR (and :mod:`tempfile`) of this test process and every child it starts at a
    directory of pytest's, removed at the end: torchrun's ``torchelastic_*`` folders and
    multiprocessing's ``pymp-*`` folders of killed children were left in /tmp (219 and 41 after
    a few runs)."""
    import shutil
    import tempfile

    path = tmp_path_factory.mktemp("tmpdir", numbered=True)
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = str(path)
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        # multiprocessing's own pymp-* folder of this process is removed by its exit handler,
        # which printed a FileNotFoundError traceback when it was already gone
        from multiprocessing import process

        own = process.current_process()._config.get("tempdir")  # noqa: SLF001 -- no public API
        for child in path.iterdir():
            if str(child) == own:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        if own is None or not str(own).startswith(str(path)):
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _shared_zygotes(_session_tmpdir: None) -> Iterator[None]:
    """Stop the worker zygotes this test process started (tests/support/zygote.py's
    ``shared``) at the session's end, before its TMPDIR goes."""
    try:
        yield
    finally:
        zygote.stop_shared()


#: Signals whose handlers a test may change (snapkeep's preemption, Lightning, Ray).
_WATCHED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2,
                    signal.SIGHUP)
#: The handlers of this test process before any test ran.
_BASELINE_HANDLERS = {sig: signal.getsignal(sig) for sig in _WATCHED_SIGNALS}


@pytest.fixture(autouse=True)
def _signal_handlers() -> Iterator[None]:
    """Every test starts with the process's original signal handlers. A handler left behind
    by a library is put back (``ray.init`` installs a SIGTERM handler that calls
    ``sys.exit(15)`` and ``ray.shutdown`` leaves it: a later Lightning test on the same xdist
    worker then exited with code 15 instead of Lightning's own ``SystemExit``); one left by
    snapkeep fails the test (snapkeep restores what it installs)."""
    yield
    left = {sig: signal.getsignal(sig) for sig in _WATCHED_SIGNALS}
    ours = []
    for sig, handler in left.items():
        if handler is _BASELINE_HANDLERS[sig]:
            continue
        signal.signal(sig, _BASELINE_HANDLERS[sig])
        module = getattr(handler, "__module__", "") or ""
        owner = getattr(handler, "__self__", None)
        if module.startswith("snapkeep") or type(owner).__module__.startswith("snapkeep"):
            ours.append(f"{sig.name}: {handler!r}")
    assert not ours, f"snapkeep left signal handler(s) installed: {ours}"


@pytest.fixture(autouse=True)
def _snapkeep_logging(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="snapkeep")


def _arenas() -> set[str]:
    """snapkeep staging arenas in /dev/shm (any owner)."""
    try:
        return {n for n in os.listdir(_SHM_DIR) if n.startswith(ARENA_PREFIX)}
    except OSError:
        return set()


def _owner(name: str) -> int | None:
    try:
        return int(name[len(ARENA_PREFIX):].split("_")[0], 36)
    except ValueError:
        return None


class _ChildSampler:
    """Remembers every descendant seen while a test runs (sampled every ``interval_s``), so an
    arena of a child the test killed is still known as this test's (other runs on the machine
    make and reclaim arenas too)."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True, name="leak-sampler")
        self._thread.start()

    def _sample(self) -> None:
        try:
            self.seen.update(p.pid for p in psutil.Process().children(recursive=True))
        except psutil.Error:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def stop(self) -> set[int]:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()
        return self.seen


def _live_children(ignore: set[int]) -> list[psutil.Process]:
    live = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in ignore or child.pid in LONG_LIVED_PIDS:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any(word in " ".join(child.cmdline()) for word in _INFRASTRUCTURE):
                continue
        except psutil.NoSuchProcess:
            continue
        live.append(child)
    return live


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves snapkeep shared-memory arenas (of this process or any child it
    had), snapkeep temp files in its ``tmp_path`` or live child processes behind (then clean them
    up, so the next test starts clean)."""
    me = os.getpid()
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    arenas_before = _arenas()
    sampler = _ChildSampler()
    try:
        yield
    finally:
        tree = {me} | sampler.stop()
    problems = []
    deadline = time.monotonic() + CHILD_EXIT_GRACE_S
    children = _live_children(children_before)
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        children = _live_children(children_before)
    if children:
        problems.append("live child processes: " + ", ".join(
            f"{p.pid} ({' '.join(p.cmdline())[:120]})" for p in children))
        for child in children:
            try:
                child.kill()
                child.wait(timeout=10)
            except psutil.Error:
                pass
    arenas = {n for n in _arenas() - arenas_before if _owner(n) in tree}
    if arenas:
        problems.append(f"shared-memory arenas in {_SHM_DIR}: {sorted(arenas)}")
        for name in arenas:
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except OSError:
                pass
    tmp_path = request.node.__dict__.get("funcargs", {}).get("tmp_path")
    if tmp_path is not None and os.path.isdir(tmp_path):
        temps = [os.path.join(root, name) for root, _dirs, files in os.walk(tmp_path)
                 for name in files if TEMP_MARKER in name]
        if temps:
            problems.append(f"snapkeep temp files: {sorted(temps)[:10]}")
    if problems:
        pytest.fail(f"{request.node.nodeid} left behind: " + "; ".join(problems),
                    pytrace=False)


@pytest.fixture
def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """moto's S3 server (a separate process on 127.0.0.1) with the bucket ``BUCKET``, one for
    the whole session (the storage contract suite and the door matrix share it)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = start_moto_server()
    LONG_LIVED_PIDS.add(server.process.pid)  # outlives the test that starts it
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options(server.endpoint))
        fs.mkdir(BUCKET)
        yield server
    finally:
        server.stop()
