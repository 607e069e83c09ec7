"""Hostile files in a sharded snapshot never block or load unverified bytes (issue 25, item 3).

Step 2 of a sharded Checkpointer's snapshots has its marker ``.snapkeep-commit.json``, its DCP
``.metadata`` or a shard replaced by a FIFO (in place, or a symlink to one outside), a device
(``/dev/zero`` symlinked, or ``mknod``'ed), an oversized file, malformed content of many shapes,
or a path outside the directory (in the marker, or in the metadata's storage items: another
snapshot's shard, a FIFO outside). Every reader -- ``load_latest``,
``Checkpointer(sharded=True).load``, a SHARDED snapshot extension's autoload, ``snapkeep
verify`` -- must finish within 10 s: the loaders skip step 2 with a warning naming it and resume
step 1, verify exits 1 with step 2 corrupt.

Before: a FIFO marker blocked every reader forever, a device marker was read to the end of
memory, and a metadata path ``../ckpt_1/__0_0.distcp`` loaded another snapshot's bytes, never
verified by this one's marker. The matrix runs in one subprocess (one torch import; each reader
under a 60 s alarm), see ``hostile_sharded_worker.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.ranks import rank_env

WORKER = Path(__file__).with_name("hostile_sharded_worker.py")
sys.path.insert(0, str(WORKER.parent))
from hostile_sharded_worker import CASES  # noqa: E402

EXPECTED = {"load_latest": "step 1", "checkpointer": "step 1", "autoload": "step 1",
            "verify": 'exit 1 {"ckpt_1": "ok", "ckpt_2": "corrupt"}', "warned": [True]}


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs, mknod and /dev/zero: Linux")
def test_every_reader_skips_a_hostile_sharded_file_within_the_bound(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], env=rank_env(),
                         capture_output=True, text=True, timeout=300)
    outcomes = {(o := json.loads(line))["case"]: o for line in run.stdout.splitlines()
                if line.startswith("{")}
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(outcomes) == sorted(CASES)
    wrong = {case: {k: v for k, v in o.items() if k in EXPECTED and v != EXPECTED[k]}
             for case, o in outcomes.items()}
    assert {case: w for case, w in wrong.items() if w} == {}
