"""Storage errors: unknown protocols name the package to install; an unreachable endpoint or
missing credentials name the URL and never the credentials; a connection dropped during an upload
leaves no visible object and surfaces once; listings and reads bypass fsspec's caches."""

from __future__ import annotations

import importlib.util
import sys
import traceback
import uuid
from typing import Any

import pytest
import torch

import snapkeep
from snapkeep import writing
from snapkeep._core.storage import resolve_storage
from snapkeep._core.store.files import SnapshotStore
from support.storage_backends import (
    BUCKET,
    PART_BYTES,
    Backend,
    MotoServer,
    TcpProxy,
    free_port,
    s3_options,
)

WAIT_S = 30.0
SECRET = "never-print-this-secret-0x5eed"
FAST_FAIL = {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10}


def _full_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


# -- unknown protocols -----------------------------------------------------------------------------
def test_missing_backend_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("gcsfs") is not None:
        monkeypatch.setitem(sys.modules, "gcsfs", None)  # make it missing for this test
    with pytest.raises(ValueError, match=r"'gs'.*pip install gcsfs"):
        resolve_storage("gs://bucket/run")
    writer = writing.SimpleWriter(out_dir="gs://bucket/run")
    with pytest.raises(ValueError, match="pip install gcsfs") as info:
        writer.initialize("")
    assert "gs://bucket/run" in str(info.value)
    writer.finalize()


def test_invented_protocol_is_named_with_what_is_accepted() -> None:
    with pytest.raises(ValueError) as info:
        resolve_storage("snapkeepnope://bucket/run")
    message = str(info.value)
    assert "'snapkeepnope'" in message and "fsspec does not know" in message
    assert "s3://bucket/run" in message  # what is accepted


def test_storage_options_with_an_explicit_fs_are_refused() -> None:
    import fsspec

    with pytest.raises(ValueError, match="storage_options only apply"):
        resolve_storage("run", fsspec.filesystem("memory"), {"key": "k"})


# -- unreachable endpoint, missing credentials -----------------------------------------------------
@pytest.mark.s3
def test_unreachable_endpoint_names_the_url_and_never_the_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("s3fs")
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    options = s3_options(endpoint, secret=SECRET, config_kwargs=FAST_FAIL)
    writer = writing.SimpleWriter(out_dir="s3://bucket/run", storage_options=options)
    with pytest.raises(snapkeep.SnapshotStorageError) as info:
        writer.initialize("")
    message = str(info.value)
    assert "s3://bucket/run" in message and endpoint in message
    assert "reachable" in message
    assert isinstance(info.value, OSError)
    for text in (_full_text(info.value), caplog.text, repr(writer.storage_for("")[0])):
        assert SECRET not in text and options["key"] not in text
    writer.finalize()


@pytest.mark.s3
def test_missing_credentials_name_the_url(moto_server: MotoServer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/snapkeep/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/snapkeep/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = s3_options(moto_server.endpoint, config_kwargs=FAST_FAIL)
    del options["key"], options["secret"]
    options["skip_instance_cache"] = True
    url = f"s3://{BUCKET}/no-credentials"
    writer = writing.SimpleWriter(out_dir=url, storage_options=options)
    with pytest.raises(snapkeep.SnapshotStorageError) as info:
        writer.initialize("")
    assert url in str(info.value) and "credentials" in str(info.value)
    writer.finalize()


# -- a connection dropped during an upload ---------------------------------------------------------
@pytest.mark.s3
def test_connection_dropped_mid_upload_leaves_no_object_and_surfaces_once(
    moto_server: MotoServer, caplog: pytest.LogCaptureFixture,
) -> None:
    port = int(moto_server.endpoint.rsplit(":", 1)[1])
    proxy = TcpProxy(port)
    run = f"s3://{BUCKET}/dropped-{uuid.uuid4().hex[:8]}"
    direct = Backend("s3", run, s3_options(moto_server.endpoint))
    through_proxy = s3_options(proxy.endpoint, config_kwargs=FAST_FAIL, skip_instance_cache=True)
    writer = writing.ThreadWriter(out_dir=run, storage_options=through_proxy)
    writer("snap_iter_1", "", {"w": torch.arange(4.0)}, step=1)
    writer.wait(WAIT_S)
    before = direct.read("snap_iter_1")

    def savefun(obj: Any, f: Any) -> None:
        f.write(b"\x01" * (PART_BYTES + (1 << 20)))  # the first part reaches the server
        proxy.cut()  # the network goes away mid-upload
        f.write(b"\x02" * (PART_BYTES + (1 << 20)))

    writer("snap_iter_2", "", {"w": torch.zeros(4)}, savefun=savefun, step=2)
    with pytest.raises(snapkeep.SnapshotSaveError) as info:
        writer.wait(WAIT_S)
    storage_error = info.value.__cause__
    assert isinstance(storage_error, snapkeep.SnapshotStorageError), _full_text(info.value)
    assert f"{run}/snap_iter_2" in str(storage_error) and proxy.endpoint in str(storage_error)
    assert storage_error.size_bytes is not None and storage_error.size_bytes > PART_BYTES
    writer.finalize()  # reported once already: nothing raised again

    assert direct.raw_names() == [".snapkeep/", "snap_iter_1"]  # no object under the name
    assert direct.read("snap_iter_1") == before
    storage, path = direct.storage()
    catalog = SnapshotStore(storage, path, "snap_iter_{step}")
    assert [e.name for e in catalog.entries()] == ["snap_iter_1"]
    assert catalog.verify(catalog.entries()[0]) is not None
    # the abort could not reach the server either: its parts wait there, invisible, for a
    # lifecycle rule; the failure to abort was logged
    [pending] = direct.pending_uploads()
    assert pending["Key"].endswith("snap_iter_2")
    assert "aborting the partial upload" in caplog.text
    storage.fs.abort_mpu(BUCKET, pending["Key"], pending["UploadId"])
    assert SECRET not in caplog.text


# -- caches ----------------------------------------------------------------------------------------
@pytest.mark.s3
def test_listings_and_reads_never_come_from_fsspec_caches(moto_server: MotoServer) -> None:
    import s3fs

    run = f"s3://{BUCKET}/cache-{uuid.uuid4().hex[:8]}"
    storage, path = resolve_storage(run, None, s3_options(moto_server.endpoint))
    storage.write_bytes(f"{path}/snap_1", b"first")
    assert storage.list_names(path) == ["snap_1"]
    storage.fs.ls(path)  # fsspec now caches this listing

    other = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options(moto_server.endpoint))
    other.pipe_file(f"{path}/snap_2", b"second")
    other.pipe_file(f"{path}/snap_1", b"first, rewritten longer")
    cached = sorted(e.rsplit("/", 1)[1] for e in storage.fs.ls(path))
    assert cached == ["snap_1"]  # fsspec's cached view is stale ...

    assert storage.list_names(path) == ["snap_1", "snap_2"]  # ... snapkeep's is not
    assert storage.size(f"{path}/snap_1") == len(b"first, rewritten longer")
    assert storage.read_bytes(f"{path}/snap_1") == b"first, rewritten longer"
