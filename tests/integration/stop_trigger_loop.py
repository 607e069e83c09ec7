"""A manager loop stopped by an EarlyStoppingTrigger checked per epoch (3 iterations each),
snapshotted at each epoch end and autoloaded (run by test_stop_trigger_kill.py).

Usage: ``python stop_trigger_loop.py OUT_DIR``. Prints ``iteration N`` after each iteration; at
the end writes ``OUT_DIR/final.pt`` with the iteration, the weights and the trigger's state.
"""

from __future__ import annotations

import os
import sys

import torch

import snapkeep.reporting as reporting
from snapkeep import writing
from snapkeep.training import ExtensionsManager
from snapkeep.training import extensions as ext
from snapkeep.training.triggers import EarlyStoppingTrigger

#: The mean loss of each epoch (1-based): improves until epoch 3, then never again, so a
#: patience of 3 stops at the end of epoch 6 (iteration 18).
LOSSES = [None, 10.0, 9.0, 8.0, 8.5, 8.4, 8.3, 8.2, 8.1, 8.05, 8.04, 8.03]


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = EarlyStoppingTrigger(check_trigger=(1, "epoch"), monitor="main/loss", patience=3,
                                max_trigger=(10, "epoch"))
    manager = ExtensionsManager(model, {"main": optimizer}, 10, iters_per_epoch=3,
                                stop_trigger=stop, out_dir=out,
                                writer=writing.SimpleWriter(out_dir=out))
    manager.extend(ext.snapshot(autoload=True), trigger=(1, "epoch"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            iteration = manager.iteration + 1
            reporting.report({"main/loss": LOSSES[(iteration - 1) // 3 + 1]
                              + 0.01 * (iteration % 3)})
            model.weight.data += 0.01 * iteration
        print("iteration", manager.iteration, flush=True)
    torch.save({"iteration": manager.iteration, "weight": model.weight.detach(),
                "stop": stop.state_dict()},
               os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main()
