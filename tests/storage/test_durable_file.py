"""``DurableFile`` (the sharded save's DCP files): the bytes on disk, their recorded checksum
and size agree whether or not ``O_DIRECT`` is used, a file left at the path by an earlier
(uncommitted) write is replaced, and a symlink there is replaced, never followed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from snapkeep._core.format.checksum import digest_file
from snapkeep._core.storage import DurableFile


@pytest.mark.parametrize("direct_io", [True, False])
def test_what_it_records_is_what_is_on_disk(tmp_path, direct_io):
    path = str(tmp_path / "__0_0.distcp")
    (tmp_path / "__0_0.distcp").write_bytes(b"an older, longer file from a save written again" * 99)
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    durable = DurableFile(path, direct_io=direct_io)
    for start in (0, 5, 4096 * 3 + 1, 1 << 20):  # unaligned pieces, a large one
        durable.write(data[start:start + 7 if start < 1 << 20 else None])
    durable.close()
    durable.close()  # idempotent
    expected = b"".join(data[s:s + 7] for s in (0, 5, 4096 * 3 + 1)) + data[1 << 20:]
    assert durable.durable
    assert (tmp_path / "__0_0.distcp").read_bytes() == expected
    assert digest_file(path) == (durable.hexdigest(), durable.size_bytes)
    assert durable.size_bytes == len(expected)


def test_a_symlink_at_the_path_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.symlink(victim, tmp_path / "f.distcp")
    durable = DurableFile(str(tmp_path / "f.distcp"))
    durable.write(b"shard")
    durable.close()
    assert victim.read_bytes() == b"keep me"
    assert not (tmp_path / "f.distcp").is_symlink()
    assert (tmp_path / "f.distcp").read_bytes() == b"shard"


def test_abort_closes_without_fsync(tmp_path):
    durable = DurableFile(str(tmp_path / "f"))
    durable.write(b"partial")
    durable.abort()
    durable.abort()
    assert not durable.durable and durable.closed
