"""Sharded snapshots on CPU ranks (gloo, FSDP2): snapkeep SHARDED against DCP ``save`` and
``async_save`` in the same run, loads with and without resharding, peak RSS per rank.

    python benchmarks/bench_sharded.py --worlds 4 2 --hidden 1024 --repeats 3 --json out.json

For each world size (largest first) the script spawns that many gloo ranks. Each rank builds an
MLP of ``--layers`` ``hidden x hidden`` linear layers, shards it with ``fully_shard`` (per layer
and the root), takes one Adam step (so Adam's moments exist) and then, ``--repeats`` times each:

- **snapkeep**: ``ShardedSaver.save`` of ``get_state_dict``'s output, overlapped (what the
  SHARDED extension does by default: the optimizer's local shards are copied on the background
  staging thread, validated at the next ``step()``): *stall* = the call, *copy wait* = what a
  ``step()`` right after the call would wait for that copy (``settle_overlap``; the worst case:
  in a loop the forward/backward in between hides some or all of it), *durable* = until the
  marker is committed on every rank; **snapkeep in call**: the same with ``overlap`` off (every
  shard copied in the call);
- **DCP save**: ``dcp.save`` (stall = durable);
- **DCP async_save**: ``dcp.async_save`` on a gloo group: stall = the call, durable = its
  future;
- **raw write+fsync** (the lower bound of any durable save through the page cache): each rank
  writes its local shards' bytes (parameters and Adam's moments, as staged) to one file,
  ``fsync``, then rank 0 fsyncs the directory; **raw O_DIRECT write+fsync**: the same bytes
  through snapkeep's ``DurableFile`` (``O_DIRECT``, checksummed on the way), the lower bound
  of snapkeep's write;
- **load**: snapkeep's ``load_sharded`` and ``dcp.load`` of the snapshot just written (same world
  size); **load resharded**: of the snapshot written by the previous (larger) world size. Loads
  are cold for both: each snapshot's files are dropped from the page cache first
  (``posix_fadvise(DONTNEED)``), as after a restart on another node; snapkeep writes with
  ``O_DIRECT`` (its files are never in the cache) and DCP through the page cache (its files
  would be read from memory right after the save otherwise). Before each load the machine's
  dirty pages are written back (``sync``); the two loaders run ABBA within a repeat and BAAB in
  the next (two loads of each per repeat, so the load medians are over twice the repeats); as
  the disk's speed drifts during a run, the targets also give the median over repeats of each
  repeat's paired ratio (its two snapkeep loads over its two DCP loads).

The contenders run in rotating order within each repeat. Figures are medians over repeats
of the slowest rank (the step ends when every rank is done), with the range over repeats;
snapkeep's durable time is broken down by phase (each the slowest rank's, see
``ShardedSaver.last_commit_phases_s``: stage, verdict (until the copy was validated), prepare,
plan, write; rank 0's dcp_finish, metadata_and_directory_fsync, marker, agree_committed; the
other ranks' await_commit, which spans rank 0's finish, so it is left out of the sum);
peak RSS per rank is ``ru_maxrss`` (the largest rank). The machine is shared: compare rows of one
run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


PHASES = ("stage", "verdict", "prepare", "plan", "write", "dcp_finish",
          "metadata_and_directory_fsync", "marker", "agree_committed", "await_commit")


def _slowest_each(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def _raw_write(state: dict[str, Any], path: str, directory: str, *, direct: bool = False
               ) -> float:
    """Write this rank's local tensor bytes to ``path`` and fsync it (rank 0 then fsyncs the
    directory): the physical part of a durable save, in seconds (slowest rank). ``direct``:
    through snapkeep's ``DurableFile`` (``O_DIRECT``, XXH3-128 on the way) instead of the page
    cache."""
    from torch.distributed.tensor import DTensor

    from snapkeep._core.storage import DurableFile

    def leaves(tree: Any) -> Any:
        if isinstance(tree, dict):
            for v in tree.values():
                yield from leaves(v)
        elif isinstance(tree, (list, tuple)):
            for v in tree:
                yield from leaves(v)
        elif isinstance(tree, torch.Tensor):
            yield tree.to_local() if isinstance(tree, DTensor) else tree

    tensors = [t.detach().contiguous() for t in leaves(state)]
    dist.barrier()
    start = time.perf_counter()
    if direct:
        durable = DurableFile(path)
        for t in tensors:
            durable.write(t.view(-1).view(torch.uint8).numpy().data)
        durable.close()
    else:
        with open(path, "wb") as f:
            for t in tensors:
                f.write(t.view(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()
    if dist.get_rank() == 0:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return _slowest(time.perf_counter() - start)


def _drop_cached(directory: str) -> None:
    """Evict ``directory``'s files from the page cache (clean after their fsync), so a load
    reads them from the disk."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cold(directory: str) -> None:
    """Every rank waits until rank 0 wrote back every dirty page of the machine (``sync``: the
    contenders' writes must not share the disk with the timed read) and dropped
    ``directory`` from the page cache."""
    if dist.get_rank() == 0:
        os.sync()
        _drop_cached(directory)
    dist.barrier()


def rank_main(rank: int, world: int, args: argparse.Namespace, base: str, results: str,
              previous: str | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from snapkeep._core.distributed.groups import background_groups
    from snapkeep._core.distributed.sharded import ShardedJob, ShardedSaver, load_sharded
    from snapkeep._core.distributed.sharded_store import ShardedStore
    from snapkeep._core.storage import resolve_storage
    from snapkeep.staging import StagingGuard, owned_storages

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{base}/init{world}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.hidden, args.hidden)
                                  for _ in range(args.layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, args.hidden)).sum().backward()
    optimizer.step()
    groups = background_groups(600)
    out = os.path.join(base, f"w{world}")
    storage, directory = resolve_storage(out)
    store = ShardedStore(storage, directory, "snap_{step}")
    saver = ShardedSaver(store, groups)
    guard = StagingGuard()  # the SHARDED extension's: the step pre-hook validates the copy
    guard.guard([optimizer])
    guard.track(saver)
    dcp_group = dist.new_group(backend="gloo")
    rows: dict[str, list[float]] = {k: [] for k in (
        "snapkeep_stall", "snapkeep_copy_wait", "snapkeep_durable", "snapkeep_stall_in_call",
        "dcp_save", "dcp_async_stall",
        "dcp_async_durable", "snapkeep_load", "dcp_load", "snapkeep_load_resharded",
        "dcp_load_resharded", "raw_write_fsync", "raw_direct_write_fsync")}
    phases: dict[str, list[float]] = {k: [] for k in PHASES}

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, optimizer)
        return {"models": {"main": msd}, "optimizers": {"main": osd}}

    def snapkeep_save(i: int) -> None:
        dist.barrier()
        start = time.perf_counter()
        handle = saver.save(state(), ShardedJob(name=f"snap_{i}", step=i),
                            overlap=frozenset(owned_storages([optimizer])))
        stall = time.perf_counter() - start
        saver.settle_overlap(block=True)
        copy_wait = time.perf_counter() - start - stall
        saver.wait()
        handle.committed.result()
        durable = time.perf_counter() - start
        rows["snapkeep_stall"].append(_slowest(stall))
        rows["snapkeep_copy_wait"].append(_slowest(copy_wait))
        rows["snapkeep_durable"].append(_slowest(durable))
        seen = {"stage": saver.last_stage_s, **getattr(saver, "last_commit_phases_s", {})}
        for key, value in zip(PHASES, _slowest_each([seen.get(k, 0.0) for k in PHASES])):
            phases[key].append(value)

    def snapkeep_in_call(i: int) -> None:
        dist.barrier()
        start = time.perf_counter()
        saver.save(state(), ShardedJob(name=f"snap_{1000 + i}", step=1000 + i))
        rows["snapkeep_stall_in_call"].append(_slowest(time.perf_counter() - start))
        saver.wait()

    def dcp_save(i: int) -> None:
        dist.barrier()
        rows["dcp_save"].append(_slowest(_timed(
            dcp.save, state(), checkpoint_id=os.path.join(base, f"dcp{world}_{i}"))))

    def dcp_async(i: int) -> None:
        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save(state(), checkpoint_id=os.path.join(base, f"dcpa{world}_{i}"),
                                process_group=dcp_group)
        stall = time.perf_counter() - start
        future.result()
        durable = time.perf_counter() - start
        rows["dcp_async_stall"].append(_slowest(stall))
        rows["dcp_async_durable"].append(_slowest(durable))

    def raw(i: int, direct: bool = False) -> None:
        where = os.path.join(base, f"raw{world}_{i}")
        os.makedirs(where, exist_ok=True)
        dist.barrier()
        rows["raw_direct_write_fsync" if direct else "raw_write_fsync"].append(_raw_write(
            state(), os.path.join(where, f"rank{rank}"), where, direct=direct))
        os.remove(os.path.join(where, f"rank{rank}"))

    def raw_direct(i: int) -> None:
        raw(i, direct=True)

    def loads(i: int) -> None:
        def snapkeep_load() -> None:
            target = state()
            entry = store.entries()[-1]
            _cold(entry.path)
            rows["snapkeep_load"].append(_slowest(_timed(
                load_sharded, store, entry, target, groups=groups)))

        def dcp_load() -> None:
            target = state()
            _cold(os.path.join(base, f"dcp{world}_{i}"))
            rows["dcp_load"].append(_slowest(_timed(
                dcp.load, target, checkpoint_id=os.path.join(base, f"dcp{world}_{i}"))))

        # ABBA within the repeat and BAAB in the next: each loader goes first, second, third
        # and fourth equally often (two samples of each per repeat)
        first, second = (snapkeep_load, dcp_load) if i % 2 == 0 else (dcp_load, snapkeep_load)
        for load in (first, second, second, first):
            load()

    contenders = [snapkeep_save, snapkeep_in_call, dcp_save, dcp_async, raw, raw_direct]
    for i in range(args.repeats):
        shift = i % len(contenders)  # rotating order: each goes first once in five repeats
        for contender in contenders[shift:] + contenders[:shift]:
            contender(i)
        dist.barrier()
        loads(i)
        if previous is not None:
            old_storage, old_dir = resolve_storage(os.path.join(base, f"w{previous}"))
            old_store = ShardedStore(old_storage, old_dir, "snap_{step}")
            old_entry = old_store.entries()[-1]
            target = state()
            _cold(old_entry.path)
            rows["snapkeep_load_resharded"].append(_slowest(_timed(
                load_sharded, old_store, old_entry, target, groups=groups)))
            target = state()
            _cold(os.path.join(base, f"dcp{previous}_0"))
            rows["dcp_load_resharded"].append(_slowest(_timed(
                dcp.load, target, checkpoint_id=os.path.join(base, f"dcp{previous}_0"))))
    saver.close()
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    # global sizes (a DTensor's numel is the global one): parameters + Adam's two moments
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    if rank == 0:
        summary: dict[str, Any] = {k: statistics.median(v) if v else None
                                   for k, v in rows.items()}
        summary.update({f"{k}_range": [min(v), max(v)] for k, v in rows.items() if v})
        summary["phases"] = {k: statistics.median(v) for k, v in phases.items() if v}
        summary["raw"] = {"rows": rows, "phases": phases}
        summary.update(world=world, peak_rss_mib_max_rank=float(rss.item()),
                       state_mib_total=state_bytes / 2**20)
        with open(results, "w") as f:
            json.dump(summary, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    table = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as base:
        previous = None
        for world in sorted(args.worlds, reverse=True):
            results = os.path.join(base, f"results{world}.json")
            mp.spawn(rank_main, args=(world, args, base, results, previous), nprocs=world,
                     join=True)
            with open(results) as f:
                table.append(json.load(f))
            previous = world
    load_after = os.getloadavg()
    for row in table:
        if row.get("snapkeep_stall") is not None and row.get("snapkeep_copy_wait") is not None:
            row["snapkeep_stall_and_copy_wait"] = row["snapkeep_stall"] + row["snapkeep_copy_wait"]
    for row in table:  # each repeat's two loads of each, ABBA: the ratio of the pair's sums
        sk, dc = row["raw"]["rows"]["snapkeep_load"], row["raw"]["rows"]["dcp_load"]
        pairs = [(sk[i] + sk[i + 1]) / (dc[i] + dc[i + 1])
                 for i in range(0, min(len(sk), len(dc)) - 1, 2)]
        if pairs:
            row["load_ratio_paired"] = statistics.median(pairs)
            row["load_ratio_paired_range"] = [min(pairs), max(pairs)]
    for row in table:  # the machine is shared: say how busy it was
        row.update(load_avg_before=list(load_before), load_avg_after=list(load_after),
                   hidden=args.hidden, layers=args.layers, repeats=args.repeats)

    def fmt(row: dict[str, Any], key: str) -> str:
        v = row.get(key)
        if v is None:
            return "-"
        lo, hi = row.get(f"{key}_range", [v, v])
        return f"{v:.3f} ({lo:.3f}-{hi:.3f})"

    def ratio(row: dict[str, Any], a: str, b: str) -> str:
        return "-" if row.get(a) is None or not row.get(b) else f"{row[a] / row[b]:.2f}"

    lines = ["| ranks | state MiB | snapkeep stall s | DCP async stall s | stall / DCP async | "
             "copy wait at the next step s | stall in call s | "
             "snapkeep durable s | DCP save s | durable / DCP save | DCP async durable s | "
             "raw write+fsync s | raw O_DIRECT write+fsync s | snapkeep load s | DCP load s | "
             "load / DCP | "
             "snapkeep load resharded s | DCP load resharded s | peak RSS MiB/rank |",
             "|" + "---|" * 19]
    for row in table:
        lines.append(
            f"| {row['world']} | {row['state_mib_total']:.0f} | {fmt(row, 'snapkeep_stall')} | "
            f"{fmt(row, 'dcp_async_stall')} | "
            f"{ratio(row, 'snapkeep_stall', 'dcp_async_stall')} | "
            f"{fmt(row, 'snapkeep_copy_wait')} | {fmt(row, 'snapkeep_stall_in_call')} | "
            f"{fmt(row, 'snapkeep_durable')} | {fmt(row, 'dcp_save')} | "
            f"{ratio(row, 'snapkeep_durable', 'dcp_save')} | {fmt(row, 'dcp_async_durable')} | "
            f"{fmt(row, 'raw_write_fsync')} | {fmt(row, 'raw_direct_write_fsync')} | "
            f"{fmt(row, 'snapkeep_load')} | "
            f"{fmt(row, 'dcp_load')} | {ratio(row, 'snapkeep_load', 'dcp_load')} | "
            f"{fmt(row, 'snapkeep_load_resharded')} | {fmt(row, 'dcp_load_resharded')} | "
            f"{row['peak_rss_mib_max_rank']:.0f} |")
    lines += ["", "snapkeep's time to durable by phase (median over repeats of the slowest "
              "rank's seconds):", "",
              "| ranks | " + " | ".join(PHASES) + " | sum | durable |",
              "|" + "---|" * (len(PHASES) + 3)]
    for row in table:
        ph = row["phases"]
        lines.append(f"| {row['world']} | " + " | ".join(f"{ph.get(k, 0.0):.3f}" for k in PHASES)
                     + f" | {sum(v for k, v in ph.items() if k != 'await_commit'):.3f} | "
                     f"{row['snapkeep_durable']:.3f} |")
    lines += ["", f"load average (1, 5, 15 min) before {load_before}, after {load_after}"]
    lines += ["", "issue 34's targets (medians; met / not met):", ""]
    for row in table:
        checks = [("durable <= DCP save", "snapkeep_durable", "dcp_save", 1.0),
                  ("stall <= 0.25x DCP async_save", "snapkeep_stall", "dcp_async_stall", 0.25),
                  ("stall + copy wait (no compute to hide it) <= DCP async_save",
                   "snapkeep_stall_and_copy_wait", "dcp_async_stall", 1.0),
                  ("load <= DCP load", "snapkeep_load", "dcp_load", 1.0)]
        paired = row.get("load_ratio_paired")
        lines.append(f"- {row['world']} ranks: " + "; ".join(
            f"{label}: {row[a] / row[b]:.2f}x, {'met' if row[a] <= limit * row[b] else 'not met'}"
            for label, a, b, limit in checks if row.get(a) is not None and row.get(b))
            + ("" if paired is None else
               f"; load / DCP load, median of the repeats' paired ratios: {paired:.2f}x "
               f"({row['load_ratio_paired_range'][0]:.2f}-{row['load_ratio_paired_range'][1]:.2f}),"
               f" {'met' if paired <= 1.0 else 'not met'}"))
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
