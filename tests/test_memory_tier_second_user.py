"""The memory tier under a second local user (issue 25, item 2): a process running as
``nobody`` (``setpriv --reuid=65534``) on the same tmpfs-like root (a ``1777`` directory, as
``/dev/shm``) can neither read, poison nor remove a tier.

- read / remove: our tier left by a killed run. As nobody: listing it, opening its RAM snapshot
  or owner record, creating a file in it, removing it, renaming it away: each refused by the
  kernel. The rerun then resumes from that RAM.
- poison: nobody plants, under the name our training's tier has, a complete, valid tier (RAM
  snapshot, manifest, and an owner record naming our out_dir and template) holding other
  weights, and a symlink under the name of a second training's tier. Our trainings never
  resume from, write into or remove either (before: the planted tier was resumed from, the
  symlink written and removed through).

The attacker runs the system's ``python3`` (the stdlib only: nobody cannot read the venv).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from snapkeep import writing
from snapkeep._core.tiers.memory_store import job_id, tier_dir
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext

TEMPLATE = "snapshot_iter_{.iteration}"
NOBODY = 65534
SETPRIV = shutil.which("setpriv")
PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or SETPRIV is None
    or not os.path.exists(PYTHON),
    reason="needs root, setpriv and the system python3 to run a process as another uid")

ATTACK = r"""
import errno, json, os, shutil, sys
root, name, action = sys.argv[1], sys.argv[2], sys.argv[3]
tier = os.path.join(root, name)
out = {}
def attempt(what, fn):
    try:
        fn()
        out[what] = "succeeded"
    except OSError as e:
        out[what] = errno.errorcode.get(e.errno, str(e.errno))
if action == "attack":
    attempt("list", lambda: os.listdir(tier))
    attempt("list rank0", lambda: os.listdir(os.path.join(tier, "rank0")))
    attempt("read ram", lambda: open(os.path.join(tier, "rank0", "ram_iter_4"), "rb").read())
    attempt("read owner", lambda: open(os.path.join(tier, "owner-rank0.json"), "rb").read())
    attempt("write", lambda: open(os.path.join(tier, "planted"), "wb").close())
    attempt("rename", lambda: os.rename(tier, os.path.join(root, "moved")))
    attempt("rmdir", lambda: os.rmdir(tier))
    def rmtree():
        shutil.rmtree(tier)
    attempt("rmtree", rmtree)
elif action == "plant":
    attempt("plant tier", lambda: os.rename(sys.argv[4], tier))
    attempt("plant symlink", lambda: os.symlink(sys.argv[6], os.path.join(root, sys.argv[5])))
print(json.dumps(out))
"""


def _as_nobody(*args: str) -> dict[str, str]:
    done = subprocess.run([str(SETPRIV), f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", PYTHON, "-c", ATTACK, *args],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    result: dict[str, str] = json.loads(done.stdout)
    return result


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A ``1777`` directory under ``/tmp`` (nobody can reach it: pytest's tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="snapkeep-shared-", dir="/tmp"))
    os.chmod(root, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root)


def _run(out: Path, root: Path, until: int, *, seed: int = 0, job: str | None = None,
         finish: bool = False) -> tuple[ExtensionsManager, torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ExtensionsManager(model, optimizer, 1, iters_per_epoch=8, out_dir=str(out),
                                writer=writing.SimpleWriter(out_dir=str(out)))
    manager.extend(ext.snapshot(filename=TEMPLATE, autoload=True), trigger=(3, "iteration"))
    tier = ext.memory_tier(ext.MemoryTier(every=2, replicas=0, root=str(root), job=job))
    manager.extend(tier)
    manager.start_extensions()
    while manager.iteration < until:
        with manager.run_iteration():
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
    tier.wait()
    if finish:
        manager.finalize()
    return manager, model, tier


def test_another_user_can_neither_read_nor_remove_a_tier(tmp_path: Path,
                                                         shared_root: Path) -> None:
    out = tmp_path / "out"
    _run(out, shared_root, 5)
    name = f"snapkeep-{job_id(str(out), TEMPLATE)}"
    got = _as_nobody(str(shared_root), name, "attack")
    assert got == {"list": "EACCES", "list rank0": "EACCES", "read ram": "EACCES",
                   "read owner": "EACCES", "write": "EACCES", "rename": "EPERM",
                   "rmdir": "EPERM", "rmtree": "EACCES"}, got
    _, _, tier = _run(out, shared_root, 6)
    assert tier.restored is not None and tier.restored.source == "own"
    assert tier.restored.step == 4


def test_another_users_planted_tier_or_symlink_is_never_used_written_or_removed(
        tmp_path: Path, shared_root: Path) -> None:
    out, other_out = tmp_path / "out", tmp_path / "other"
    name = f"snapkeep-{job_id(str(out), TEMPLATE)}"
    link_name = f"snapkeep-{job_id(str(other_out), TEMPLATE)}"
    # the forged tier: complete and valid for `out` (owner record naming out's identity), but
    # other weights (seed 1), owned by nobody, staged where nobody can rename it from
    staging = Path(tempfile.mkdtemp(prefix="snapkeep-stage-", dir="/tmp"))
    try:
        os.chmod(staging, 0o1777)
        _run(tmp_path / "forger", staging, 5, seed=1, job=name[len("snapkeep-"):])
        forged = Path(tier_dir(str(staging), name[len("snapkeep-"):]))
        record = forged / "owner-rank0.json"
        body = json.loads(record.read_text())
        record.write_text(json.dumps(dict(body, out_dir=str(out), pid=2**22 + 12345)))
        victim = staging / "nobody-dir"
        victim.mkdir()
        for path in [forged, *forged.rglob("*"), victim]:
            os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        got = _as_nobody(str(shared_root), name, "plant", str(forged), link_name, str(victim))
        assert got == {"plant tier": "succeeded", "plant symlink": "succeeded"}, got
        before = sorted(str(p.relative_to(shared_root)) for p in shared_root.rglob("*"))

        manager, model, tier = _run(out, shared_root, 3, finish=True)
        assert tier.restored is None and manager.iteration == 3  # fresh: not the forged RAM
        _, _, other = _run(other_out, shared_root, 3, finish=True)
        assert other.restored is None
        after = sorted(str(p.relative_to(shared_root)) for p in shared_root.rglob("*"))
        assert after == before  # nothing written into, or removed from, either
        assert os.listdir(victim) == []
        assert (shared_root / name).stat().st_uid == NOBODY
    finally:
        shutil.rmtree(staging)
