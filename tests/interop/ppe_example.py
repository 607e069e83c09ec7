"""A training script shaped like ppe's examples, run by test_interop.py in a subprocess.

    python ppe_example.py MODE WRITER OUT [--rng-object]

MODE:
  sk-ext      ppe's ExtensionsManager + snapkeep's snapshot extension (plug-in path)
  ppe-ext     ppe's ExtensionsManager + ppe's snapshot with a snapkeep writer (plug-in path);
              the global RNG states travel in ``state_objects={'rng': RngState()}``
  swap        ``import snapkeep as ppe`` and nothing else changed (import swap)
  ppe-native  ppe only (ppe's snapshot and writer): a directory written by ppe
WRITER: a writer class name of ``ppe.writing`` (snapkeep's, except in ppe-native).
--rng-object: also register ``state_objects={'rng': snapkeep.training.RngState()}``.

Environment: ``SNAPKEEP_EXAMPLE_KILL_AT=N`` makes the script wait until its snapshots are durable
and SIGKILL itself before iteration N+1. Prints one JSON line per event: ``start`` (the iteration
training starts from, after autoload) and ``end`` (final iteration, sha256 of the parameters).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

import torch

MODE, WRITER, OUT = sys.argv[1:4]
RNG_OBJECT = "--rng-object" in sys.argv[4:]
EPOCHS = 4
KILL_AT = int(os.environ.get("SNAPKEEP_EXAMPLE_KILL_AT", "-1"))

if MODE == "swap":
    import snapkeep as ppe
    writing = ppe.writing
else:
    import pytorch_pfn_extras as ppe

    import snapkeep
    writing = ppe.writing if MODE == "ppe-native" else snapkeep.writing

torch.manual_seed(0)
torch.set_num_threads(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                            torch.nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)

state_objects = {}
if RNG_OBJECT or MODE == "ppe-ext":
    import snapkeep.training

    state_objects["rng"] = snapkeep.training.RngState()

writer = getattr(writing, WRITER)(out_dir=OUT)
if MODE == "sk-ext":
    from snapkeep.training import extensions as snapshot_extensions
else:
    snapshot_extensions = ppe.training.extensions
snapshot = snapshot_extensions.snapshot(autoload=True, n_retains=2, writer=writer)

ext = ppe.training.extensions
manager = ppe.training.ExtensionsManager(
    model, optimizer, EPOCHS, iters_per_epoch=len(loader), out_dir=OUT,
    extensions=[ext.LogReport(), ext.observe_lr(optimizer=optimizer),
                ext.LRScheduler(scheduler)],
    state_objects=state_objects,
)
manager.extend(snapshot)

started = False
while not manager.stop_trigger:
    if not started:
        print(json.dumps({"event": "start", "iteration": manager.iteration}), flush=True)
        started = True
    for x, t in loader:
        if manager.iteration == KILL_AT:
            wait = getattr(writer, "wait", None)
            if callable(wait):
                wait(timeout_s=60)  # the snapshots taken so far are durable
            os.kill(os.getpid(), signal.SIGKILL)
        with manager.run_iteration(step_optimizers=["main"]):
            loss = torch.nn.functional.cross_entropy(model(x), t)
            ppe.reporting.report({"train/loss": loss.item()})
            loss.backward()
manager.finalize()

digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.detach().numpy().tobytes())
print(json.dumps({"event": "end", "iteration": manager.iteration, "params": digest.hexdigest()}),
      flush=True)
