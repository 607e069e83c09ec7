"""A ppe-style training script with a real shuffled data loader, run by test_loader_resume.py.

    python loader_loop.py OUT --shape {snapkeep,ppe,swap,ddp} --loader {plain,stateful}
        --workers N --rng {global,generator} [--kill-at I] [--term-at I]

The loop is the user's unchanged ``while not manager.stop_trigger: for x, y in loader: with
manager.run_iteration(): ...``; snapshots every ``--every`` iterations (4) with autoload and
``loaders={'train': loader}``. ``--kill-at I`` SIGKILLs the process group (the test starts
it with ``start_new_session``; DataLoader workers die with it) inside iteration I (after the
forward pass, before the step); ``--term-at I`` sends SIGTERM there
(``extensions.preemption()`` snapshots and exits 143). At the end, ``OUT/final.pt`` holds the
parameters, optimizer state and the batches each iteration of this process saw.
``--shape ddp`` is started by torchrun (2 ranks, gloo, ``DistributedSampler``); rank 0 writes
``final.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

EPOCHS = 3
BATCH = 8
SAMPLES = 37  # 5 batches per epoch, the last one partial


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shape", default="snapkeep")
    parser.add_argument("--loader", default="plain")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--rng", default="global")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--term-at", type=int, default=-1)
    parser.add_argument("--no-loaders", action="store_true")
    parser.add_argument("--every", type=int, default=4, help="snapshot interval (iterations)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    distributed = args.shape == "ddp"
    rank = 0
    if distributed:
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
    import snapkeep
    from snapkeep.training import extensions as sk_extensions

    if args.shape == "ppe":
        import pytorch_pfn_extras as ns
    else:
        ns = snapkeep  # "swap": the import-swap spelling, `import snapkeep as ppe`
    torch.manual_seed(0)
    data = torch.randn(SAMPLES, 4)
    target = torch.randn(SAMPLES, 1)
    dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES), data, target)
    generator = torch.Generator().manual_seed(1) if args.rng == "generator" else None
    sampler = None
    if distributed:
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=3)
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    else:
        from torch.utils.data import DataLoader as Loader
    loader = Loader(dataset, batch_size=BATCH, shuffle=sampler is None, sampler=sampler,
                    generator=generator, num_workers=args.workers)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1))
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    writer = snapkeep.writing.SimpleWriter(out_dir=args.out)
    manager = ns.training.ExtensionsManager(model, optimizer, EPOCHS,
                                            iters_per_epoch=len(loader), writer=writer)
    loaders = None if args.no_loaders else {"train": loader}
    snapshot_kwargs = {"saver_rank": 0} if distributed else {}
    snapshot = (ns if args.shape == "swap" else snapkeep).training.extensions.snapshot
    manager.extend(snapshot(autoload=True, loaders=loaders, **snapshot_kwargs),
                   trigger=(args.every, "iteration"))
    if rank == 0:
        manager.extend(ns.training.extensions.LogReport(trigger=(1, "iteration")))
    if args.term_at >= 0:
        manager.extend(sk_extensions.preemption())
    seen: list[list[int]] = []
    while not manager.stop_trigger:
        if sampler is not None:
            sampler.set_epoch(manager.epoch)
        for index, x, y in loader:
            with manager.run_iteration(step_optimizers=["main"]):
                loss = torch.nn.functional.mse_loss(model(x), y)
                ns.reporting.report({"loss": loss.item()})
                loss.backward()
                seen.append(index.tolist())
                if manager.iteration + 1 == args.kill_at:
                    os.killpg(os.getpgid(0), signal.SIGKILL)  # the job: workers too
                if manager.iteration + 1 == args.term_at:
                    os.kill(os.getpid(), signal.SIGTERM)
    if rank == 0:
        module = model.module if distributed else model
        torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "iteration": manager.iteration, "seen": seen},
                   os.path.join(args.out, "final.pt"))
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
