"""One rank of ``python -m snapkeep.demo_sharded`` for test_demo_sharded.py, started by
tests/support/ranks.py (gloo over env://, as torchrun would set it up).

Usage: ``python demo_sharded_worker.py RANK WORLD_SIZE PORT REPORT_DIR KILL_AT DEMO_ARGS...``.

Around the demo's own ``main``:

- an audit hook records every snapshot file that was on storage (``--out``) before the start
  and is opened for reading during ``manager.start_extensions()`` (the resume): the proof that a
  resume from RAM reads no saved state from storage;
- KILL_AT > 0: once the memory tier committed step KILL_AT and its peer copies are done, every
  rank SIGKILLs itself after a barrier (the whole job lost at once, no finalize: the tiers
  stay);
- ``REPORT_DIR/report_rank<RANK>.json``: the iteration resumed, the tier's ``Restored`` source,
  the storage files read, the resume time (seconds; the tier's recovery alone as ``tier_s``),
  and the demo's summary.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch.distributed as dist

from snapkeep import demo_sharded
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext
from support.storage_reads import StorageReads


def main() -> None:
    rank, world, port, report_dir, kill_at = sys.argv[1:6]
    argv = sys.argv[6:]
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    out = argv[argv.index("--out") + 1]
    storage = StorageReads(out)
    report: dict[str, Any] = {}
    start_extensions = ExtensionsManager.start_extensions

    def recorded_start(manager: ExtensionsManager, *args: Any, **kwargs: Any) -> Any:
        if manager._start_extensions_called:  # every status read calls it again
            return start_extensions(manager, *args, **kwargs)
        began = time.perf_counter()
        result = start_extensions(manager, *args, **kwargs)
        report["resume_s"] = time.perf_counter() - began
        storage.recording = False
        tier = next((e.extension for e in manager._extensions.values()
                     if isinstance(e.extension, tier_type)), None)
        restored = getattr(tier, "restored", None)
        report.update(start=manager.iteration, storage_reads=list(storage.reads),
                      source=restored.source if restored else None)
        return result

    ExtensionsManager.start_extensions = recorded_start  # type: ignore[method-assign]
    tier_type = type(ext.memory_tier(ext.MemoryTier(every=1)))
    initialize = tier_type.initialize

    def timed_initialize(self: Any, manager: ExtensionsManager) -> None:
        began = time.perf_counter()
        initialize(self, manager)
        report["tier_s"] = time.perf_counter() - began  # the tier's recovery alone

    tier_type.initialize = timed_initialize  # type: ignore[method-assign]
    if int(kill_at) > 0:
        commit = tier_type.__call__

        def commit_then_die(self: Any, manager: ExtensionsManager) -> None:
            commit(self, manager)
            if manager.iteration >= int(kill_at):
                self.wait()  # the peer copies of this step are in RAM
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)

        tier_type.__call__ = commit_then_die  # type: ignore[method-assign]
    summary: dict[str, Any] = {}
    run = demo_sharded.run_sharded_demo

    def recorded_run(config: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        summary.update(run(config, *args, **kwargs))
        return summary

    demo_sharded.run_sharded_demo = recorded_run  # type: ignore[assignment]
    demo_sharded.main(argv)
    report["summary"] = summary
    with open(os.path.join(report_dir, f"report_rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
