"""Ray Train with snapkeep: a TorchTrainer of 2 CPU workers (gloo) snapshots through snapkeep,
reports each snapshot to Ray once it is committed and verified, and resumes after a worker dies.

    python ray_train.py /shared/runs            # a local Ray cluster, or the one RAY_ADDRESS names

Run it again with the same directory after the driver died: Ray restores the run (same
RunConfig name) and the workers resume from snapkeep's newest snapshot.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import ray.train
import torch
import torch.nn.functional as F
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import snapkeep
import snapkeep.ray


def synthetic_data(samples: int = 192) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=generator)
    return TensorDataset(x, (x.sum(dim=1, keepdim=True) > 0).float())


def train_func(config: dict[str, Any]) -> None:
    """Every Ray Train worker runs this: rank ``r`` of ``world_size``, torch.distributed
    initialized (gloo)."""
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)  # the same initial model on every rank
    model = prepare_model(torch.nn.Sequential(  # DistributedDataParallel
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)))
    torch.manual_seed(1 + rank)  # each rank its own dropout stream
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = config.get("dataset") or synthetic_data()
    loader = StatefulDataLoader(dataset, batch_size=8,
                                sampler=DistributedSampler(dataset, shuffle=True, seed=0),
                                generator=torch.Generator().manual_seed(rank))
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    steps, every = config["steps"], config["every"]
    with snapkeep.Checkpointer(config["snapshots"], keep=config.get("keep", 3)) as ckpt:
        step = snapkeep.ray.resume(ckpt, state) or 0  # Ray's checkpoint, or a first start
        while step < steps:
            loader.sampler.set_epoch(step // len(loader))  # the epoch this step is in
            for x, y in loader:
                loss = F.binary_cross_entropy_with_logits(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if step % every == 0 or step == steps:  # committed, verified, then reported
                    snapkeep.ray.report(ckpt, step, state, {"loss": loss.item(), "step": step})
                if step == steps:
                    break


def fit(storage: str, *, name: str = "snapkeep-ray", steps: int = 40, every: int = 4,
        keep: int | None = 3, num_to_keep: int | None = 2, max_failures: int = 3,
        dataset: Any = None) -> ray.train.Result:
    """Train with 2 workers; snapkeep's snapshots go to ``storage/name/snapshots``, Ray's run
    (its references to them) to ``storage/name``."""
    snapshots = os.path.join(os.path.abspath(storage), name, "snapshots")
    config = {"snapshots": snapshots, "steps": steps, "every": every, "keep": keep}
    if dataset is not None:
        config["dataset"] = dataset
    trainer = TorchTrainer(
        train_func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=name, storage_path=os.path.abspath(storage),
            failure_config=FailureConfig(max_failures=max_failures),  # restarts the group
            checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep)))  # Ray's references
    return trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("storage", help="shared directory for Ray's run and snapkeep's snapshots")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    result = fit(args.storage, steps=args.steps)
    reference = snapkeep.ray.reference_of(result.checkpoint)
    print(f"finished at step {reference.step}: {reference.path}")


if __name__ == "__main__":
    main()
