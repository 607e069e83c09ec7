"""Backends for the storage contract suite: local, memory:// and a real S3-API server.

The S3 server is moto's server mode, started as a separate process on 127.0.0.1 (a free port,
waited on until it answers, stopped at the end of the session). s3fs talks to it over HTTP with
dummy credentials passed through ``storage_options`` -- nothing is mocked inside the client and
no AWS_* variable is set for other tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from support.leak_check import LONG_LIVED_PIDS
from support.storage_backends import BUCKET, Backend, MotoServer, s3_options, start_moto_server


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
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


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
    run = f"run-{uuid.uuid4().hex[:10]}"
    if request.param == "local":
        yield Backend("local", str(tmp_path / run), {})
    elif request.param == "memory":
        b = Backend("memory", f"memory://snapkeep-tests/{run}", {})
        yield b
        storage, path = b.storage()
        if storage.fs.exists(path):
            storage.fs.rm(path, recursive=True)
    else:
        server = request.getfixturevalue("moto_server")
        yield Backend("s3", f"s3://{BUCKET}/{run}", s3_options(server.endpoint))


