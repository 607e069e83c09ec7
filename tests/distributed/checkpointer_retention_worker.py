"""One rank of the sharded Checkpointer's retention tests (run by test_checkpointer_sharded.py).

Usage: ``python checkpointer_retention_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR KEEP STEPS``.

Saves a small model with ``snapkeep.Checkpointer(OUT_DIR, keep=...)`` (sharded: under
torch.distributed) at the steps STEPS (comma-separated), waiting for each commit so that its
retention (rank 0, after the commit) has run before the next save. KEEP is ``latest`` (keep=1)
or ``best:METRIC`` (``KeepBest(1, METRIC)``). Log records go to stdout; a save the retention
input check refuses prints ``refused at step N: <error>`` and ends the loop; prints ``done``.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.distributed as dist

import snapkeep
from snapkeep.retention import KeepBest, RetentionPolicy


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir, keep, steps = sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    policy: int | RetentionPolicy = 1 if keep == "latest" else KeepBest(1, keep.split(":", 1)[1])
    model = torch.nn.Linear(4, 2)
    with snapkeep.Checkpointer(out_dir, keep=policy, timeout_s=60) as ckpt:
        for step in (int(s) for s in steps.split(",")):
            try:
                ckpt.save(step, {"model": model}).committed.result()
            except (ValueError, snapkeep.errors.RankFailedError) as e:  # the retention check
                print(f"refused at step {step}: {type(e).__name__}: {e}", flush=True)
                break
            ckpt.wait()  # every rank: rank 0's retention ran on the commit thread
    print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
