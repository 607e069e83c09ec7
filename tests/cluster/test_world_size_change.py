"""Restarts on another world size (issue 33, item 3): a data position saved mid-epoch under
torchrun on W ranks and resumed on W' ranks is refused before anything is loaded (model and
optimizer included), naming both world sizes; on the same world size the epoch continues
exactly (every sample id fed once across the ranks, checked from the ranks' logs)."""

from __future__ import annotations

import pathlib
from collections import Counter

import pytest

from support import ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKER = pathlib.Path(__file__).with_name("world_size_worker.py")
SAMPLES = 48


def _run(nproc: int, out: pathlib.Path, phase: str, log: pathlib.Path,
         sampler: str = "distributed") -> str:
    if phase == "save":  # the job that saves: its ranks forked with torchrun's environment
        # (support.ranks.torchrun_forked: the same env:// job, without the agent's and each
        # rank's interpreter start and torch import); the resume, what is checked, is torchrun's
        return ranks.run_torchrun_forked(WORKER, [str(out), phase, str(log)], nproc=nproc,
                                         env={"SAMPLER": sampler}, timeout_s=400)
    proc = ranks.torchrun(WORKER, [str(out), phase, str(log)], nproc=nproc,
                          env={"SAMPLER": sampler})
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output[-4000:]
    return output


def _ids(log: pathlib.Path) -> list[int]:
    return [int(line.split()[1]) for path in sorted(log.parent.glob(log.name + ".*"))
            for line in path.read_text().splitlines()]


@pytest.mark.parametrize(("before", "after", "sampler"), [
    (2, 1, "distributed"), (1, 2, "distributed"), (2, 4, "distributed")])
def test_another_world_size_is_refused_before_anything_loads(
        tmp_path: pathlib.Path, before: int, after: int, sampler: str) -> None:
    """StatefulDataLoader with DistributedSampler(shuffle=True), sharded Checkpointer. (A
    sampler that does not split the data by rank is a full pass on every rank: rank r of the
    new job continues rank r's pass; the sharded demo resumes so on another number of ranks,
    tests/distributed/test_demo_sharded.py.)"""
    out, log = tmp_path / "out", tmp_path / "ids"
    _run(before, out, "save", log, sampler)
    assert len(_ids(log)) == 3 * 2 * before  # 3 batches of 2 on each rank
    output = _run(after, out, "resume", log, sampler)
    # each rank's result from its own file: 4 ranks' long lines interleave on one stdout
    results = [path.read_text() for path in sorted(log.parent.glob(log.name + "-refused.*"))]
    assert len(results) == after, output[-4000:]  # every rank, before anything was loaded
    assert all(f"taken on {before} rank(s)" in r and f"this job runs {after}" in r
               for r in results), results
    assert all(r.endswith("untouched True\n") for r in results), results


def test_the_same_world_size_continues_exactly(tmp_path: pathlib.Path) -> None:
    out, log = tmp_path / "out", tmp_path / "ids"
    _run(2, out, "save", log)
    _run(2, out, "resume", log)
    assert Counter(_ids(log)) == Counter(range(SAMPLES))  # each sample id once, none missing
