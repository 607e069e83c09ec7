"""A Python process that has imported torch and snapkeep once and forks a fresh worker process
per request (as multiprocessing's forkserver does), so that a test running a worker script
several times (a run, a SIGKILL, a rerun) pays the interpreter's start-up and torch's import
(~2 s of CPU each) once per session instead of once per run.

Each worker is a real process of its own: forked from the zygote before it did anything but
import, it runs the script as ``__main__`` with the given argv, working directory and
environment, its stdout written to a FIFO the test reads line by line (to SIGKILL it right after
a line) and its stderr to a file. It ends as the interpreter's exit does, in its order (the
non-daemon threads waited for and the threading atexit hooks run, snapkeep's exit drain among
them; then the ``atexit`` handlers; stdio flushed), skipping only the module teardown after
that (seconds of torch's), or by a signal. The zygote reaps it and reports its exit status as
``subprocess`` does (``-9`` for SIGKILL).

:func:`shared` keeps one zygote per kind for the whole test process (stopped by conftest.py at
the session's end): :data:`FRAMEWORKS` (``frameworks``) for the Lightning and Hugging Face
workers, the deadline worker's, one per rank for ``support.ranks.start``. :func:`run` is
``subprocess.run`` for a forked worker, :class:`Forked` one to signal and feed on stdin,
:class:`ForkedPopen` the ``subprocess.Popen`` interface.

What a forked worker shares with its zygote and a fresh interpreter would not: what was read at
import (``PYTHONPATH``, ``OMP_NUM_THREADS``, ``HF_HUB_OFFLINE``: ``shared`` keys on them) and
the ``str`` hash seed (the ranks of a job fork from one zygote each, so theirs differ).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence

#: The zygote's program: import, say READY, then serve one JSON request per stdin line.
_SERVER = r'''
import atexit, importlib, json, os, runpy, sys, threading, traceback
for name in sys.argv[1:]:
    importlib.import_module(name)
if threading.active_count() != 1:  # forking a process with threads is unsafe
    print("THREADS", threading.active_count(), flush=True)
    sys.exit(1)
print("READY", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if "wait" in request:
        _, status = os.waitpid(request["wait"], 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
        continue
    if "poll" in request:
        pid, status = os.waitpid(request["poll"], os.WNOHANG)
        code = os.waitstatus_to_exitcode(status) if pid else None
        print(json.dumps({"code": code}), flush=True)
        continue
    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid}), flush=True)
        continue
    # the worker: its own session, stdin from /dev/null (or a FIFO the test writes), stdout
    # the FIFO, stderr a file
    os.setsid()
    os.dup2(os.open(request.get("stdin") or os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(request["stdout"], os.O_WRONLY), 1)
    if request["stderr"] == request["stdout"]:  # one pipe for both (stderr=STDOUT)
        os.dup2(1, 2)
    else:
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["script"], *request["argv"]]
    module = request.get("module")  # python -m MODULE: sys.path[0] is the working directory
    sys.path[0] = os.getcwd() if module else os.path.dirname(request["script"])
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    # the interpreter's exit, in its order: wait for the non-daemon threads and run the
    # threading atexit hooks (snapkeep's exit drain), run the atexit handlers, flush; then
    # skip the module teardown (a second or more of torch's; nothing of the worker's)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
os._exit(0)  # stdin closed: the zygote ends without torch's module teardown (seconds)
'''


class Zygote:
    """The zygote process (see the module docstring); ``preload``: modules it imports."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str], *,
                 wait: bool = True) -> None:
        self._lock = threading.Lock()
        self.process = subprocess.Popen([sys.executable, "-c", _SERVER, *preload],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=dict(env), text=True)
        self._ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until it has imported its modules (``wait=False``: several start at once)."""
        if self._ready:
            return
        assert self.process.stdout is not None
        ready = self.process.stdout.readline().strip()
        if ready != "READY":
            self.stop()
            raise RuntimeError(f"the zygote did not start: {ready!r}")
        self._ready = True

    def _ask(self, request: dict[str, object]) -> dict[str, int]:
        assert self.process.stdin is not None and self.process.stdout is not None
        with self._lock:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError("the zygote died")
        return dict(json.loads(answer))

    def run(self, script: str, argv: Sequence[str], *, cwd: str, env: Mapping[str, str],
            fifo: str, stderr: str, stdin: str | None = None, module: str | None = None
            ) -> tuple[int, Iterator[str]]:
        """Fork a worker running ``script`` (with ``module``: ``python -m module``, ``script``
        then only names it); returns its pid and its stdout's lines (read
        from ``fifo``, which this creates; the iterator ends when the worker's stdout closes).
        With ``stdin`` (a path), the worker's stdin is a FIFO made there, which the caller
        opens for writing right after this returns (the worker waits for that before it runs).
        Call :meth:`wait` with the pid afterwards."""
        os.mkfifo(fifo)
        if stdin is not None:
            os.mkfifo(stdin)
        pid = self._ask({"script": script, "argv": list(argv), "cwd": cwd, "env": dict(env),
                         "stdout": fifo, "stderr": stderr, "stdin": stdin,
                         "module": module})["pid"]

        def lines() -> Iterator[str]:
            with open(fifo) as stream:  # opened once the worker opened its end
                yield from stream
        return pid, lines()

    def wait(self, pid: int) -> int:
        """The worker's exit status as ``subprocess`` gives it (``-N`` for signal N)."""
        return self._ask({"wait": pid})["code"]

    def poll(self, pid: int) -> int | None:
        """The worker's exit status once it ended (reaped then: ask once), else None."""
        code = self._ask({"poll": pid})["code"]
        return None if code is None else int(code)

    def stop(self) -> None:
        if self.process.poll() is None:
            if self.process.stdin is not None:
                self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


#: The zygotes of this test process, by what they import and the environment they started with
#: (what a forked worker cannot change: ``sys.path`` from ``PYTHONPATH``, torch's threads).
_SHARED: dict[tuple[object, ...], Zygote] = {}

#: The framework doors' imports (Lightning, Hugging Face, torchdata): ~10 s of wall time for a
#: worker that imports them itself on 2 busy cores, paid once by the zygote instead.
FRAMEWORKS = ("torch", "snapkeep", "snapkeep.training", "torchdata.stateful_dataloader",
              "lightning.pytorch", "snapkeep.lightning", "transformers", "transformers.trainer",
              "snapkeep.hf")


def shared(preload: Sequence[str], env: Mapping[str, str], tag: str = "") -> Zygote:
    return shared_all(preload, env, [tag])[0]


def shared_all(preload: Sequence[str], env: Mapping[str, str], tags: Sequence[str]
               ) -> list[Zygote]:
    """This test process's zygote importing ``preload``, started with ``env`` on first use and
    kept for the session (stopped by :func:`stop_shared`, which conftest.py calls at its end).
    A worker forked by it gets the environment of its request; what was read at import time
    (``PYTHONPATH``, ``OMP_NUM_THREADS``, ``HF_HUB_OFFLINE``) is the zygote's, so those pick
    the zygote. ``tag`` names one of several zygotes of the same kind (each has its own
    ``str`` hash seed: the ranks of one job start from different ones, as separate interpreters
    do)."""
    from support.leak_check import LONG_LIVED_PIDS

    found = []
    for tag in tags:  # the missing ones start at once, then are waited for
        key = (tuple(preload), tag,
               *(env.get(name) for name in ("PYTHONPATH", "OMP_NUM_THREADS", "HF_HUB_OFFLINE")))
        zygote = _SHARED.get(key)
        if zygote is None or zygote.process.poll() is not None:
            zygote = Zygote(preload, env, wait=False)
            LONG_LIVED_PIDS.add(zygote.process.pid)  # outlives the test that starts it
            _SHARED[key] = zygote
        found.append(zygote)
    for zygote in found:
        zygote.wait_ready()
    return found


def frameworks(env: Mapping[str, str]) -> Zygote:
    """The shared zygote importing :data:`FRAMEWORKS` (Hugging Face offline: it reads that at
    import, and a worker's own ``setdefault`` comes too late)."""
    return shared(FRAMEWORKS, {**env, "HF_HUB_OFFLINE": "1"})


def stop_shared() -> None:
    zygotes = list(_SHARED.values())
    _SHARED.clear()
    for each in zygotes:  # all told to end first, then waited for
        if each.process.stdin is not None and each.process.poll() is None:
            each.process.stdin.close()
    for each in zygotes:
        each.stop()


class Forked:
    """A worker forked by ``zygote`` (as ``subprocess.Popen`` with ``start_new_session=True``
    would start ``[sys.executable, script, *argv]``): ``pid`` (its process group's id too),
    ``stdout`` (its lines), ``stdin`` (open for writing, with ``with_stdin``), :meth:`wait`,
    :meth:`stderr` (read once it ended) and :meth:`close` (kills it if it still runs; removes
    its files)."""

    def __init__(self, zygote: Zygote, script: str, argv: Sequence[str], *, cwd: str,
                 env: Mapping[str, str], with_stdin: bool = False,
                 module: str | None = None) -> None:
        import tempfile
        import uuid

        self._zygote = zygote
        self._dir = tempfile.mkdtemp(prefix="forked-")
        run = uuid.uuid4().hex[:8]
        self._stderr = os.path.join(self._dir, f"stderr-{run}")
        self._fifos = [os.path.join(self._dir, f"stdout-{run}")]
        stdin = os.path.join(self._dir, f"stdin-{run}") if with_stdin else None
        self.returncode: int | None = None
        self.pid, self.stdout = zygote.run(script, argv, cwd=cwd, env=env,
                                           fifo=self._fifos[0], stderr=self._stderr,
                                           stdin=stdin, module=module)
        self.stdin = open(stdin, "w") if stdin is not None else None  # noqa: SIM115

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid)
        return self.returncode

    def stderr(self) -> str:
        try:
            with open(self._stderr) as f:
                return f.read()
        except FileNotFoundError:  # the worker never got to open it
            return ""

    def close(self) -> None:
        import contextlib
        import shutil

        if self.stdin is not None:
            with contextlib.suppress(OSError):
                self.stdin.close()
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.wait()
        close = getattr(self.stdout, "close", None)
        if close is not None:
            close()
        shutil.rmtree(self._dir, ignore_errors=True)


def group_killer(pid: int, after_s: float) -> tuple[threading.Timer, threading.Event]:
    """A timer that, once started, SIGKILLs the process group of ``pid`` (a worker started in a
    session of its own) ``after_s`` seconds later, and the event it sets when it fired."""
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    return threading.Timer(after_s, kill), fired


def run(zygote: Zygote, script: str, argv: Sequence[str], *, cwd: str, env: Mapping[str, str],
        timeout: float, module: str | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, script, *argv], cwd=cwd, env=env, timeout=timeout,
    capture_output=True, text=True)`` (with ``module``: ``[sys.executable, "-m", module,
    *argv]``), forked by ``zygote``: a worker still running after
    ``timeout`` seconds is SIGKILLed (with its process group) and ``TimeoutExpired`` raised."""
    worker = Forked(zygote, script, argv, cwd=cwd, env=env, module=module)
    timer, late = group_killer(worker.pid, timeout)
    timer.start()
    try:
        out = "".join(worker.stdout)
        code = worker.wait()
        timer.cancel()
        err = worker.stderr()
    finally:
        timer.cancel()
        worker.close()
    command = [sys.executable, *(["-m", module] if module else [script]), *argv]
    if late.is_set():
        raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(command, code, out, err)


class ForkedPopen:
    """What ``subprocess.Popen([sys.executable, script, *argv], env=env, stdout=PIPE,
    stderr=STDOUT, text=True, start_new_session=True)`` gives (``pid``, ``stdout``, ``poll``,
    ``wait``, ``communicate``, ``returncode``, ``send_signal``, ``terminate``, ``kill``), for
    a worker forked by ``zygote``: a real process in a session of its own, its stdout and
    stderr one pipe (a FIFO), its exit status as ``subprocess`` gives it."""

    def __init__(self, zygote: Zygote, script: str, argv: Sequence[str], *,
                 env: Mapping[str, str], cwd: str | None = None,
                 module: str | None = None) -> None:
        import tempfile

        self._zygote = zygote
        self._dir = tempfile.mkdtemp(prefix="forked-")
        fifo = os.path.join(self._dir, "out")
        self.args = [sys.executable, *(["-m", module] if module else [script]), *argv]
        self.returncode: int | None = None
        self.pid, _ = zygote.run(script, argv, cwd=cwd or os.getcwd(), env=env, fifo=fifo,
                                 stderr=fifo, module=module)
        self.stdout = open(fifo)  # noqa: SIM115  (the worker opened its end: it runs)
        os.unlink(fifo)
        os.rmdir(self._dir)
        self._output: list[str] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)  # polled for its end, as subprocess.Popen.wait(timeout) does
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: str | None = None, timeout: float | None = None
                    ) -> tuple[str, None]:
        import time

        assert input is None, "no stdin"
        started = time.monotonic()
        if self._output is None:
            self._output = []
            stream, output = self.stdout, self._output
            self._reader = threading.Thread(target=lambda: output.extend(stream), daemon=True)
            self._reader.start()
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.stdout.close()
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        self.wait(left)
        return "".join(self._output), None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:

        self.send_signal(signal.SIGKILL)
