"""Helpers of the storage tests: moto's S3 server as a separate process, s3fs options with
dummy credentials, the backends of the contract suite, and a TCP proxy whose connections a test
can cut."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from snapkeep._core.storage import Storage, resolve_storage

BUCKET = "snapkeep-tests"
#: s3fs streams parts of this size; small so that a 12 MiB snapshot is a real multipart upload.
PART_BYTES = 5 << 20
SERVER_START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class MotoServer:
    """A moto S3 server process."""

    process: subprocess.Popen[bytes]
    endpoint: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_moto_server() -> MotoServer:
    """Start ``python -m moto.server`` on a free port and wait until it answers."""
    for _ in range(3):  # a port taken between choosing and binding: try another
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1) as response:
                    if response.status == 200:
                        return MotoServer(process=process, endpoint=endpoint)
            except OSError:
                time.sleep(0.05)  # polling a starting server; no event to wait on
        MotoServer(process=process, endpoint=endpoint).stop()
    raise RuntimeError("moto's S3 server did not start (is moto[server] installed?)")


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """storage_options for s3fs against ``endpoint``, with dummy credentials."""
    options: dict[str, Any] = {
        "key": "snapkeep-test-key",
        "secret": "snapkeep-test-secret",
        "endpoint_url": endpoint,
        "default_block_size": PART_BYTES,
        "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"},
                          "connect_timeout": 5, "read_timeout": 30},
    }
    options.update(extra)
    return options


@dataclasses.dataclass
class Backend:
    """One backend of the contract suite and a fresh output directory on it."""

    name: str
    out_dir: str
    storage_options: dict[str, Any]

    def storage(self) -> tuple[Storage, str]:
        return resolve_storage(self.out_dir, None, self.storage_options or None)

    def writer_kwargs(self) -> dict[str, Any]:
        return {"out_dir": self.out_dir, "storage_options": self.storage_options}

    def raw_names(self, sub: str = "") -> list[str]:
        """Every name in the directory as the backend lists it, temps included."""
        storage, path = self.storage()
        directory = storage.join(path, sub) if sub else path
        fs = storage.fs
        fs.invalidate_cache(directory)
        try:
            entries = fs.ls(directory, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(e["name"].rstrip("/")) + ("/" if e["type"] == "directory"
                                                                 else "") for e in entries)

    def path(self, name: str) -> str:
        storage, path = self.storage()
        return storage.join(path, name)

    def read(self, name: str) -> bytes:
        storage, _ = self.storage()
        return storage.read_bytes(self.path(name))

    def overwrite(self, name: str, data: bytes) -> None:
        """Replace an object's bytes behind snapkeep's back (to corrupt it)."""
        storage, _ = self.storage()
        storage.fs.pipe_file(self.path(name), data)

    def pending_uploads(self) -> list[Any]:
        """Uncompleted multipart uploads under this directory (S3 only; [] elsewhere)."""
        if self.name != "s3":
            return []
        storage, path = self.storage()
        uploads = storage.fs.list_multipart_uploads(BUCKET)
        prefix = path.split("/", 1)[1] + "/"
        return [u for u in uploads if u["Key"].startswith(prefix)]


def cli_flags(options: dict[str, Any]) -> list[str]:
    """``storage_options`` as the CLI's ``-o KEY=VALUE`` flags (nested dicts as ``KEY.SUB``)."""
    flags: list[str] = []
    for key, value in options.items():
        if isinstance(value, dict):
            flags += cli_flags({f"{key}.{k}": v for k, v in value.items()})
        else:
            flags += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return flags


class TcpProxy:
    """A TCP forwarder in front of a server whose connections a test can cut mid-transfer.

    ``cut()`` stops accepting (new connections are refused) and closes every open connection in
    both directions, as a network failure would.
    """

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, daemon=True, name="test-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._cut:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
