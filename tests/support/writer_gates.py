"""Gates and savefuns for writer tests: stall a background save until the test releases it.

Two gates with one interface (``savefun``, ``wait_entered()``, ``release()``):

- :class:`EventGate` for thread writers (``threading`` primitives, a closure as savefun);
- :class:`SocketGate` for process writers: the worker's savefun (a module-level function, so it
  pickles) connects to a Unix socket the test listens on and blocks until the test sends a byte.

Every wait on both sides is bounded (``GATE_TIMEOUT_S``); nothing sleeps.

Also worker faults: :func:`worker_killing_save` (the worker dies in the savefun, the trainer's own
write fails) and :class:`KillAfterCommitFileSystem` (the worker dies right after its commit).
"""

from __future__ import annotations

import errno
import functools
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

GATE_TIMEOUT_S = 30.0


def fast_start_method() -> str:
    """``'forkserver'`` with snapkeep preloaded: process-writer workers then start in a fraction
    of a second instead of importing torch each time (~2 s with ``spawn``). Fault and
    back-pressure tests use it; the consistency and subprocess tests keep the default ``spawn``.
    """
    multiprocessing.set_forkserver_preload(["snapkeep._core.save.executors",
                                            "support.writer_gates"])
    return "forkserver"


class InjectedError(ValueError):
    """What the failing savefuns raise (a distinct type, so tests can check ``__cause__``)."""


def failing_save(obj: Any, f: Any, **_: Any) -> None:
    """A picklable savefun that writes a few bytes and then fails."""
    f.write(b"partial")
    raise InjectedError("injected failure in savefun")


def gated_save(obj: Any, f: Any, *, gate_address: str | None = None, **kwargs: Any) -> None:
    """``torch.save`` after the test releases the gate at ``gate_address`` (a Unix socket)."""
    if gate_address is not None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(GATE_TIMEOUT_S)
            s.connect(gate_address)
            if s.recv(1) != b"g":
                raise RuntimeError("the test closed the gate without releasing it")
    torch.save(obj, f, **kwargs)


class SocketGate:
    """Cross-process gate: one connection per save, released one by one, in order."""

    def __init__(self) -> None:
        # AF_UNIX paths are limited to ~108 bytes: keep it short, outside pytest's tmp_path.
        self._dir = tempfile.mkdtemp(prefix="skg")
        self.address = os.path.join(self._dir, "g")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(16)
        self._sock.settimeout(GATE_TIMEOUT_S)
        self._waiting: list[socket.socket] = []

    @property
    def savefun(self) -> Any:
        """A picklable savefun bound to this gate (queue writers take no savefun kwargs)."""
        return functools.partial(gated_save, gate_address=self.address)

    def wait_entered(self) -> None:
        """Block (bounded) until one more save has entered the savefun."""
        conn, _ = self._sock.accept()
        conn.settimeout(GATE_TIMEOUT_S)
        self._waiting.append(conn)

    def release(self) -> None:
        """Let the oldest entered save proceed."""
        conn = self._waiting.pop(0)
        conn.sendall(b"g")
        conn.close()

    def drop_oldest(self) -> None:
        """Forget the oldest entered save (its process was killed)."""
        self._waiting.pop(0).close()

    def close(self) -> None:
        for conn in self._waiting:
            conn.close()  # a waiting savefun sees EOF and fails instead of hanging
        self._waiting.clear()
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class EventGate:
    """In-process gate for thread writers: counts entries and releases."""

    def __init__(self) -> None:
        self._entered = threading.Semaphore(0)
        self._go = threading.Semaphore(0)
        self._opened = threading.Event()
        self.entered_count = 0

    def savefun(self, obj: Any, f: Any, **kwargs: Any) -> None:
        self.entered_count += 1
        self._entered.release()
        if not self._opened.is_set() and not self._go.acquire(timeout=GATE_TIMEOUT_S):
            raise TimeoutError("gate never released")
        torch.save(obj, f, **kwargs)

    def wait_entered(self) -> None:
        if not self._entered.acquire(timeout=GATE_TIMEOUT_S):
            raise TimeoutError("no save entered the savefun")

    def release(self) -> None:
        self._go.release()

    def open(self) -> None:
        """Release every current and future save."""
        self._opened.set()
        self._go.release(100)

    def close(self) -> None:
        self.open()


def file_gated_save(obj: Any, f: Any, *, gate_dir: str, **kwargs: Any) -> None:
    """``torch.save`` after the file ``<gate_dir>/go`` appears; ``<gate_dir>/entered.<pid>`` says
    the save started. For a test that kills the trainer: the gate lives in the filesystem, not in
    a connection that either side's death could close. Polls (bounded by ``GATE_TIMEOUT_S``)."""
    import time

    with open(os.path.join(gate_dir, f"entered.{os.getpid()}"), "wb"):
        pass
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not os.path.exists(os.path.join(gate_dir, "go")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate {gate_dir} was never opened")
        time.sleep(0.02)
    torch.save(obj, f, **kwargs)


def worker_killing_save(obj: Any, f: Any, *, trainer_pid: int, manifest_dir: str | None = None,
                        **kwargs: Any) -> None:
    """Kills the process running it (SIGKILL) unless it is the trainer ``trainer_pid``, where it
    fails as a full disk does: a worker that dies and a trainer that cannot write either. With
    ``manifest_dir``, the worker first leaves a manifest temp file there, named as its own."""
    if os.getpid() != trainer_pid:
        if manifest_dir is not None:
            from snapkeep._core.storage import Storage

            storage = Storage(LocalFileSystem())
            with open(storage.temp_name_for(os.path.join(manifest_dir, "x.json")), "wb"):
                pass
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, "No space left on device (injected in the trainer)")


class CopyGate:
    """Holds an overlapped snapshot's background copy (the snapshot extension's
    ``_overlap_before_copy`` seam) until :meth:`open`, for at most ``timeout_s``."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self._timeout_s = timeout_s

    def __call__(self) -> None:
        self.entered.set()
        if not self.released.wait(self._timeout_s):
            raise TimeoutError("gate never opened")

    def open(self) -> None:
        self.released.set()


class KillAfterCommitFileSystem(LocalFileSystem):
    """The local filesystem, except that a process other than ``trainer_pid`` SIGKILLs itself
    once a manifest is in place (snapshot and manifest both committed, before the worker could
    report it), if the file ``armed`` still exists; it removes ``armed`` first, so one worker
    dies this way and the file's absence afterwards proves that the kill point was reached."""

    cachable = False

    def __init__(self, *, armed: str, trainer_pid: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.armed = armed
        self.trainer_pid = trainer_pid

    def invalidate_cache(self, path: str | None = None) -> None:
        super().invalidate_cache(path)
        if (os.getpid() == self.trainer_pid or path is None or not path.endswith(".json")
                or not os.path.exists(path)):
            return
        try:
            os.unlink(self.armed)
        except FileNotFoundError:
            return
        os.kill(os.getpid(), signal.SIGKILL)
