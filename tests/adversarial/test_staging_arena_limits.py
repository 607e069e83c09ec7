"""A process writer whose staging arena cannot be created (the shared-memory file cannot reach
the state's size): here through ``RLIMIT_FSIZE`` (``ulimit -f``, which batch systems set), whose
``ftruncate`` of the new ``/dev/shm`` segment fails with ``EFBIG``.

The snapshot call then raised a bare ``OSError: [Errno 27] File too large`` from
``multiprocessing.shared_memory`` (no snapkeep error type, no snapshot or ``/dev/shm`` named),
where the documented contract for a storage refusal is ``SnapshotStorageError`` (an ``OSError``)
naming the path and size, as a thread writer does for the same limit on the snapshot file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LIMIT_BYTES = 1 << 20  # the state below is 8 MB
SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    import torch
    import snapkeep
    from snapkeep import writing

    out, kind = sys.argv[1], sys.argv[2]
    limit = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    writer = getattr(writing, kind)(out_dir=out, timeout_s=60)
    report = {}
    try:
        writer("big", out, {"w": torch.ones(2_000_000)})
        writer.wait(timeout_s=60)
    except Exception as e:
        report["error"] = type(e).__name__
        report["storage_error"] = isinstance(e, snapkeep.SnapshotStorageError) or isinstance(
            e.__cause__, snapkeep.SnapshotStorageError)
        report["message"] = str(e)
    writer("small", out, {"w": torch.ones(4)})  # the writer still works afterwards
    writer.finalize()
    report["files"] = sorted(os.listdir(out))
    print(json.dumps(report))
""")


def _run(tmp_path: Path, kind: str) -> dict[str, object]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "out"), kind,
                           str(LIMIT_BYTES)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.timeout(150)
def test_process_writer_reports_an_arena_it_cannot_create_as_a_storage_error(
    tmp_path: Path,
) -> None:
    report = _run(tmp_path, "ProcessWriter")
    assert report["files"] == [".snapkeep", "small"], report
    assert report["storage_error"] is True, report
    assert "big" in str(report["message"]) and "/dev/shm" in str(report["message"]), report


SHM_SIZE = "16m"  # the state below is 32 MB; Docker's default /dev/shm is 64 MB
FULL_SHM_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import snapkeep
    from snapkeep import writing

    out = sys.argv[1]
    writer = writing.ProcessWriter(out_dir=out, timeout_s=60)
    report = {}
    try:
        writer("big", out, {"w": torch.ones(8_000_000)})
        writer.wait(timeout_s=60)
    except Exception as e:
        report["storage_error"] = isinstance(e, snapkeep.SnapshotStorageError) or isinstance(
            e.__cause__, snapkeep.SnapshotStorageError)
        report["message"] = str(e)
    writer("small", out, {"w": torch.ones(4)})
    writer.finalize()
    report["files"] = sorted(os.listdir(out))
    report["shm"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(report))
""")


def _private_small_shm_available() -> bool:
    """Whether this process may mount a tmpfs over /dev/shm in a private mount namespace
    (root or CAP_SYS_ADMIN, ``unshare`` installed); nothing outside the namespace changes."""
    try:
        probe = subprocess.run(["unshare", "-m", "sh", "-c",
                                "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.timeout(150)
@pytest.mark.skipif(not _private_small_shm_available(),
                    reason="needs unshare -m and mount (root) for a small private /dev/shm")
def test_a_dev_shm_smaller_than_the_state_is_an_error_not_a_crash(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = (f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && "
               f'exec "$0" -c "$1" "$2"')
    done = subprocess.run(["unshare", "-m", "sh", "-c", command, sys.executable,
                           FULL_SHM_SCRIPT, str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, f"the trainer died with {done.returncode}: {done.stderr[-2000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["storage_error"] is True, report
    assert "/dev/shm" in report["message"] and "big" in report["message"], report
    assert report["files"] == [".snapkeep", "small"] and report["shm"] == [], report
