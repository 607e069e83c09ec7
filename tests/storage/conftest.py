"""Backends for the storage contract suite: local, memory:// and a real S3-API server.

The S3 server is moto's server mode, started as a separate process on 127.0.0.1 (a free port,
waited on until it answers, stopped at the end of the session: the ``moto_server``
fixture of tests/conftest.py, shared with the door matrix). s3fs talks to it over HTTP with
dummy credentials passed through ``storage_options`` -- nothing is mocked inside the client and
no AWS_* variable is set for other tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from support.storage_backends import BUCKET, Backend, s3_options


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


