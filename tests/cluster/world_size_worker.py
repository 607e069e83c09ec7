"""A torchrun job whose data position is saved mid-epoch on one world size and resumed on
another (run by test_world_size_change.py).

Usage: ``torchrun --standalone --nproc-per-node=N world_size_worker.py OUT PHASE LOG``.
``PHASE`` ``save``: epoch 0 over 48 sample ids with ``DistributedSampler(shuffle=True)`` and
batch size 2, a sharded Checkpointer snapshot after 3 batches, then stop. ``resume``: load it;
on success feed the rest of the epoch. Each rank appends ``<rank> <sample id>`` per sample fed
to ``LOG.<rank>``, and prints ``refused: <message>`` with ``untouched <bool>`` (the model's
parameters are still their fresh values) when the load is refused. The loader is torchdata's
``StatefulDataLoader``; ``SAMPLER=random``: a ``RandomSampler`` per rank instead.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import snapkeep


def main() -> None:
    out, phase, log = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    fresh = [p.detach().clone() for p in model.parameters()]
    dataset = TensorDataset(torch.arange(48))
    sampler: torch.utils.data.Sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    if os.environ.get("SAMPLER") == "random":  # each rank its own order of every sample
        sampler = torch.utils.data.RandomSampler(
            dataset, generator=torch.Generator().manual_seed(rank))
    from torchdata.stateful_dataloader import StatefulDataLoader

    # the sharded Checkpointer keeps a StatefulDataLoader's position (a plain DataLoader's is
    # refused under sharded snapshots, with a message naming StatefulDataLoader)
    loader: DataLoader = StatefulDataLoader(dataset, batch_size=2, sampler=sampler)
    state = {"model": model, "loader": loader}
    with open(f"{log}.{rank}", "a") as ids, snapkeep.Checkpointer(out, timeout_s=60) as ckpt:
        if phase == "resume":
            try:
                step = ckpt.load(into=state) or 0
            except (ValueError, snapkeep.errors.StateMismatchError,
                    snapkeep.errors.RankFailedError) as e:  # the mismatch, gathered on every rank
                untouched = all(torch.equal(a, b) for a, b in zip(fresh, model.parameters()))
                print(f"refused: {e}", flush=True)
                print(f"untouched {untouched}", flush=True)
                with open(f"{log}-refused.{rank}", "w") as f:  # the ranks' stdout interleaves
                    f.write(f"refused: {e}\nuntouched {untouched}\n")
                dist.barrier()
                dist.destroy_process_group()
                return
        else:
            step = 0
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(0)
        for (x,) in loader:
            ids.write("".join(f"{rank} {int(i)}\n" for i in x))
            step += 1
            if phase == "save" and step == 3:
                ckpt.save(step, state)
                break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
