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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid}), flush=True)
        continue
    # the worker: its own session, stdin from /dev/null, stdout the FIFO, stderr a file
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(request["stdout"], os.O_WRONLY), 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    sys.stdin = open(os.devnull)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["script"], *request["argv"]]
    sys.path[0] = os.path.dirname(request["script"])
    code = 0
    try:
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
'''


class Zygote:
    """The zygote process (see the module docstring); ``preload``: modules it imports."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _SERVER, *preload],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=dict(env), text=True)
        assert self.process.stdout is not None
        ready = self.process.stdout.readline().strip()
        if ready != "READY":
            self.stop()
            raise RuntimeError(f"the zygote did not start: {ready!r}")

    def _ask(self, request: dict[str, object]) -> dict[str, int]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError("the zygote died")
        return dict(json.loads(answer))

    def run(self, script: str, argv: Sequence[str], *, cwd: str, env: Mapping[str, str],
            fifo: str, stderr: str) -> tuple[int, Iterator[str]]:
        """Fork a worker running ``script``; returns its pid and its stdout's lines (read
        from ``fifo``, which this creates; the iterator ends when the worker's stdout closes).
        Call :meth:`wait` with the pid afterwards."""
        os.mkfifo(fifo)
        pid = self._ask({"script": script, "argv": list(argv), "cwd": cwd, "env": dict(env),
                         "stdout": fifo, "stderr": stderr})["pid"]

        def lines() -> Iterator[str]:
            with open(fifo) as stream:  # opened once the worker opened its end
                yield from stream
        return pid, lines()

    def wait(self, pid: int) -> int:
        """The worker's exit status as ``subprocess`` gives it (``-N`` for signal N)."""
        return self._ask({"wait": pid})["code"]

    def stop(self) -> None:
        if self.process.poll() is None:
            if self.process.stdin is not None:
                self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
